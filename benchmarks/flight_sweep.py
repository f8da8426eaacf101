"""Stop one rank (SIGSTOP, as `kill -STOP` does) at random moments of a running job, and check
that the timeout lines and `mpishard flight` agree.

    python benchmarks/flight_sweep.py --trials 40 --seed 1      # make flight-sweep

Each trial starts a job of 2 or 4 ranks (dp=2, or dp=2,tp=2) training a small MLP with a short
engine timeout and the flight recorder on, waits until every rank runs, sleeps a random moment
and stops one random rank. The others time out; the job aborts. Then (`problems`):

- every timeout line names the late ranks, or says in words why it cannot (never `late ranks:
  []`), and at least one of them names the stopped rank;
- `mpishard flight` on the dumps never contradicts what a timeout's arrival counters found
  (the dumps' "arrivals"): a rank they found inside the call is not said to have never entered
  it, nor a rank they found late to be inside it;
- on 2 ranks, where the stopped rank is the only peer, flight's verdict names it.

Not part of `make test` (tests/hpc/test_flight_faults.py runs a fixed, seeded handful of
moments); prints one line per trial and a summary, exit 1 on any problem. Measured counts: the
"flight sweep" section of benchmarks/results.md. After each trial the MPI library's /dev/shm
files that any rank of the job mapped are removed: the stopped rank and the ranks that abort
on their timeout leave them behind.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kernels import true_kernel_env

ROOT = Path(__file__).resolve().parents[1]

JOB = '''
import os, signal, sys, threading, time
import numpy as np
from mpi4py import MPI
import mpishard as ms
from mpishard.health.guard import Guard

directory, timeout, inside = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
model = ms.MLP([8, 16, 4])
engine = ms.make_engine(model, "dp=2" if n == 2 else "dp=2,tp=2", comm=comm, timeout=timeout)
engine.comm.flight.redirect(directory)
engine.load_checkpoint(model.init(seed=0))
rng = np.random.default_rng(rank)
x, t = rng.standard_normal((8, 8)), rng.standard_normal((8, 4))
loss = ms.losses.MSE()


last = threading.Event()                                # step 10's last all_reduce is next


def stop_inside():
    """Rank `inside` stops itself inside step 10's last all_reduce (its peers come 0.5 s
    late): asleep until step 10 is done, then a look every 5 ms for the call it is in."""
    last.wait()
    while True:
        call = Guard.SHARED.in_flight
        time.sleep(0.05 if call else 0.005)
        if call is not None and Guard.SHARED.in_flight is call:      # still in that one call
            os.kill(os.getpid(), signal.SIGSTOP)


if rank == inside:
    threading.Thread(target=stop_inside, daemon=True).start()
os.write(1, f"pid {rank} {os.getpid()}\\n".encode())     # one write: never mixed with another's
comm.Barrier()
for step in range(1, 1_000_000):                        # until a rank is stopped
    engine.comm.context(step=step)
    engine.train_step(engine.shard_batch(x), engine.shard_batch(t), loss)
    sum(i * i for i in range(int(rng.integers(1, 3000))))      # work outside communication
    if step == 10 and inside >= 0:
        last.set()
        if rank != inside:
            time.sleep(0.5)
    if engine.all_reduce(np.array([float(os.path.exists(directory + ".stop")), 1, 1]))[0]:
        break                                           # told to stop: every rank at once
'''

TIMEOUT_LINE = re.compile(r"CollectiveTimeout: (\S+) on group (\S+) \(ranks (\[[\d, ]*\])\) "
                          r"timed out .*?: late ranks: (.*?); set make_engine")
ENV = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}


def mpiexec() -> list:
    exe = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    found = shutil.which(exe) or shutil.which("mpiexec")
    if found is None:
        raise SystemExit(f"no mpiexec: {exe} not found and none on PATH")
    return [found, *os.environ.get("MPIEXEC_FLAGS", "").split()]


def _mpi_segments(pid: int) -> list:
    """The MPI library's /dev/shm files that process `pid` maps (health/signals.py's patterns)."""
    patterns = ("mpich_shm_", "sm_segment.", "vader_segment.", "ucx_shm_posix_")
    try:
        text = Path(f"/proc/{pid}/maps").read_text()
    except OSError:
        return []
    return sorted({f.split(maxsplit=5)[5] for f in text.splitlines()
                   if len(f.split(maxsplit=5)) == 6 and f.split(maxsplit=5)[5].startswith(
                       tuple("/dev/shm/" + p for p in patterns))})


def _remove(paths) -> None:
    """Unlink `paths` (a job's MPI segments once its ranks are gone); a missing one is fine."""
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def stop_once(workdir, n: int, victim: int, delay, timeout: float = 2.0) -> dict:
    """One trial (module docstring) in `workdir`: the job's stderr, flight's output, the dumps.
    `delay` None: the victim stops itself inside a collective (step 10's last all_reduce, which
    its peers enter 0.5 s late), not at a moment this process picks."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    script, directory = workdir / "job.py", workdir / "flight"
    script.write_text(JOB)
    out_path, err_path = workdir / "out.txt", workdir / "err.txt"
    # this tree's mpishard, in the ranks too
    env = dict(true_kernel_env(os.environ), **ENV, PYTHONPATH=str(ROOT))
    with open(out_path, "w") as out, open(err_path, "w") as err:
        job = subprocess.Popen([*mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py",
                                str(script), str(directory), str(timeout),
                                str(victim if delay is None else -1)], cwd=ROOT, env=env,
                               stdout=out, stderr=err)
    pids, segments = {}, []
    try:
        deadline = time.monotonic() + 90
        while len(pids) < n:
            if job.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the job did not start:\n{err_path.read_text()[-3000:]}")
            pids = {int(r): int(p) for r, p in re.findall(r"^pid (\d+) (\d+)$",
                                                           out_path.read_text(), re.M)}
            time.sleep(0.05)
        segments = sorted({p for pid in pids.values() for p in _mpi_segments(pid)})
        if delay is not None:
            time.sleep(delay)
            os.kill(pids[victim], signal.SIGSTOP)
        code = job.wait(timeout=60 + 4 * timeout)
    finally:
        if job.poll() is None:
            job.kill()
            code = job.wait()
        for pid in pids.values():               # a stopped rank the launcher did not reap
            try:
                if str(directory) in Path(f"/proc/{pid}/cmdline").read_text():
                    os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        _remove(segments)                       # what the killed and aborted ranks left
    flight = subprocess.run([sys.executable, "-m", "mpishard", "flight", str(directory)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    dumps = {}
    for path in glob.glob(str(directory / "flight-rank*.json")):
        d = json.loads(Path(path).read_text())
        dumps[d["rank"]] = d
    return {"n": n, "victim": victim, "delay": delay, "code": code,
            "stderr": err_path.read_text(), "flight": flight.stdout + flight.stderr,
            "flight_code": flight.returncode, "dumps": dumps}


def snapshot_once(workdir, n: int, delay: float) -> dict:
    """A healthy job of `n` ranks: `delay` s after they all run, SIGUSR2 to every rank (each
    dumps and goes on), then told to stop, it ends cleanly; flight's output on the dumps."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    script, directory = workdir / "job.py", workdir / "flight"
    script.write_text(JOB)
    env = dict(true_kernel_env(os.environ), **ENV, PYTHONPATH=str(ROOT))
    job = subprocess.Popen([*mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", str(script),
                            str(directory), "30", "-1"], cwd=ROOT, env=env, text=True,
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    segments = []
    try:
        pids, seen = [], []
        while len(pids) < n:
            line = job.stdout.readline()
            if not line:
                raise RuntimeError(f"the job did not start:\n{''.join(seen)[-3000:]}")
            seen.append(line)
            pids += [int(p) for p in re.findall(r"^pid \d+ (\d+)$", line)]
        segments = sorted({p for pid in pids for p in _mpi_segments(pid)})
        time.sleep(delay)
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)
        time.sleep(1.0)
        Path(f"{directory}.stop").touch()
        out, _ = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
            _remove(segments)                   # its ranks were killed before MPI_Finalize
    flight = subprocess.run([sys.executable, "-m", "mpishard", "flight", str(directory)],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    return {"code": job.returncode, "output": out, "flight": flight.stdout + flight.stderr}


def problems(result) -> list:
    """What is wrong with one trial (module docstring); [] when nothing."""
    n, victim, text = result["n"], result["victim"], result["flight"]
    found = []
    lines = TIMEOUT_LINE.findall(result["stderr"])
    if result["code"] == 0 or not lines:
        found.append(f"no timeout line (exit {result['code']})")
    named = False
    for what, group, ranks, late in lines:
        if re.match(r"\[\]", late) or not late.strip():
            found.append(f"an empty late list: {what} on {group}: late ranks: {late}")
        named = named or re.search(rf"\b{victim}\b", late) is not None
    if lines and not named:
        found.append(f"no timeout line names the stopped rank {victim}: "
                     f"{[line[3] for line in lines]}")
    if result["flight_code"] != 0:
        found.append(f"flight failed: {text[-500:]}")
        return found
    divergence = re.search(r"^first divergence: collective #(\d+) on group (\S+) \(ranks "
                           r"(\[[\d, ]*\])\)", text, re.M)
    said = dict(re.findall(r"^  rank (\d+): (.*)$", text[divergence.end():], re.M)
                ) if divergence else {}
    for rank, d in result["dumps"].items():
        arrivals = d.get("arrivals")
        if not divergence or not arrivals or arrivals["group"] != divergence[2] or \
                str(arrivals["ranks"]) != divergence[3]:
            continue
        for r in arrivals["entered"]:
            if "never entered" in said.get(str(r), ""):
                found.append(f"rank {rank}'s counters found rank {r} in the call; flight: "
                             f"rank {r}: {said[str(r)]}")
        for r in arrivals["late"]:
            if "never left" in said.get(str(r), ""):
                found.append(f"rank {rank}'s counters found rank {r} late; flight: "
                             f"rank {r}: {said[str(r)]}")
    verdict = next((line for line in text.splitlines() if line.startswith("verdict: ")), "")
    if n == 2 and not re.match(rf"verdict: rank {victim} (never entered|entered)", verdict):
        found.append(f"flight's verdict does not name the stopped rank {victim}: {verdict}")
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=40)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ranks", default="2,4", help="world sizes to draw from (2 and/or 4)")
    p.add_argument("--timeout", type=float, default=2.0, help="the engine's timeout (s)")
    p.add_argument("--max-delay", type=float, default=1.5, help="latest stop after start (s)")
    args = p.parse_args(argv)
    rng = random.Random(args.seed)
    sizes = [int(s) for s in args.ranks.split(",")]
    bad, kinds = 0, {}
    with tempfile.TemporaryDirectory(prefix="flight-sweep-") as tmp:
        for trial in range(args.trials):
            n = rng.choice(sizes)
            victim, delay = rng.randrange(n), round(rng.uniform(0, args.max_delay), 3)
            result = stop_once(Path(tmp) / str(trial), n, victim, delay, args.timeout)
            wrong = problems(result)
            verdict = next((line for line in result["flight"].splitlines()
                            if line.startswith("verdict: ")), "(no verdict)")
            kind = "inside" if "never left it" in verdict else "never entered" \
                if "never entered" in verdict else "other"
            kinds[kind] = kinds.get(kind, 0) + 1
            bad += bool(wrong)
            print(f"trial {trial}: {n} ranks, rank {victim} stopped at {delay:.3f} s: "
                  f"{'PROBLEM' if wrong else 'ok'} ({kind}) -- {verdict[9:][:150]}", flush=True)
            for w in wrong:
                print(f"    {w}", flush=True)
    print(f"flight sweep: {args.trials} trials, {bad} with a problem; verdicts {kinds}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""A train job started in the background, watched through its metrics JSON lines, signalled.

    job = RunningJob([*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", "-m", "mpishard",
                      "train", ...], marker=str(ckpt))
    job.wait_for_step(jsonl, 100)          # the run's own record of step >= 100
    job.signal(signal.SIGUSR1, ranks=[1])  # the rank processes (PMI_RANK) of this job only
    rc, out = job.finish(timeout=120)

The ranks are found in /proc: python processes whose command line holds `marker` (a path
unique to the test), with their rank in the environment (RANK_VARIABLES).
Files the MPI library leaves when a rank is SIGKILLed are removed by `finish(killed=True)`.
"""
import json
import os
import subprocess
import time

import leftovers

# The rank in a rank process's environment: MPICH's hydra, Open MPI, PMIx.
RANK_VARIABLES = (b"PMI_RANK", b"OMPI_COMM_WORLD_RANK", b"PMIX_RANK")


class RunningJob:
    def __init__(self, argv, marker: str, env=None, cwd=None):
        self.marker, self.before = marker, leftovers.mpi_files()
        env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
        self.proc = subprocess.Popen(list(map(str, argv)), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, cwd=cwd)

    def wait_for_step(self, jsonl, step: int, timeout: float = 120.0) -> int:
        """Block until `jsonl` holds a train record of a step >= `step`; returns that step."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"the job ended early:\n{self.proc.stdout.read()}"
            last = last_step(jsonl)
            if last is not None and last >= step:
                return last
            time.sleep(0.02)
        raise AssertionError(f"no step {step} in {jsonl} after {timeout} s")

    def wait_for_files(self, where, name, ranks=(0, 1), why=None, timeout: float = 120.0):
        """Block until `where/<name>.<rank>` exists for each of `ranks` (held_train.py writes
        them) while the job runs; `why`: the failure's message."""
        deadline = time.monotonic() + timeout
        while not all((where / f"{name}.{r}").exists() for r in ranks):
            assert self.proc.poll() is None, self.proc.stdout.read()
            assert time.monotonic() < deadline, why or f"no {name} file from ranks {ranks}"
            time.sleep(0.02)

    def ranks(self) -> dict:
        """{rank: pid} of this job's rank processes."""
        found = {}
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.proc.pid:
                continue
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    argv = f.read().split(b"\0")
                with open(f"/proc/{entry}/environ", "rb") as f:
                    environ = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
            except OSError:
                continue
            rank = next((environ[k] for k in RANK_VARIABLES if k in environ), None)
            if b"mpi4py" in argv and any(self.marker.encode() in a for a in argv) \
                    and rank is not None:
                found[int(rank)] = int(entry)
        return found

    def signal(self, signum, ranks=None) -> list:
        """Send `signum` to the given ranks (default: all); returns the pids signalled."""
        pids = self.ranks()
        chosen = [pids[r] for r in (sorted(pids) if ranks is None else ranks)]
        for pid in chosen:
            os.kill(pid, signum)
        return chosen

    def finish(self, timeout: float = 120.0, killed: bool = False):
        """(exit code, output); with `killed` the MPI files the job left are removed."""
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            for path in leftovers.left_since(self.before) if killed else ():
                try:                    # hydra's proxy may remove its own file meanwhile
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        return self.proc.returncode, out


def last_step(jsonl):
    """The step of the last complete train record in `jsonl`, or None."""
    try:
        with open(jsonl) as f:
            lines = [s for s in f.read().splitlines(keepends=True) if s.endswith("\n")]
    except FileNotFoundError:
        return None
    steps = [r["step"] for r in map(json.loads, lines) if r["kind"] == "train"]
    return steps[-1] if steps else None


def train_steps(jsonl) -> list:
    """The steps of every train record in `jsonl`, in order."""
    with open(jsonl) as f:
        return [r["step"] for r in map(json.loads, f) if r["kind"] == "train"]

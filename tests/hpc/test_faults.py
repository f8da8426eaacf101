"""Faults injected into real jobs: each one ends the job non-zero within `timeout + 10 s` of the
fault (the faulty rank prints `fault at T`), with a message naming the cause (issue 14; the stall
watchdog is health/watchdog.py).

Serial tests: each launches `mpiexec -n 2` (layout dp=2) or `-n 4` (dp=2,tp=2) running SCRIPT
under `python -m mpi4py`, with a 2 s engine timeout. The last rank is the faulty one; at step 3
of 5 it raises, is SIGKILLed, feeds a batch of the wrong width, sleeps past the timeout inside
the loss, or skips a collective (the last one, so its peers wait in it; or, in debug mode, one
in the middle of the loop, so the signature check sees the next collective instead). Last, the
last rank's checkpoint write fails (through the `writer.write_block` hook) under each
--checkpoint-failures policy. Every job records the MPI library's files it uses (its /dev/shm
segments, hydra's topology file) and none may be left after the abort (health/signals.py), except
after a SIGKILL, which no process of the job can clean up after: that test removes them itself.
"""
import json
import os
import re
import time
from pathlib import Path

import pytest

import mpishard as ms
from conftest import run_mpi

TIMEOUT = 2.0

SCRIPT = '''
import json, os, signal, sys, time
import numpy as np
from mpi4py import MPI
import mpishard as ms
from mpishard.health.signals import launcher_files, mapped_shm_paths, mpi_shm_paths, read_own_maps

mode, timeout = sys.argv[1], float(sys.argv[2])
comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
faulty = rank == n - 1


def fault_stamp():
    print(f"fault at {time.time():.3f}", flush=True)


model = ms.MLP([8, 16, 4])
engine = ms.make_engine(model, "dp=2" if n == 2 else "dp=2,tp=2", comm=comm, timeout=timeout)
engine.load_checkpoint(model.init(seed=0))
with open(f"{sys.argv[3]}.{rank}", "w") as f:         # the MPI library's files of this job
    json.dump(mpi_shm_paths(mapped_shm_paths(read_own_maps())) + launcher_files(), f)
rng = np.random.default_rng(0)
x, t = rng.standard_normal((8, 8)), rng.standard_normal((8, 4))


class Loss(ms.losses.MSE):
    """The MSE, with the fault injected on the faulty rank at step 3."""
    step = 0

    def __call__(self, y, target):
        if faulty and self.step == 3:
            fault_stamp()
            if mode == "raise":
                raise RuntimeError(f"rank {rank} fails mid-step")
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if mode == "sleep":
                time.sleep(timeout + 30)
        return super().__call__(y, target)


loss = Loss()
for step in range(1, 6):
    loss.step = step
    engine.comm.context(step=step)
    xs = engine.shard_batch(x)
    if mode == "shape" and faulty and step == 3:
        fault_stamp()
        xs = xs[:, :7]                                  # one feature short
    value, grads = engine.train_step(xs, engine.shard_batch(t), loss)
    metric = np.full(3, value)
    if not (mode == "skip-mid" and faulty and step == 3):
        engine.all_reduce(metric, group="dp")
if not (mode == "skip-last" and faulty):
    engine.all_reduce(np.ones(3))
else:
    fault_stamp()
print(f"rank {rank} finished", flush=True)
'''


def since_fault(proc, t0):
    """Seconds from the fault to the job's end: the faulty rank prints `fault at T` (wall clock)
    as it injects it, so the launcher's start-up (Open MPI's is seconds on a loaded machine) does
    not count; from the launch when no stamp came out."""
    stamps = [float(m) for m in re.findall(r"^fault at ([\d.]+)$", proc.stdout, re.M)]
    return time.time() - (min(stamps) if stamps else t0)


def run_fault(tmp_path, n, mode, debug=False):
    script = tmp_path / "fault.py"
    script.write_text(SCRIPT)
    t0 = time.time()
    files = tmp_path / "mpi-files"
    proc = run_mpi(n, script, mode, TIMEOUT, files, timeout=TIMEOUT + 60,
                   env={"MPISHARD_DEBUG": "1" if debug else "0"}, killed=mode == "kill")
    elapsed = since_fault(proc, t0)
    out = proc.stdout + proc.stderr
    used = sorted({p for r in range(n) if Path(f"{files}.{r}").exists()
                   for p in json.loads(Path(f"{files}.{r}").read_text())})
    left = [p for p in used if os.path.exists(p)]
    print(f"{mode} at {n} ranks (debug {debug}): rc={proc.returncode} after {elapsed:.1f} s; "
          f"MPI's files {used}, left {left}\n{out[-3000:]}")
    if mode == "kill":                   # SIGKILLed ranks clean nothing: the test does
        for path in left:
            os.unlink(path)
        left = []
    assert proc.returncode != 0
    assert elapsed < TIMEOUT + 10, f"the job took {elapsed:.1f} s to end"
    assert "rank 0 finished" not in out
    assert used and left == [], f"the aborted job left the MPI library's files {left}"
    return out


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_raises_mid_step(tmp_path, n):
    out = run_fault(tmp_path, n, "raise")
    assert f"rank {n - 1} fails mid-step" in out


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_is_killed(tmp_path, n):
    out = run_fault(tmp_path, n, "kill")
    assert re.search(r"KILLED|signal 9|BAD TERMINATION", out), "mpiexec names no killed rank"


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_feeds_a_wrong_shape(tmp_path, n):
    out = run_fault(tmp_path, n, "shape")
    assert re.search(r"ValueError: .*\b7\b", out), "no ValueError naming the width 7"


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_sleeps_past_the_timeout(tmp_path, n):
    """The waiting ranks raise CollectiveTimeout naming the operation and the sleeping rank.
    At 4 ranks its dp peer, rank 1, waits in step 3's gradient all_reduce; its tp peer, rank 2,
    needs no tp exchange in the rest of step 3 (the first layer's input gradient is not
    computed) and waits in step 4's first tp all_reduce; rank 0 waits there for rank 1."""
    out = run_fault(tmp_path, n, "sleep")
    assert "CollectiveTimeout" in out
    assert re.search(rf"all_reduce\S* on group \S+ \(ranks \[[\d, ]+\]\) timed out after 2 s "
                     rf"on rank \d, step [34]: late ranks: \[{n - 1}\]", out), out[-2000:]


@pytest.mark.parametrize("debug", [False, True])
@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_skips_the_last_collective(tmp_path, n, debug):
    out = run_fault(tmp_path, n, "skip-last", debug=debug)
    what = "all_reduce (debug check)" if debug else "all_reduce"
    assert re.search(rf"{re.escape(what)} on group world \(ranks \[[\d, ]+\]\) timed out after "
                     rf"2 s on rank \d, step 5: late ranks: \[{n - 1}\]", out), out[-2000:]


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_skips_a_collective_in_debug_mode(tmp_path, n):
    """The skipping rank's next dp collective (the gradient all_reduce of step 4) meets its
    peer's metric all_reduce in the signature check: CollectiveMismatchError names both."""
    out = run_fault(tmp_path, n, "skip-mid", debug=True)
    assert "CollectiveMismatchError: collective mismatch in all_reduce" in out
    assert "shape=(3,)" in out


CLI_SCRIPT = '''
import sys, time
from mpi4py import MPI
import mpishard as ms
from mpishard.cli import exit_cleanly, main


def stalls_on_rank_1(self, y, t, call=ms.losses.MSE.__call__):
    if MPI.COMM_WORLD.Get_rank() == 1:
        print(f"fault at {time.time():.3f}", flush=True)
        time.sleep(60)
    return call(self, y, t)


ms.losses.MSE.__call__ = stalls_on_rank_1
exit_cleanly(main(["train", "--dataset", "synthetic-regression", "--steps", "3",
                   "--no-progress", "--timeout", sys.argv[1]]))
'''


def test_the_cli_prints_a_timeout_as_one_line(tmp_path):
    """`train --timeout 2` with rank 1 stuck in the loss: rank 0 prints one error line naming
    the late rank (no traceback) and MPI_Abort ends the job, non-zero."""
    script = tmp_path / "cli_stall.py"
    script.write_text(CLI_SCRIPT)
    t0 = time.time()
    proc = run_mpi(2, script, TIMEOUT, timeout=TIMEOUT + 60,       # flight records: not in
                   env={"MPISHARD_FLIGHT_DIR": str(tmp_path)})     # the repository's root
    elapsed = since_fault(proc, t0)
    out = proc.stdout + proc.stderr
    print(f"rc={proc.returncode} after {elapsed:.1f} s\n{out[-3000:]}")
    assert proc.returncode != 0 and elapsed < TIMEOUT + 10
    assert re.search(r"^mpishard: error: CollectiveTimeout: all_reduce\S* on group \S+ .* timed "
                     r"out after 2 s on rank 0, step 1: late ranks: \[1\]", out, re.M), out[-2000:]
    assert "Traceback" not in out


def test_a_negative_timeout_is_a_usage_error(capsys):
    from mpishard.cli import main

    assert main(["train", "--dataset", "synthetic-regression", "--steps", "1", "--timeout", "-1",
                 "--no-progress"]) == 2
    assert "timeout must be >= 0, got -1" in capsys.readouterr().err


CKPT_SCRIPT = '''
import sys, time
from mpi4py import MPI
from mpishard.checkpoint import writer
from mpishard.cli import exit_cleanly, main

ckpt, policy, metrics = sys.argv[1:4]
comm = MPI.COMM_WORLD
rank, n = comm.Get_rank(), comm.Get_size()
write_block = writer.write_block


def full_disk_on_the_last_rank(path, arr):
    """writer.write_block, the documented test hook: the last rank's writes of the save at
    step 4 (its temporary directory is CKPT.tmp-4) fail as on a full disk."""
    if rank == n - 1 and ".tmp-4" in path:
        print(f"fault at {time.time():.3f}", flush=True)
        raise OSError(28, "No space left on device")
    write_block(path, arr)


writer.write_block = full_disk_on_the_last_rank
exit_cleanly(main(["train", "--dataset", "synthetic-classification", "--model", "16,16,4",
                   "--layout", "fsdp=2" if n == 2 else "fsdp=2,tp=2", "--steps", "6",
                   "--batch", "16", "--dtype", "float64", "--no-progress", "--log-every", "0",
                   "--timeout", "2", "--checkpoint-dir", ckpt, "--checkpoint-every", "2",
                   "--checkpoint-failures", policy, "--metrics-json", metrics]))
'''


def run_checkpoint_fault(tmp_path, n, policy):
    script, ckpt, metrics = tmp_path / "ckpt_fault.py", tmp_path / "ck", tmp_path / "m.json"
    script.write_text(CKPT_SCRIPT)
    t0 = time.time()
    proc = run_mpi(n, script, ckpt, policy, metrics, timeout=TIMEOUT + 60)
    elapsed = since_fault(proc, t0)
    out = proc.stdout + proc.stderr
    print(f"checkpoint write fault at {n} ranks ({policy}): rc={proc.returncode} after "
          f"{elapsed:.1f} s\n{out[-3000:]}")
    assert elapsed < TIMEOUT + 10, f"the job took {elapsed:.1f} s to end"
    assert "Traceback" not in out
    assert not list(tmp_path.glob("ck.tmp-*")), "a partial temporary directory is left"
    return proc, out, ms.checkpoint.load(ckpt)


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_s_checkpoint_write_fails_and_the_run_stops(tmp_path, n):
    """Default policy: every rank learns of the failed save at step 4 through the writer's
    collective verdict; rank 0 prints one line naming the rank and the cause, every rank exits
    2, and the step-2 checkpoint is still complete and verifies (sha256 of every file)."""
    proc, out, ckpt = run_checkpoint_fault(tmp_path, n, "stop")
    assert proc.returncode == 2
    errors = re.findall(r"^mpishard: error: .*$", out, re.M)
    assert len(errors) == 1, errors
    assert re.match(rf"mpishard: error: checkpoint save at step 4 failed: rank {n - 1}: "
                    r"OSError: \[Errno 28\] No space left on device; the last complete "
                    r"checkpoint \(step 2\) is intact", errors[0]), errors[0]
    assert ckpt.step == 2
    ckpt.verify()


@pytest.mark.parametrize("n", [2, 4])
def test_a_rank_s_checkpoint_write_fails_and_training_continues(tmp_path, n):
    """--checkpoint-failures continue: one warning line (rank 0), training goes on, the save
    at step 6 succeeds, the metrics count one failure."""
    proc, out, ckpt = run_checkpoint_fault(tmp_path, n, "continue")
    assert proc.returncode == 0, out[-2000:]
    warned = re.findall(r"WARNING .*checkpoint save at step 4 failed: rank \d: OSError", out)
    assert len(warned) == 1, out[-2000:]
    metrics = json.loads((tmp_path / "m.json").read_text())
    assert metrics["checkpoint_failures"] == 1 and metrics["checkpoint_last_step"] == 6
    assert ckpt.step == 6
    ckpt.verify()


def test_the_leftover_check_knows_the_mpi_library_s_file_names():
    """tests/hpc/leftovers.py keeps its own copy (it must not import mpishard, which starts MPI)."""
    import leftovers
    from mpishard.health.signals import MPI_SHM_PATTERNS
    assert leftovers.MPI_SHM_PATTERNS == MPI_SHM_PATTERNS

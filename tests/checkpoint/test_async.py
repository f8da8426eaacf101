"""Asynchronous checkpoint saves (checkpoint/async_writer.py, train --checkpoint-async).

Jobs of 2 ranks (fsdp=2: each rank writes its own blocks) through the CLI, with the documented
test hook `writer.write_block` patched in SCRIPT: 'slow' makes every block write of a save take
0.05 s late, so training runs on while the thread writes (the saved blocks must still be the
step's: host copies); 'kill' SIGKILLs the last rank in the middle of the async write of the
save at step 4, after one block is on disk. The checkpoints are compared file by file (sha256
of every block, the step, the data position) with those of a synchronous run; --keep-last 3
keeps each save's folder, so the saves written while training ran on are compared too."""
import json
import os
import re

import numpy as np

import mpishard as ms
from conftest import run_mpi
from mpishard.checkpoint.storage import latest, step_dir

SCRIPT = '''
import os, signal, sys, time
from mpi4py import MPI
from mpishard.checkpoint import writer
from mpishard.cli import exit_cleanly, main

mode, ckpt, steps, every = sys.argv[1:5]
rank, n = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size()
write_block = writer.write_block


def patched(path, arr):
    if mode == "slow":
        time.sleep(0.05)
    write_block(path, arr)
    if mode == "fail" and rank == n - 1 and ".tmp-2" in path:
        raise OSError(28, "No space left on device")
    if mode == "kill" and rank == n - 1 and ".tmp-4" in path:
        print(f"killed mid-write of {path}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)


writer.write_block = patched
if mode == "preempt":           # SIGUSR1 as the async save of step 4 begins, before the check
    from mpishard.checkpoint import async_writer
    begin = async_writer.begin

    def signalled(path, engine, optimizer, step, *rest):      # rest: extra, assets
        if rank == 0 and step == 4:
            os.kill(os.getpid(), signal.SIGUSR1)
        return begin(path, engine, optimizer, step, *rest)
    async_writer.begin = signalled
exit_cleanly(main(["train", "--dataset", "synthetic-classification", "--model", "16,32,4",
                   "--layout", "fsdp=2", "--steps", steps, "--batch", "16", "--dtype", "float64",
                   "--no-progress", "--log-every", "0", "--checkpoint-dir", ckpt,
                   "--checkpoint-every", every, "--keep-last", "3"]
                  + (["--checkpoint-async"] if mode != "sync" else [])
                  + (["--checkpoint-failures", "continue"] if mode == "fail" else [])))
'''


def job(tmp_path, mode, name, steps, every, killed=False):
    script, ckpt = tmp_path / "job.py", tmp_path / name
    script.write_text(SCRIPT)
    proc = run_mpi(2, script, mode, ckpt, steps, every, timeout=120, killed=killed)
    print(proc.stdout[-2000:], proc.stderr[-2000:])
    return proc, str(ckpt)


def index(path):
    with open(os.path.join(path, "index.json")) as f:
        return json.load(f)


def same_checkpoint(a, b):
    ia, ib = index(a), index(b)
    assert ia["step"] == ib["step"]
    assert ia["files"] == ib["files"]                       # every block's sha256 and size
    assert ia["extra"] == ib["extra"]                       # trainer state, data position
    assert ia["optimizer"] == ib["optimizer"]
    la, lb = ms.checkpoint.load(a), ms.checkpoint.load(b)
    for name in lb:
        np.testing.assert_array_equal(np.asarray(la[name]), np.asarray(lb[name]))


def test_async_saves_equal_sync_saves_while_training_runs_on(tmp_path):
    proc, slow = job(tmp_path, "slow", "async", 6, 2)
    assert proc.returncode == 0
    out = proc.stdout + proc.stderr
    assert [int(s) for s in re.findall(r"saved checkpoint \S+ at step (\d+)", out)] == [2, 4, 6]
    _, sync = job(tmp_path, "sync", "sync", 6, 2)
    for step in (2, 4, 6):              # steps 2 and 4 were written while training ran on
        same_checkpoint(step_dir(slow, step), step_dir(sync, step))
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]


def test_a_crash_mid_write_leaves_the_previous_checkpoint_intact(tmp_path):
    proc, killed = job(tmp_path, "kill", "killed", 6, 2, killed=True)
    assert proc.returncode != 0 and "killed mid-write of" in proc.stdout
    assert index(latest(killed))["step"] == 2              # step 4's never completed
    tmp = step_dir(killed, 4) + ".tmp-4"
    assert os.path.isdir(tmp) and not os.path.exists(os.path.join(tmp, "index.json"))
    _, sync = job(tmp_path, "sync", "sync", 2, 2)
    same_checkpoint(latest(killed), latest(sync))         # restores exactly step 2's state


def test_async_needs_a_checkpoint_dir(capsys):
    from mpishard.cli import main

    assert main(["train", "--dataset", "synthetic-regression", "--steps", "1", "--no-progress",
                 "--checkpoint-async"]) == 2
    assert "--checkpoint-async needs --checkpoint-dir DIR" in capsys.readouterr().err


def test_a_failed_async_write_is_one_verdict_and_training_goes_on(tmp_path):
    """The last rank's write of the step-2 save fails in the thread: the verdict at the save's
    finish names step 2 and the rank on rank 0, the next saves complete (--checkpoint-failures
    continue)."""
    proc, ckpt = job(tmp_path, "fail", "failed", 6, 2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    assert re.search(r"checkpoint save at step 2 failed: rank 1: OSError: \[Errno 28\] No space "
                     r"left on device", out), out[-2000:]
    assert sorted(os.listdir(ckpt)) == ["step-00000004", "step-00000006"]
    assert index(latest(ckpt))["step"] == 6


def test_a_stop_at_an_async_save_step_saves_that_step_once(tmp_path):
    """SIGUSR1 on rank 0 while the async save of step 4 begins: the preemption check of the
    same step finishes that save and does not write step 4 a second time; exit 75."""
    proc, ckpt = job(tmp_path, "preempt", "preempt", 6, 2)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 75, out[-2000:]
    assert [int(s) for s in re.findall(r"saved checkpoint \S+ at step (\d+)", out)] == [2, 4]
    assert "stopped by SIGUSR1 at step 4: checkpoint saved at step 4" in out
    assert index(latest(ckpt))["step"] == 4

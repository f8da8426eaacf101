"""A save that crashes never blocks the next run and never leaves its folder behind for good.

Under retention (`--keep-last N > 1`) a rank is SIGKILLed in each phase of the first save that
writer.py's docstring lists (1: rank 0 made the tmp folder; 2: a rank wrote one block, also
from the asynchronous writer's thread; 3: rank 0 wrote index.json.tmp; 4: rank 0 made the
index durable and is about to rename the folder into place, or has just done it). The
requeued run with `--resume auto` then starts (fresh, or from the checkpoint the swap
completed) instead of exiting 2 ("exists and is not a checkpoint"), and after its next save
no `step-*.tmp-*` folder is left: the requeue saves at other steps (as after a preemption
save, which lands at any step), so the writer's own clean-up of its step's tmp folder is not
what removes it.

Serial tests: each phase is one killed `mpiexec -n 2` job and one requeued job.
"""
import os
import re

import pytest

import mpishard as ms
from mpishard.checkpoint.storage import crashed_saves, foreign_entries, retain

from conftest import run_mpi

CRASH_SCRIPT = '''
import os, signal, sys
from mpi4py import MPI
from mpishard.checkpoint import writer
from mpishard.cli import exit_cleanly, main

phase, argv = sys.argv[1], sys.argv[2:]
rank, last = MPI.COMM_WORLD.Get_rank(), MPI.COMM_WORLD.Get_size() - 1


def killed_after(fn, who, when=lambda *a: True):
    """`fn`, then SIGKILL on rank `who` when `when(*args)` holds."""
    def run(*args, **kw):
        out = fn(*args, **kw)
        if rank == who and when(*args):
            print(f"rank {rank}: killed in phase {phase}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return run


def killed_before(fn, who, when):
    def run(*args, **kw):
        if rank == who and when(*args):
            print(f"rank {rank}: killed in phase {phase}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return fn(*args, **kw)
    return run


if phase == "tmp":                       # 1. the tmp folder exists, nothing in it
    writer._prepare_dirs = killed_after(writer._prepare_dirs, 0)
elif phase.startswith("blocks"):         # 2. the last rank wrote one block
    writer.write_block = killed_after(writer.write_block, last)
elif phase == "index":                   # 3. index.json.tmp written, not yet index.json
    writer.os.replace = killed_before(os.replace, 0, lambda src, dst: dst.endswith("index.json"))
elif phase == "swap":                    # 4. the index is durable, the folder not renamed
    writer._fsync_dir = killed_after(writer._fsync_dir, 0, lambda p: ".tmp-" in p)
elif phase == "swapped":                 # 4. renamed into place, the parent not yet fsynced
    writer.os.rename = killed_after(os.rename, 0, lambda src, dst: ".tmp-" in src)
exit_cleanly(main(argv))
'''

TRAIN = ["train", "--dataset", "synthetic-regression", "--model", "8,16,1", "--n-train", "64",
         "--batch", "16", "--dtype", "float64", "--no-progress", "--log-every", "0",
         "--keep-last", "2", "--layout", "fsdp=2"]      # fsdp: both ranks write blocks


@pytest.mark.parametrize("phase", ["tmp", "blocks", "blocks-async", "index", "swap", "swapped"])
def test_a_rank_killed_in_the_first_save_blocks_no_requeue(tmp_path, phase):
    script, ckpt = tmp_path / "crash.py", tmp_path / "ck"
    script.write_text(CRASH_SCRIPT)
    flags = ["--checkpoint-async"] if phase == "blocks-async" else []
    crashed = run_mpi(2, script, phase, *TRAIN, "--steps", "6", "--checkpoint-every", "3",
                      "--checkpoint-dir", ckpt, *flags, timeout=120, killed=True)
    print(crashed.stdout[-1500:], crashed.stderr[-1500:])
    assert crashed.returncode != 0 and f"killed in phase {phase}" in crashed.stdout
    left = sorted(os.listdir(ckpt))
    completed = phase == "swapped"
    assert left == (["step-00000003"] if completed else ["step-00000003.tmp-3"]), left

    requeued = run_mpi(2, "-m", "mpishard", *TRAIN, "--steps", "4", "--checkpoint-every", "2",
                       "--checkpoint-dir", ckpt, *flags, "--resume", "auto", timeout=120)
    print(requeued.stderr[-3000:])
    assert requeued.returncode == 0, requeued.stderr[-3000:]
    if completed:
        assert re.search(r"resumed from .*step-00000003 at step 3", requeued.stderr)
        assert sorted(os.listdir(ckpt)) == ["step-00000003", "step-00000004"]
    else:
        assert f"--resume auto: no checkpoint in {ckpt}; starting fresh" in requeued.stderr
        assert sorted(os.listdir(ckpt)) == ["step-00000002", "step-00000004"]
    assert ms.checkpoint.load(ckpt).step == 4


def test_retention_removes_only_what_crashed_saves_left(tmp_path):
    """`retain`: the tmp folders of every step and an `.old` beside its complete folder go; a
    lone complete `.old` (the checkpoint of its step, mid-swap) stays, and counts as foreign."""
    def folder(name, index=True):
        os.makedirs(tmp_path / name)
        if index:
            (tmp_path / name / "index.json").write_text("{}")
    for step in (1, 2, 3):
        folder(f"step-{step:08d}")
    folder("step-00000002.old")                    # beside a complete step 2: garbage
    folder("step-00000005.tmp-5", index=False)     # crashed in phases 1-3
    folder("step-00000009.tmp-9")                  # crashed in phase 4, before the rename
    folder("step-00000007.old")                    # no step 7: the checkpoint itself
    assert [os.path.basename(p) for p in crashed_saves(tmp_path)] == [
        "step-00000002.old", "step-00000005.tmp-5", "step-00000009.tmp-9"]
    assert foreign_entries(tmp_path) == ["step-00000007.old"]
    gone = retain(tmp_path, keep=2)
    assert sorted(map(os.path.basename, gone)) == [
        "step-00000001", "step-00000002.old", "step-00000005.tmp-5", "step-00000009.tmp-9"]
    assert sorted(os.listdir(tmp_path)) == ["step-00000002", "step-00000003",
                                            "step-00000007.old"]
    assert foreign_entries(tmp_path / "missing") == []

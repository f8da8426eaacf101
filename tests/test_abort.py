"""A rank that raises mid-step ends the whole job, non-zero, within seconds (style rule 8).

Serial test: it launches its own 2-rank job with `mpiexec -n 2 python -m mpi4py script`. In the
script rank 1 raises inside train_step (in the loss, after a collective) while rank 0 goes on
into the gradient all-reduce, which rank 1 never joins: without `python -m mpi4py` rank 0
would wait there forever; with it, the uncaught exception calls MPI_Abort and mpiexec ends
both ranks.
"""
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = '''
import numpy as np
from mpi4py import MPI
import mpishard as ms

comm = MPI.COMM_WORLD
model = ms.MLP([4, 8, 2])
engine = ms.make_engine(model, "dp=2", comm=comm)
engine.load_checkpoint(model.init(seed=0))
engine.all_reduce(np.ones(3))                  # a first collective both ranks complete


class FailingOnRank1(ms.losses.MSE):
    def __call__(self, y, t):
        if comm.Get_rank() == 1:
            raise RuntimeError("rank 1 fails mid-step")
        return super().__call__(y, t)


x = engine.shard_batch(np.ones((4, 4)))
t = engine.shard_batch(np.ones((4, 2)))
engine.train_step(x, t, FailingOnRank1())     # rank 0 waits in the gradient all-reduce
engine.all_reduce(np.ones(3))
print("rank", comm.Get_rank(), "should never get here", flush=True)
'''


def find_mpiexec():
    local = Path(sys.executable).parent / "mpiexec"
    if local.exists():
        return str(local)
    return shutil.which("mpiexec")


def test_rank_exception_aborts_the_job(tmp_path):
    mpiexec = find_mpiexec()
    if mpiexec is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH")
    script = tmp_path / "fail_mid_step.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPISHARD_DEBUG="0")
    t0 = time.perf_counter()
    proc = subprocess.run([mpiexec, "-n", "2", sys.executable, "-m", "mpi4py", str(script)],
                          capture_output=True, text=True, timeout=60, env=env,
                          cwd=Path(__file__).resolve().parent.parent)
    elapsed = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    print(f"rc={proc.returncode} after {elapsed:.1f} s\n{out[-2000:]}")
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert "rank 1 fails mid-step" in out
    assert "should never get here" not in out

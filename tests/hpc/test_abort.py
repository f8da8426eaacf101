"""A rank that raises mid-step ends the whole job, non-zero, within seconds (style rule 8).

Serial test: it launches its own 2-rank job with `mpiexec -n 2 python -m mpi4py script`. In the
script rank 1 raises inside train_step (in the loss, after a collective) while rank 0 goes on
into the gradient all-reduce, which rank 1 never joins: without `python -m mpi4py` rank 0
would wait there forever; with it, the uncaught exception calls MPI_Abort and mpiexec ends
both ranks.
"""
import time

from conftest import run_mpi

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


def test_rank_exception_aborts_the_job(tmp_path):
    script = tmp_path / "fail_mid_step.py"
    script.write_text(SCRIPT)
    t0 = time.perf_counter()
    proc = run_mpi(2, script, timeout=60, env={"MPISHARD_DEBUG": "0"})
    elapsed = time.perf_counter() - t0
    out = proc.stdout + proc.stderr
    print(f"rc={proc.returncode} after {elapsed:.1f} s\n{out[-2000:]}")
    assert proc.returncode != 0
    assert elapsed < 30, f"the job took {elapsed:.1f} s to end"
    assert "rank 1 fails mid-step" in out
    assert "should never get here" not in out

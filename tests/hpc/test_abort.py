"""A rank that raises mid-step ends the whole job, non-zero, within seconds.

Serial test: it launches its own 2-rank job with `mpiexec -n 2 python -m mpi4py script`. In the
script rank 1 raises inside train_step (in the loss, after a collective) while rank 0 goes on
into the gradient all-reduce, which rank 1 never joins: without `python -m mpi4py` rank 0
would wait there forever; with it, the uncaught exception calls MPI_Abort and mpiexec ends
both ranks. An uncaught exception is reported once per distinct cause (health/uncaught.py), and
the aborted job leaves none of the MPI library's files behind (health/signals.py).
"""
import json
import os
import time
from pathlib import Path

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
    # rank 0 is stuck in the all-reduce, so rank 1 reports its own error after the window
    assert [s for s in out.splitlines() if s.startswith("mpishard: error:")] == \
        ["mpishard: error: RuntimeError: rank 1 fails mid-step (rank 1)"]


# -- one report per distinct cause, nothing left behind (health/uncaught.py, health/signals.py) ----
REPORT_SCRIPT = '''
import json, sys
import numpy as np
from mpi4py import MPI
import mpishard as ms
from mpishard.health.signals import launcher_files, mapped_shm_paths, mpi_shm_paths, read_own_maps

comm = MPI.COMM_WORLD
engine = ms.make_engine(ms.MLP([4, 8, 2]), f"dp={comm.Get_size()}", comm=comm)
engine.all_reduce(np.ones(3))                  # every rank past MPI's setup: segments mapped
# what this job created, as this rank sees it: MPI's /dev/shm segments and hydra's topology file
files = mpi_shm_paths(mapped_shm_paths(read_own_maps())) + launcher_files()
with open(f"{sys.argv[1]}.{comm.Get_rank()}", "w") as f:
    json.dump(files, f)
comm.Barrier()
if sys.argv[2] == "mixed" and comm.Get_rank() == 2:
    raise RuntimeError("rank 2 ran out of something else")
raise ValueError("batch 7 does not divide by 4")
'''


def run_failing_job(tmp_path, mode):
    script = tmp_path / "raises.py"
    script.write_text(REPORT_SCRIPT)
    files = tmp_path / "files"
    proc = run_mpi(4, script, files, mode, timeout=120)
    out = proc.stdout + proc.stderr
    created = sorted({p for r in range(4) for p in json.loads(Path(f"{files}.{r}").read_text())})
    print(f"rc={proc.returncode}; the job's files: {created}\n{out[-3000:]}")
    assert proc.returncode != 0
    assert any(p.startswith("/dev/shm/") for p in created)   # MPI did use shared memory
    left = [p for p in created if os.path.exists(p)]
    assert left == [], f"files of the aborted job left behind: {left}"
    return out


def test_the_same_error_on_every_rank_is_printed_once(tmp_path):
    out = run_failing_job(tmp_path, "same")
    line = "mpishard: error: ValueError: batch 7 does not divide by 4 (ranks 0-3)"
    assert [s for s in out.splitlines() if "ValueError" in s and "error:" in s] == [line]
    assert out.count("Traceback (most recent call last)") == 1
    assert "mpi4py/run.py" not in out              # the launcher's frames are left out


def test_each_distinct_cause_is_printed_once(tmp_path):
    out = run_failing_job(tmp_path, "mixed")
    errors = [s for s in out.splitlines() if s.startswith("mpishard: error:")]
    assert errors == ["mpishard: error: ValueError: batch 7 does not divide by 4 (ranks 0-1,3)",
                      "mpishard: error: RuntimeError: rank 2 ran out of something else (rank 2)"]
    assert out.count("Traceback (most recent call last)") == 2

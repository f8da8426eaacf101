"""Every wait in a checkpoint is bounded by the engine's timeout and names the late rank.

A 2-rank job with `timeout=2` saves a first checkpoint, then its last rank sleeps far past the
timeout before the next checkpoint call (save, restore, a collective load, the Checkpointer's
directory check). The other rank must raise CollectiveTimeout naming the sleeping rank within
about the timeout, the job must end non-zero long before the sleeper wakes, and the first
checkpoint must be on disk intact.

    pytest -m "not mpi" tests/checkpoint/test_checkpoint_deadlines.py
"""
import time

import pytest

import mpishard as ms

from conftest import run_mpi

TIMEOUT = 2.0
LATE = 40.0                 # the sleeper's delay: the job must end well before it wakes

SCRIPT = """
import sys, time
from mpi4py import MPI
import mpishard as ms
from mpishard.health.watchdog import CollectiveTimeout

mode, path, timeout, late_s = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
comm = MPI.COMM_WORLD
model = ms.MLP([4, 6, 2])
engine = ms.make_engine(model, "dp=2", timeout=timeout)
engine.load_checkpoint(model.init(seed=0))
opt = ms.optim.AdamW(engine)
ms.checkpoint.save(path, engine, opt, step=1)            # the previous checkpoint
late = comm.Get_size() - 1
if comm.Get_rank() == late:
    time.sleep(late_s)
t0 = time.monotonic()
try:
    if mode == "save":
        ms.checkpoint.save(path, engine, opt, step=2)
    elif mode == "restore":
        ms.checkpoint.restore(path, engine, opt)
    elif mode == "load":
        ms.checkpoint.load(path, comm=engine)
    elif mode == "preflight":
        ms.checkpoint.preflight(path, engine, opt)
except CollectiveTimeout as exc:
    print(f"rank {comm.Get_rank()} timed out after {time.monotonic() - t0:.2f} s: {exc}",
          flush=True)
    raise
print(f"rank {comm.Get_rank()} finished {mode} after {time.monotonic() - t0:.2f} s", flush=True)
"""


@pytest.mark.parametrize("mode", ["save", "restore", "load", "preflight"])
def test_a_rank_late_to_a_checkpoint_times_out_naming_it(tmp_path, mode):
    script, path = tmp_path / "late.py", tmp_path / "ckpt"
    script.write_text(SCRIPT)
    t0 = time.monotonic()
    proc = run_mpi(2, script, mode, path, TIMEOUT, LATE, timeout=LATE + 60)
    wall = time.monotonic() - t0
    out = proc.stdout + proc.stderr
    print(out[-3000:])
    assert proc.returncode != 0, f"{mode}: the job ended rc 0 after {wall:.1f} s"
    assert wall < LATE / 2, f"{mode}: the job took {wall:.1f} s (the late rank sleeps {LATE} s)"
    line = next((s for s in out.splitlines() if s.startswith("rank 0 timed out")), None)
    assert line is not None, f"{mode}: rank 0 did not time out"
    waited = float(line.split(" after ")[1].split(" s")[0])
    assert TIMEOUT <= waited < TIMEOUT + 3, line
    assert f"checkpoint {mode}" in line and "late ranks: [1]" in line, line
    assert "finished" not in out
    ckpt = ms.checkpoint.load(path)                       # the previous one, intact
    assert ckpt.step == 1
    ckpt.verify()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "late.py"]

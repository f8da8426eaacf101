"""Shared test helpers.

MPI tests are marked `@pytest.mark.mpi(min_size=N)` and run under
`mpiexec -n {1,2,4,8} python -m mpi4py -m pytest --with-mpi` (see the Makefile).
A test that needs exactly `n` ranks takes `group_comm(n)`: the world split into consecutive
groups of `n` ranks, each running the test independently (at 8 ranks a 4-rank layout runs
twice, side by side). It skips when the world size is not a multiple of n.
Serial tests that launch their own job use `run_mpi(n, ...)`.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import mpishard as ms

ROOT = Path(__file__).resolve().parents[1]

RTOL64 = 1e-9
RTOL32 = 1e-4


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def group_comm(n):
    """Split COMM_WORLD into groups of n consecutive ranks; skip if it does not divide."""
    comm = world()
    size = comm.Get_size()
    if size < n or size % n:
        pytest.skip(f"needs a world size that is a multiple of {n}, got {size}")
    return comm.Split(comm.Get_rank() // n, comm.Get_rank())


def mpiexec():
    """The mpiexec next to this interpreter (the venv's), else the one on PATH; skip if none."""
    exe = Path(sys.executable).parent / "mpiexec"
    exe = str(exe) if exe.exists() else shutil.which("mpiexec")
    if exe is None:
        pytest.skip("no mpiexec next to the interpreter or on PATH")
    return exe


def run_mpi(n, *args, timeout=120, env=None):
    """Run `mpiexec -n n python -m mpi4py args...` in the repository root with
    OMP_NUM_THREADS=1 and the variables in `env`; the CompletedProcess, output as text."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    cmd = [mpiexec(), "-n", str(n), sys.executable, "-m", "mpi4py", *map(str, args)]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def single_reference(model, params, x, t, loss):
    """The single-device reference after one train_step on (x, t): (engine, loss, a copy of
    every gradient)."""
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    value, grads = ref.train_step(x, t, loss)
    return ref, value, {k: v.copy() for k, v in grads.items()}


def assert_close(got, want, rtol=RTOL64, atol=0.0, what=""):
    """Compare with an explicit tolerance relative to the largest |want| and print the max
    difference (style rule 6)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-300)
    diff = float(np.abs(got - want).max()) if want.size else 0.0
    print(f"{what}: max |diff| = {diff:.3e} (scale {scale:.3e}, rtol {rtol:g})")
    assert diff <= rtol * scale + atol, f"{what}: max |diff| {diff:.3e} > {rtol:g} * {scale:.3e}"


def assert_dicts_close(got, want, rtol=RTOL64, what=""):
    assert set(got) == set(want), f"{what}: keys {sorted(got)} != {sorted(want)}"
    for k in want:
        assert_close(got[k], want[k], rtol=rtol, what=f"{what} {k}")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)

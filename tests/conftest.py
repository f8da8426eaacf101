"""Shared test helpers.

MPI tests are marked `@pytest.mark.mpi(min_size=N)` and run under
`mpiexec -n {1,2,4,8} python -m mpi4py -m pytest --with-mpi` (see the Makefile).
A test that needs exactly `n` ranks takes `group_comm(n)`: the world split into consecutive
groups of `n` ranks, each running the test independently (at 8 ranks a 4-rank layout runs
twice, side by side). It skips when the world size is not a multiple of n.
Serial tests that launch their own job use `run_mpi(n, ...)` (or `mpiexec_cmd(n)`), which honour
the MPIEXEC and MPIEXEC_FLAGS environment variables; `engine_lines` drops the launcher's own
output so assertions look only at what mpishard printed.
"""
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import mpishard as ms
import leftovers
from mpishard.nn import cpu_fused

ROOT = Path(__file__).resolve().parents[1]

RTOL64 = 1e-9
RTOL32 = 1e-4


def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def group_comm(n, _groups={}):
    """COMM_WORLD split into groups of n consecutive ranks; skip if it does not divide. One
    communicator per n for the whole session (split on first use, by every rank at the same
    test): a split per test would use up MPI's few thousand communicator ids."""
    comm = world()
    size = comm.Get_size()
    if size < n or size % n:
        pytest.skip(f"needs a world size that is a multiple of {n}, got {size}")
    if n not in _groups:
        _groups[n] = comm.Split(comm.Get_rank() // n, comm.Get_rank())
    return _groups[n]


def mpiexec():
    """The launcher: $MPIEXEC (the Makefile passes its MPIEXEC), else the mpiexec next to this
    interpreter (the venv's), else the one on PATH; skip if none."""
    exe = os.environ.get("MPIEXEC") or str(Path(sys.executable).parent / "mpiexec")
    found = shutil.which(exe) or shutil.which("mpiexec")
    if found is None:
        pytest.skip(f"no mpiexec: {exe} not found and none on PATH")
    return os.path.abspath(found)


def mpiexec_cmd(n):
    """`mpiexec $MPIEXEC_FLAGS -n n` as a list: the one way tests start a job of their own (for
    Open MPI the Makefile passes --oversubscribe here)."""
    return [mpiexec(), *shlex.split(os.environ.get("MPIEXEC_FLAGS", "")), "-n", str(n)]


def run_mpi(n, *args, timeout=120, env=None, killed=False):
    """Run `mpiexec $MPIEXEC_FLAGS -n n python -m mpi4py args...` in the repository root with
    OMP_NUM_THREADS=1 and the variables in `env`; the CompletedProcess, output as text.
    The job must leave no file of the MPI library behind (tests/hpc/leftovers.py: an aborted
    job removes its own); `killed=True`: a rank is SIGKILLed on purpose and cleans nothing, so
    the files the job left are removed here."""
    env = dict(os.environ, OMP_NUM_THREADS="1", **(env or {}))
    cmd = [*mpiexec_cmd(n), sys.executable, "-m", "mpi4py", *map(str, args)]
    before = leftovers.mpi_files()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
    finally:
        left = leftovers.left_since(before)
        for _ in range(0 if killed else 30):  # hydra's proxy may still be removing its own
            if not left:                      # file after mpiexec returned
                break
            time.sleep(0.1)
            left = leftovers.left_since(before)
        for path in left if killed else ():
            with contextlib.suppress(FileNotFoundError):   # hydra's proxy removed it meanwhile
                os.unlink(path)
    assert killed or not left, (f"the job left the MPI library's files {left}:\n"
                                f"{proc.stdout[-2000:]}{proc.stderr[-2000:]}")
    return proc


# The start of a fresh-interpreter probe (after `import ctypes, logging`): glibc's mallinfo2,
# to see where malloc put an array, and `records`, what a logging handler received.
MALLINFO_PROBE = """
class Mallinfo2(ctypes.Structure):
    _fields_ = [(f, ctypes.c_size_t) for f in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Mallinfo2
records = []
handler = logging.Handler()
handler.emit = lambda r: records.append(r.getMessage())
"""


def run_python(args, **kwargs):
    """`subprocess.run([sys.executable, *args], **kwargs)` for a fresh interpreter that
    initialises MPI without a launcher and builds no engine: Open MPI 5 leaves such a
    singleton's shared-memory segment (sm_segment.*) in /dev/shm at every exit (an engine
    removes its own: health/signals.py), so the segments it left are removed here."""
    before = leftovers.mpi_files()
    try:
        return subprocess.run([sys.executable, *map(str, args)], **kwargs)
    finally:
        for path in leftovers.left_since(before):
            if os.path.basename(path).startswith("sm_segment."):
                os.unlink(path)


def engine_lines(text):
    """The lines of a job's output that the engine or the script printed, without the
    launcher's own (Open MPI's `prterun`/`mpirun` reports and `----` boxes, hydra's
    `BAD TERMINATION` banner): assertions about what mpishard printed look only at these."""
    lines, boxed = [], False
    for line in text.splitlines():
        if line.startswith("-" * 20):
            boxed = not boxed
            continue
        if boxed or LAUNCHER_LINE.match(line) or not line.strip():
            continue
        lines.append(line)
    return lines


LAUNCHER_LINE = re.compile(
    r"^(=+$|\[mpiexec@|\[proxy:|\[\S+:\d+\] |prterun |mpirun |mpiexec |\s*(BAD TERMINATION|"
    r"EXIT CODE:|CLEANING UP|PID \d+ RUNNING AT|YOUR APPLICATION TERMINATED))")


def single_reference(model, params, x, t, loss):
    """The single-device reference after one train_step on (x, t): (engine, loss, a copy of
    every gradient)."""
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    value, grads = ref.train_step(x, t, loss)
    return ref, value, {k: v.copy() for k, v in grads.items()}


def assert_close(got, want, rtol=RTOL64, atol=0.0, what=""):
    """Compare with an explicit tolerance relative to the largest |want| and print the max
    difference."""
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


@pytest.fixture
def numba_kernels():
    """Skip without numba (the `cpu-fused` extra), or fail under MPISHARD_REQUIRE_NUMBA=1."""
    if not cpu_fused.available():
        reason = "needs numba: pip install -e '.[cpu-fused]'"
        if os.environ.get("MPISHARD_REQUIRE_NUMBA") == "1":
            pytest.fail(f"MPISHARD_REQUIRE_NUMBA=1 but {reason}")
        pytest.skip(reason)

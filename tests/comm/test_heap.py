"""The host heap (mpishard/comm/heap.py): glibc's mmap and trim thresholds raised once an
engine is built, so freed arrays stay in the process instead of being page-faulted in again."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from mpishard.comm import heap

GLIBC = heap._glibc() is not None

# the bytes glibc holds in mmapped blocks while an 8 MiB array is alive, after a 1 MiB one was
# freed (which raises glibc's own threshold to 1 MiB, not to 8; mallinfo2: glibc >= 2.33)
PROBE = r"""
import ctypes, json, sys
import numpy as np

class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
if sys.argv[1] == "keep":                    # heap.py alone: importing mpishard starts MPI
    import importlib.util
    spec = importlib.util.spec_from_file_location("heap", sys.argv[2])
    heap = sys.modules["heap"] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(heap)
    assert heap.keep_host_heap().kept
a = np.ones(1 << 17)                         # 1 MiB of float64, freed
del a
b = np.ones(1 << 20)                         # 8 MiB
print(json.dumps({"mmapped": libc.mallinfo2().hblkhd}))
"""


def _mmapped(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in heap.HEAP_VARS}
    out = subprocess.run([sys.executable, "-c", PROBE, mode, heap.__file__], capture_output=True,
                         text=True, check=True, env=env).stdout
    return json.loads(out)["mmapped"]


@pytest.mark.skipif(not GLIBC, reason="malloc is not glibc's")
def test_kept_heap_serves_a_large_array_again_without_mmap():
    """glibc's defaults: an 8 MiB array comes from mmap (and goes back to the OS when freed);
    kept: from the heap, where the freed one left its pages."""
    assert _mmapped("default") >= 8 << 20
    assert _mmapped("keep") < 8 << 20


def test_the_user_and_glibc_s_environment_win():
    assert not heap.keep_host_heap(None).kept
    chosen = heap.keep_host_heap(environ={"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not chosen.kept and "MALLOC_TRIM_THRESHOLD_=131072 is set" in chosen.why
    with pytest.raises(ValueError, match="host_heap must be 'keep' or None"):
        heap.keep_host_heap("always")


@pytest.mark.skipif(not GLIBC, reason="malloc is not glibc's")
def test_an_engine_keeps_the_heap_and_says_so():
    import numpy as np

    import mpishard as ms
    from mpi4py import MPI
    e = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF, dtype=np.float64)
    assert e.host_heap.kept and "glibc" in e.host_heap.why
    assert not ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF, host_heap=None).host_heap.kept

"""The host heap: freed arrays stay in the process, instead of going back to the OS each step.

numpy takes every array's memory from the C library's malloc. glibc serves a request of
128 KiB or more with its own `mmap` and gives it back with `munmap` when freed, and it trims
the heap whenever more than 128 KiB is free at its top. Both limits rise as the process frees
large blocks (up to 32 MiB for the mmap threshold, twice that for the trim), so how fast a
step runs depends on what the process happened to allocate before: a step's activations that
go back to the OS are page-faulted in again on the next step, in the kernel, on every rank.

Measured here (GPT 256/64/128/4 heads/4 layers, batch 4 per rank, train_step, 4 ranks on 2
cores, every rank at once): 68.6 ms in a fresh process, 63.0 ms once a 16 MiB array had been
freed first (glibc's limits raised), the same model and code. The calibration (cli/calibrate.py)
runs its reference steps after its micro-benchmarks freed large arrays, so it measured the
second figure, and `plan --validate` or a training job in a new process ran at the first:
the planner's GPT predictions came out 10-20% low. One rank alone on a core shows no
difference (benchmarks/gpt.py: the faults are cheap when no other rank needs the core).

`keep_host_heap` sets both limits where glibc's own adaptation ends (mmap threshold 32 MiB,
trim threshold 64 MiB) when an engine is built, so every process runs in the steady state
from its first step and the calibration measures what a job will see. The cost is memory:
up to TRIM_THRESHOLD of freed heap stays with the process (it is reused by the next step's
arrays; arrays of 32 MiB and more still come from mmap and go back when freed). Nothing is
changed when the user chose (MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ set, which
glibc read at start-up), with `host_heap=None`, or where malloc is not glibc's (musl, macOS).
"""
from __future__ import annotations

import ctypes
import os
from dataclasses import dataclass

MMAP_THRESHOLD = 32 << 20      # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD    # what glibc sets with a raised mmap threshold
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # mallopt's parameter numbers (malloc.h)
HEAP_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")


@dataclass(frozen=True)
class HostHeap:
    """What `keep_host_heap` did: `kept` (the limits are set), and `why` in words."""
    kept: bool
    why: str


def _glibc():
    """The C library when it is glibc (it has gnu_get_libc_version and mallopt), else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc, version
    except (AttributeError, OSError):
        return None


def keep_host_heap(requested="keep", environ=None) -> HostHeap:
    """Raise glibc's mmap and trim thresholds (module docstring); process-wide, no MPI."""
    environ = os.environ if environ is None else environ
    if requested is None:
        return HostHeap(False, "host_heap=None: left as it was")
    if requested != "keep":
        raise ValueError(f"host_heap must be 'keep' or None, got {requested!r}")
    chosen = [v for v in HEAP_VARS if environ.get(v, "").strip()]
    if chosen:
        return HostHeap(False, f"{chosen[0]}={environ[chosen[0]]} is set: left to glibc")
    found = _glibc()
    if found is None:
        return HostHeap(False, "malloc is not glibc's: left as it was")
    libc, version = found
    if not (libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return HostHeap(False, f"glibc {version} refused mallopt: left as it was")
    return HostHeap(True, f"glibc {version}: arrays under {MMAP_THRESHOLD >> 20} MiB stay in "
                          f"the heap, up to {TRIM_THRESHOLD >> 20} MiB of it kept when free")

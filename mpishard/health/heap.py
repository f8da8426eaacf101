"""Opt-in host heap tuning: `make_engine(..., host_heap="keep")` keeps freed arrays in the heap.

glibc gives a freed array of 128 KiB or more back to the OS (munmap, or a trim of the heap's
top), so a step that allocates the same activations every time page-faults them in again, in
the kernel, each step. "keep" raises glibc's mmap threshold to 32 MiB and its trim threshold to
64 MiB (mallopt, process-wide, where glibc's own adaptation ends), so those arrays are reused
from the heap; the cost is up to 64 MiB of freed memory held by the process. Default None:
malloc is left as it is. A MALLOC_MMAP_THRESHOLD_ or MALLOC_TRIM_THRESHOLD_ in the environment
(the user's choice, read by glibc at start-up) or a malloc that is not glibc's is left alone too.
"""
from __future__ import annotations

import ctypes
import logging
import os
from dataclasses import dataclass

MMAP_THRESHOLD = 32 << 20      # glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit
TRIM_THRESHOLD = 2 * MMAP_THRESHOLD    # what glibc sets with a raised mmap threshold
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3      # mallopt's parameter numbers (malloc.h)
HEAP_VARS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_")
log = logging.getLogger("mpishard")
_logged: list = []             # the process's mallopt is logged once


@dataclass(frozen=True)
class HostHeap:
    """What `keep_host_heap` did: `kept` (the thresholds are set), and `why` in words."""
    kept: bool
    why: str


def _glibc():
    """(the C library, its version) when it is glibc, else None."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        version = libc.gnu_get_libc_version().decode()
        libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
        return libc, version
    except (AttributeError, OSError):
        return None


def keep_host_heap(requested=None, environ=None) -> HostHeap:
    """Raise glibc's mmap and trim thresholds when `requested` is "keep" (module docstring);
    process-wide, no MPI. Logs (logger "mpishard", INFO) what it changed, once a process."""
    environ = os.environ if environ is None else environ
    if requested is None:
        return HostHeap(False, "host_heap=None: malloc left as it was")
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
    why = (f"glibc {version}: arrays under {MMAP_THRESHOLD >> 20} MiB stay in the heap, up to "
           f"{TRIM_THRESHOLD >> 20} MiB of it kept when free (host_heap='keep')")
    if not _logged:
        _logged.append(why)
        log.info("mpishard: host heap kept: %s", why)
    return HostHeap(True, why)

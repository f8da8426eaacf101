"""Receive buffers placed at the page offset of what is sent into them.

On one node MPICH moves a message of 8 KiB and up from one rank's memory to another's with a
single kernel copy (CMA, `process_vm_readv`). Measured here (AMD EPYC, MPICH 5.0.2, Linux),
that copy runs 2-4x slower when the receive buffer starts 1 to 31 bytes after the send
buffer, counted within the 4 KiB page (benchmarks/placement.py):

    1 MiB Sendrecv, 2 ranks     436-466 us at those distances, 100-144 us at any other
    4 MiB Sendrecv, 2 ranks     1.72-1.85 ms against 0.39-0.66 ms
    1 MiB Alltoall, 4 ranks     950-1007 us against 230-290 us
    (with CMA turned off, MPIR_CVAR_CH4_CMA_ENABLE=0: 200 us at every distance)

numpy arrays that glibc maps (above its mmap threshold) all start 16 bytes into a page, the
same distance for every pair. On the heap (`host_heap="keep"`, heap.py: up to 32 MiB) they
start on any 16-byte boundary, and two arrays of one size allocated one after the other sit
exactly 16 bytes apart in their pages: the slow distance. SPMD ranks allocate alike, so a
result buffer allocated just after the input it receives for is that far from every peer's
send buffer too, and the pool (pool.py) would keep it that way for every later call.

So what the engine allocates to receive into starts at the page offset of what is sent: the
pooled results of all_to_all, all_to_all_v, all_gather, reduce_scatter and all_reduce at
that of the input they were first allocated for, and a point-to-point or broadcast receive
at the sender's, which travels in the message header (p2p.py). A buffer the caller passes
(`out=`) is left where it is. Device arrays are left to the device allocator.
"""
from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

PAGE = 4096              # bytes: the distance that matters is counted within a page
MIN_BYTES = 8 * 1024     # smaller messages: copied through shared memory, no kernel copy
SLOW = range(1, 32)      # receive offset - send offset (mod PAGE) where the copy is slow


def page_offset(a) -> int:
    """Where host array `a`'s data starts within its page, or -1: a small array (a message
    that takes no kernel copy), or a device array. The address is mpi4py's view of the
    buffer (0.19 us here; `a.ctypes.data` 1.4 us)."""
    if type(a) is not np.ndarray or a.nbytes < MIN_BYTES:
        return -1
    return MPI.buffer(a).address % PAGE


def empty_at(xp, shape, dtype, offset: int):
    """An uninitialised array whose data starts `offset` bytes into a page (rounded down to
    the dtype's alignment); with `offset` -1, or off the host, plain `xp.empty`. The array is
    a view of a byte buffer one page longer; the buffer is its `.base` (pool.py counts the
    holders of both)."""
    if offset < 0 or xp is not np:
        return xp.empty(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    offset -= offset % dtype.alignment
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + PAGE, dtype=np.uint8)
    start = (offset - MPI.buffer(raw).address) % PAGE
    a = raw[start:start + nbytes].view(dtype)
    return a if len(shape) == 1 else a.reshape(shape)

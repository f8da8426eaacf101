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

Buffers kept for reuse (`huge=True`: the pool's kept results, pool.py, and data
parallelism's gradient buckets) of HUGE bytes and up also start at a 2 MiB boundary (plus
that offset), in memory of their own (a private anonymous mmap) advised for transparent huge
pages over every whole 2 MiB the data covers. MPICH reads a collective's sources out of the
peer's memory, and all_gather's result is one (its algorithm forwards the blocks it has
received): pinning a 2 MiB page costs what pinning one 4 KiB page does. Measured here (raw
Allgather, 2 ranks, THP "madvise"): into a 2 MiB buffer of huge pages 0.57-0.60x the time
into numpy's own (1 MiB per rank), and at 4 MiB per rank into 4 KiB pages 1.45-1.89x into
numpy's, which got huge pages for 3 of its 4 whole 2 MiB (1.0x with all 4); Alltoall's
receive, which MPI only writes, is the same either way. numpy advises huge pages for arrays
of 4 MiB and up but does not align them, so which 2 MiB get huge pages varied with where
glibc mapped the array. Nothing is rounded up: the tail past the last whole 2 MiB stays in 4
KiB pages, so the memory used is the array's; only its address space is up to 2 MiB + 4 KiB
larger.
Buffers made for one use (a received message, FSDP's gathered weights) stay on the heap
(heap.py): a fresh mapping is page-faulted in on every use, a freed heap block is not.
"""
from __future__ import annotations

import math
import mmap

import numpy as np
from mpi4py import MPI

PAGE = 4096              # bytes: the distance that matters is counted within a page
MIN_BYTES = 8 * 1024     # smaller messages: copied through shared memory, no kernel copy
SLOW = range(1, 32)      # receive offset - send offset (mod PAGE) where the copy is slow
HUGE = 2 * 1024 * 1024   # a transparent huge page: buffers this large start on one
ADVICE = getattr(mmap, "MADV_HUGEPAGE", None)    # None off Linux: no advice given


def page_offset(a) -> int:
    """Where host array `a`'s data starts within its page, or -1: a small array (a message
    that takes no kernel copy), or a device array. The address is mpi4py's view of the
    buffer (0.19 us here; `a.ctypes.data` 1.4 us)."""
    if type(a) is not np.ndarray or a.nbytes < MIN_BYTES:
        return -1
    return MPI.buffer(a).address % PAGE


def empty_at(xp, shape, dtype, offset: int, huge: bool = False):
    """An uninitialised array whose data starts `offset` bytes into a page (rounded down to
    the dtype's alignment), with `huge` from HUGE bytes on in huge pages (module docstring);
    with `offset` -1, or off the host, plain `xp.empty`. The array is a view of a byte array,
    its `.base` (a longer one on the heap, or exactly its bytes of the mapping), which every
    further view holds (pool.py counts the holders of both)."""
    if offset < 0 or xp is not np:
        return xp.empty(shape, dtype=dtype)
    dtype = np.dtype(dtype)
    shape = (int(shape),) if isinstance(shape, (int, np.integer)) else tuple(shape)
    offset -= offset % dtype.alignment
    nbytes = math.prod(shape) * dtype.itemsize
    if huge and nbytes >= HUGE:
        a = huge_pages(nbytes, offset).view(dtype)
    else:
        raw = np.empty(nbytes + PAGE, dtype=np.uint8)
        start = (offset - MPI.buffer(raw).address) % PAGE
        a = raw[start:start + nbytes].view(dtype)
    return a if len(shape) == 1 else a.reshape(shape)


def huge_pages(nbytes: int, offset: int):
    """`nbytes` uninitialised bytes starting `offset` bytes past a 2 MiB boundary, in a
    private anonymous mapping advised for huge pages over the whole 2 MiB pages they cover
    (the tail stays in 4 KiB pages). The array's base is a memoryview of exactly its bytes
    (so memory reports count the array, not the mapping's spare address space); it keeps
    the mapping, which is unmapped with the array's last view."""
    mapped = mmap.mmap(-1, nbytes + offset + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    start = -MPI.buffer(mapped).address % HUGE
    if ADVICE is not None:
        mapped.madvise(ADVICE, start, (offset + nbytes) // HUGE * HUGE)
    return np.frombuffer(memoryview(mapped)[start + offset:start + offset + nbytes], np.uint8)

"""The staged path made fast: pinned host buffers, and large all_reduces in pipelined chunks.

Without NCCL or a CUDA-aware MPI, device arrays reach MPI through host memory (backend.py).
Two things make that cheaper:

- pinned (page-locked) host buffers, from `cupy.cuda.alloc_pinned_memory`, reused per size:
  the copy engine moves them at full speed and asynchronously; a module without it (the test
  suite's device double) gets plain numpy arrays;
- a large all_reduce goes in chunks of CHUNK_BYTES, pipelined: every chunk's device->host copy
  is queued at once on a side stream, each chunk is reduced by MPI as soon as its copy is
  done, and its host->device copy is queued right after, so the copies of the other chunks
  run while MPI works on one. Every rank cuts the same chunks (they follow from the shape), and
  each chunk's Allreduce is a collective bounded by the watchdog like any other.

The result equals the one-piece staged all_reduce element by element (each element is reduced
by the same MPI operation over the same ranks), and the staged byte counters are the same.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
from mpi4py import MPI

CHUNK_BYTES = 4 << 20             # one chunk of a pipelined staged all_reduce
H2D, D2H = 1, 2                   # cudaMemcpyKind


BF16 = np.dtype(ml_dtypes.bfloat16)


def as_words(a):
    """`a` as MPI moves it: a bfloat16 array as its 2-byte words viewed as float16 (mpi4py
    has no bfloat16 buffer; only non-reducing calls take one: p2p.no_bf16_sum), any other
    array as it is."""
    return a.view(np.float16) if a.dtype == BF16 else a


def pinned_empty(xp, shape, dtype) -> np.ndarray:
    """A host array in page-locked memory where `xp` can allocate one (cupy), else numpy's."""
    dtype = np.dtype(dtype)
    alloc = getattr(xp.cuda, "alloc_pinned_memory", None)
    if alloc is None:
        return np.empty(shape, dtype=dtype)
    count = int(np.prod(shape, dtype=np.int64))
    memory = alloc(max(count * dtype.itemsize, 1))
    return np.frombuffer(memory, dtype=dtype, count=count).reshape(shape)


class StagedPipeline:
    """Pipelined staged all_reduce of one Backend (module docstring)."""

    def __init__(self, xp, chunk_bytes: int = CHUNK_BYTES):
        self.xp, self.chunk_bytes = xp, int(chunk_bytes)
        self._host: dict = {}             # (size, dtype) -> a pinned flat host buffer
        self._stream = None
        self.chunks = 0                   # chunks reduced so far (the tests count them)

    def applies(self, a) -> bool:
        """Pipelined when `a` spans two chunks or more; smaller ones go in one piece."""
        return a.nbytes >= 2 * self.chunk_bytes

    def _buffer(self, a) -> np.ndarray:
        key = (a.size, np.dtype(a.dtype).str)
        host = self._host.get(key)
        if host is None:
            host = self._host[key] = pinned_empty(self.xp, (a.size,), a.dtype)
        return host

    def all_reduce(self, a, out, mpi_op, comm, watchdog, staged: dict) -> None:
        """`out` = the group's reduction of `a` (`out` may be `a`), chunk by chunk."""
        xp = self.xp
        copy = xp.cuda.runtime.memcpyAsync
        if self._stream is None:
            self._stream = xp.cuda.Stream(non_blocking=True)
        side, host = self._stream, self._buffer(a)
        side.wait_event(xp.cuda.get_current_stream().record())    # `a` is computed first
        size = a.itemsize
        per = max(1, self.chunk_bytes // size)
        bounds = [(lo, min(lo + per, a.size)) for lo in range(0, a.size, per)]
        src, dst, at = a.data.ptr, out.data.ptr, host.ctypes.data
        down = []
        for lo, hi in bounds:                         # every copy down queued at once
            copy(at + lo * size, src + lo * size, (hi - lo) * size, D2H, side.ptr)
            down.append(side.record())
        try:
            for (lo, hi), event in zip(bounds, down):
                event.synchronize()
                watchdog.run(comm.Allreduce, comm.Iallreduce,
                             (MPI.IN_PLACE, host[lo:hi], mpi_op), "all_reduce", comm)
                copy(dst + lo * size, at + lo * size, (hi - lo) * size, H2D, side.ptr)
                self.chunks += 1
        finally:
            side.synchronize()                        # no copy outlives the call
        staged["to_host"] += a.nbytes
        staged["to_device"] += a.nbytes

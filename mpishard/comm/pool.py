"""Reused result buffers for collectives (all_reduce, reduce_scatter, all_to_all).

Up to two results per shape and dtype are kept, for up to SHAPES shapes (a new shape beyond
those drops the one first seen longest ago; a hit does not reorder them, which would cost on
every call), so the loop `y = comm.all_reduce(x)` alternates between two buffers; one is
handed out again only when no other reference to it, or to a view of it, remains (CPython
reference counts of the array and of the memory's owner), so a result the caller still holds
is never overwritten. This saves the page faults of a fresh large allocation per call (15-40%
of a 16 MiB all_reduce here). A new buffer starts at the page offset of the input it is first
allocated for (`like`; placement.py: a receive 1-31 bytes past its send within the page
copies 2-4x slower), and a kept buffer is not handed to an input it sits at that distance
from: two arrays of one size allocated one after the other start 16 bytes apart in their
pages, so a result kept for the second is at the slow distance from the first (measured, 1
MiB all_to_all at 4 ranks into the second's kept result: 2.3x raw Alltoall, 1.2-1.3x into
one of its own). The first two of a shape from 2 MiB up are in huge pages (placement.py: MPI
reads an all_gather's result from the peer while it fills it, and pins it a page at a time;
a buffer made later, every kept one being held, comes from the heap, heap.py). So each is a
view of a byte buffer, its `.base`, which holds the memory and which every further view
holds: both counts are checked. all_gather results are pooled too, except FSDP's gathered
weights (`pooled=False`), which must really be freed (a fresh 16 MiB
all_gather result cost 1.6x raw Allgather here).
"""
from __future__ import annotations

import sys

import numpy as np

from .placement import PAGE, SLOW, empty_at, page_offset


class ResultPool:
    """`get(shape, dtype, like)`: a reused array nobody holds any more, or a new one placed
    at `like`'s page offset (the array it receives for)."""

    SHAPES, PER_SHAPE = 8, 2

    def __init__(self, xp):
        self.xp = xp
        self.enabled = True          # False: a fresh result every call
        self._bufs: dict = {}

    def get(self, shape, dtype, like=None, pooled=True):
        """pooled=False: a fresh array (`new`), for a result that must really be freed."""
        try:
            bufs = self._bufs.get((shape, dtype)) if self.enabled and pooled else None
        except TypeError:          # a list for a shape: _get makes it a tuple
            bufs = None
        free = self._free(bufs, page_offset(like)) if bufs else None   # a shape seen before
        return free if free is not None else self._get(shape, dtype, like, pooled)

    @staticmethod
    def _free(bufs, at):
        """A kept buffer nobody else holds and not at the slow distance from an input at page
        offset `at` (placement.py; -1: any), or None. `bufs` holds (buffer, its offset)."""
        for i in range(len(bufs)):
            # 3 = the kept pair's reference + `buf` + getrefcount's argument; a view of a
            # pooled array (the moveaxis of a result, a slice of it) holds one more on the
            # byte buffer that owns the memory, the pooled array's .base (2: its reference +
            # the argument)
            buf = bufs[i][0]
            if sys.getrefcount(buf) == 3 and (buf.base is None
                                              or sys.getrefcount(buf.base) == 2):
                if at < 0 or (bufs[i][1] - at) % PAGE not in SLOW:
                    return buf
        return None

    def new(self, shape, dtype, like=None, huge=False):
        """A fresh array placed at `like`'s page offset: unpooled (a result that must really
        be freed), or one of the pool's own new buffers (`huge`: placement.py)."""
        return empty_at(self.xp, shape, dtype, page_offset(like), huge)

    def _get(self, shape, dtype, like=None, pooled=True):
        """get's slow path: a new shape, a shape given as a list, or every buffer held (or at
        the slow distance from `like`)."""
        if not (self.enabled and pooled):
            return self.new(shape, dtype, like)
        if type(shape) is not tuple or not isinstance(dtype, np.dtype):
            shape, dtype = tuple(shape), np.dtype(dtype)     # callers mostly pass a.shape, a.dtype
        key = (shape, dtype)
        bufs = self._bufs.get(key)
        if bufs is None:
            bufs = self._bufs[key] = []
            if len(self._bufs) > self.SHAPES:
                self._bufs.pop(next(iter(self._bufs)))      # the shape first seen longest ago
        free = self._free(bufs, page_offset(like))
        if free is not None:
            return free
        # the buffers that fill a shape's slots are reused: huge pages. One made because the
        # caller holds every kept one (activations kept for the backward) replaces the
        # oldest: from the heap, which reuses a freed block without page faults
        buf = self.new(shape, dtype, like, huge=len(bufs) < self.PER_SHAPE)
        bufs.append((buf, page_offset(buf)))
        if len(bufs) > self.PER_SHAPE:
            bufs.pop(0)                                 # the oldest stays with its holder
        return buf

    def clear(self) -> None:
        """Forget every kept buffer (benchmarks measure the allocation this way)."""
        self._bufs.clear()

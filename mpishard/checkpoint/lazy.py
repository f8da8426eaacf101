"""LazyArray: a full array in a checkpoint, read only where it is sliced.

It maps the chunks overlapping a slice (np.load with mmap_mode="r", allow_pickle=False,
through the checkpoint's `open_file`, which verifies a file's sha256 before its first read) and
copies only that region, so loading a shard of a large checkpoint reads about the shard's bytes.
An index key is read into the span to read and the index to apply after by
hfmap.views.region_of, as for every lazily read array (hf's SafeTensor, Mixtral's expert views).
"""
from __future__ import annotations

import numpy as np

from ..hfmap.views import region_of


class LazyArray:
    """A full array in a checkpoint, read only where sliced: `.shape`, `.dtype`, `a[slices]`
    and `np.asarray(a)`. Its chunks are memory-mapped .npy files."""

    def __init__(self, ckpt, name, entry):
        self._ckpt, self.name = ckpt, name
        self.shape = tuple(entry["shape"])
        self.dtype = np.dtype(entry["dtype"])
        self._chunks = entry["chunks"]

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"LazyArray({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    def _overlap(self, region, chunk):
        """Where `chunk` meets region [(start, stop), ...]: (slices into the chunk, slices
        into the region), or None when they do not overlap."""
        src, dst = [], []
        for (a, b), o, n in zip(region, chunk["offset"], self._ckpt.file_shape(chunk["file"])):
            lo, hi = max(a, o), min(b, o + n)
            if lo >= hi:
                return None
            src.append(slice(lo - o, hi - o))
            dst.append(slice(lo - a, hi - a))
        return tuple(src), tuple(dst)

    def files_for(self, region) -> list:
        """Files of the chunks overlapping region [(start, stop), ...]."""
        return [c["file"] for c in self._chunks if self._overlap(region, c) is not None]

    def __getitem__(self, key):
        region, post = region_of(key, self.shape, self.name)
        out = np.empty([b - a for a, b in region], dtype=self.dtype)
        for c in self._chunks:                 # only chunks overlapping the region are opened
            where = self._overlap(region, c)
            if where is not None:
                out[where[1]] = self._ckpt.open_file(c["file"])[where[0]]
        return out[post]

    def __array__(self, dtype=None, copy=None):
        a = self[...]
        return a if dtype is None else a.astype(dtype)

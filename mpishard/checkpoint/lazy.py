"""LazyArray: a full array in a checkpoint, read only where it is sliced.

It maps the chunks overlapping a slice (np.load with mmap_mode="r", allow_pickle=False,
through the checkpoint's `open_file`, which verifies a file's sha256 before its first read) and
copies only that region, so loading a shard of a large checkpoint reads about the shard's bytes.
`region_of` is the one reading of an index key (ints, slices with any step, Ellipsis) into the
span to read and the index to apply after, for every lazily read array: LazyArray here, and
hf's SafeTensor and Mixtral expert views.
"""
from __future__ import annotations

import operator

import numpy as np


def region_of(key, shape, name) -> tuple:
    """The one reading of an index `key` (an int, a slice with any step, Ellipsis, or a tuple
    of them) into an array of `shape`, for every lazily read array (LazyArray here, hf's
    SafeTensor and expert views): (region, post), where region [(start, stop), ...] is the
    contiguous span to read in each dimension and `post` the index that takes the key's
    entries out of that span (a step, a reversal, an int that drops the dimension), so
    `read(region)[post]` equals `full[key]`. IndexError for an int out of range or too many
    indices, TypeError for anything else (an array, None, a bool, a float), naming `name`."""
    key = key if isinstance(key, tuple) else (key,)
    if sum(k is Ellipsis for k in key) > 1:
        raise IndexError(f"{name}: an index can only have one Ellipsis, got {key!r}")
    if any(k is Ellipsis for k in key):
        i = key.index(Ellipsis)
        key = key[:i] + (slice(None),) * (len(shape) - len(key) + 1) + key[i + 1:]
    key = key + (slice(None),) * (len(shape) - len(key))
    if len(key) != len(shape):
        raise IndexError(f"{len(key)} indices for a {len(shape)}-d array {name!r}")
    region, post = [], []
    for k, n in zip(key, shape):
        if isinstance(k, slice):
            r = range(*k.indices(n))
            if len(r) == 0:
                region.append((0, 0))
                post.append(slice(None))
            elif r.step == 1:
                region.append((r.start, r.stop))
                post.append(slice(None))
            else:                     # read the span, then take every step-th entry
                lo, hi = min(r[0], r[-1]), max(r[0], r[-1]) + 1
                stop = r[-1] - lo + (1 if r.step > 0 else -1)
                region.append((lo, hi))
                post.append(slice(r[0] - lo, stop if stop >= 0 else None, r.step))
        else:
            if isinstance(k, (bool, np.bool_)):
                raise TypeError(f"{name}: a bool is not an index, got {key!r}")
            try:
                i = operator.index(k)       # an integer (not a float, not an array)
            except TypeError:
                raise TypeError(f"{name}: only ints, slices and Ellipsis index a lazily "
                                f"read array, got {k!r}") from None
            j = i + n if i < 0 else i
            if not 0 <= j < n:
                raise IndexError(f"index {i} out of range for {n} in {name!r}")
            region.append((j, j + 1))
            post.append(0)
    return region, tuple(post)


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

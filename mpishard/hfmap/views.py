"""Lazily read views for a Hugging Face name map: the one reading of an index, and the tensors
of ours that are assembled from several file tensors.

`region_of` turns an index key (ints, slices with any step, Ellipsis) into the span to read and
the index to apply after; every lazily read array reads its keys through it (a checkpoint's
LazyArray, hf's SafeTensor, the views here), so all of them slice alike, as
placement.shard_array asks of an array.

A name map entry is (file key, transposed), or an object with `.keys` (the file keys it reads),
`.view(files)` (our array, read lazily from {file key: tensor}) and, where a save writes it,
`.write(array)` ({file key: array}):
    Stacked(keys)       our (E, a, b) from E file tensors (b, a), one per expert
    Fused(key, lo, hi)  our (E, a, b) as rows lo:hi of one (E, rows, a) file tensor (read only)
Slicing their views reads only the experts and the region sliced, so an expert-parallel rank
reads only its experts.
"""
from __future__ import annotations

import operator

import numpy as np


def region_of(key, shape, name) -> tuple:
    """The one reading of an index `key` (an int, a slice with any step, Ellipsis, or a tuple
    of them) into an array of `shape`, for every lazily read array (a checkpoint's LazyArray,
    hf's SafeTensor, the expert views here): (region, post), where region [(start, stop),
    ...] is the contiguous span to read in each dimension and `post` the index that takes the key's
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


# -- entries whose tensor is assembled from file tensors ------------------------------------
class Stacked:
    """Our (E, a, b) from E file tensors (b, a), one per expert (nn.Linear weights)."""

    def __init__(self, keys):
        self.keys = list(keys)

    def view(self, files):
        return StackedView([files[k].T() for k in self.keys])

    def write(self, a) -> dict:
        return {k: a[j].T for j, k in enumerate(self.keys)}


class Fused:
    """Our (E, a, b) as rows lo:hi of one file tensor (E, rows, a), last two axes swapped."""

    def __init__(self, key, lo, hi):
        self.keys, self.lo, self.hi = [key], lo, hi

    def view(self, files):
        return FusedView(files[self.keys[0]], self.lo, self.hi)


class _View:
    """A lazily read (E, a, b) array: .shape, .dtype, indexing as region_of
    reads it (steps honoured), numpy conversion."""

    ndim = 3

    def __array__(self, dtype=None, copy=None):
        a = np.ascontiguousarray(self[...])
        return a if dtype is None else a.astype(dtype)


class StackedView(_View):
    def __init__(self, parts):
        self.parts = parts
        self.shape = (len(parts),) + tuple(parts[0].shape)
        self.dtype = parts[0].dtype

    def widened(self):
        return StackedView([p.widened() for p in self.parts])

    def __getitem__(self, key):
        region, post = region_of(key, self.shape, f"the experts of {self.parts[0].key}")
        (e0, e1), (a0, a1), (b0, b1) = region
        rows = [self.parts[j][a0:a1, b0:b1] for j in range(e0, e1)]
        out = np.stack(rows) if rows else np.zeros((0, a1 - a0, b1 - b0), self.dtype)
        return out[post]


class FusedView(_View):
    def __init__(self, tensor, lo, hi):
        self.tensor, self.lo, self.hi = tensor, lo, hi
        e, _, d = tensor.shape
        self.shape, self.dtype = (e, d, hi - lo), tensor.dtype

    def widened(self):
        return FusedView(self.tensor.widened(), self.lo, self.hi)

    def __getitem__(self, key):
        region, post = region_of(key, self.shape, f"rows {self.lo}:{self.hi} of "
                                                   f"{self.tensor.key}")
        (e0, e1), (a0, a1), (b0, b1) = region
        block = self.tensor[e0:e1, self.lo + b0:self.lo + b1, a0:a1]
        return block.transpose(0, 2, 1)[post]

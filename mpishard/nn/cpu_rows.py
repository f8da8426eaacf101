"""Fused CPU kernels (numba) for the loss and the embedding's backward on numpy.

    cross_entropy(y2, t, keep, n)  (value, dy) of losses.CrossEntropy on logits (N, C): numpy's
                            row max, one loop for z = y - m (and the label's z), numpy's exp
                            in place and its row sums, one loop for the value and
                            dy = (p - onehot) / n: 5 passes over the logits, 2 of them
                            writes in place, not ~11 with 4 new arrays.
    embedding_backward(dy, ids, rows)  functional.embedding_backward's scatter-add: each row
                            of dy added to its id's row in order, one pass: bit for bit
                            np.add.at's sums (the numpy path's sorted add.reduceat adds in
                            another order: equal to rounding).

The loss's p is exp(y - m) / s where the numpy path takes exp(y - m - log s), and its value
is summed in float64 in row order, so the loss equals the xp path to rounding
(tests/nn/test_cpu_rows.py: 1e-12 in float64). Both
run where nn/cpu_fused.py's `use` says (numba present, float32 or float64 numpy arrays,
MPISHARD_CPU_FUSED not "0"); the callers run their xp ops otherwise.
"""
from __future__ import annotations

import numpy as np

from .cpu_fused import jit, use


@jit
def _shift_rows(y, m, g, t, keep, picked):
    """g = y - m per row, picked = g at the row's label (0 on an ignored row)."""
    for r in range(y.shape[0]):
        row, out, mr = y[r], g[r], m[r]
        for j in range(row.shape[0]):
            out[j] = row[j] - mr
        picked[r] = out[t[r]] if keep[r] else mr - mr


@jit
def _grad_rows(g, s, logs, t, keep, picked, n, zero, one):
    """g = exp(z) in, s its row sums, logs their logs; value -= z_t - log s (summed in
    float64), g = (g / s - onehot) / n in one pass (the label's element first, with its
    onehot: the same roundings), or 0 on an ignored row. Returns the summed value (the
    caller divides it by n)."""
    total = 0.0
    for r in range(g.shape[0]):
        out = g[r]
        if not keep[r]:
            out[:] = zero
            continue
        total -= float(picked[r] - logs[r])
        sr, tr = s[r], t[r]
        label = out[tr] / sr - one
        for j in range(out.shape[0]):
            out[j] = (out[j] / sr) / n
        out[tr] = label / n
    return total


def runs_here(itemsize: int) -> bool:
    """Whether a numpy step in this process runs cross_entropy's kernel on logits of
    `itemsize` bytes (numba present, float32 or float64, MPISHARD_CPU_FUSED not "0"): the
    loss then holds 2 logits-sized arrays (the logits and dy), not the xp path's 3 (the
    planner's memory, costs/peak_memory.py)."""
    return itemsize in (4, 8) and use(np.empty(0, dtype=f"f{itemsize}"))


def takes_loss(y2, t) -> bool:
    """Whether cross_entropy runs here: `use` for the logits, a numpy integer t."""
    return use(y2) and y2.ndim == 2 and y2.shape[1] > 0 and type(t) is np.ndarray


def cross_entropy(y2, t, keep, n):
    """(value, dy) of the softmax cross entropy of logits y2 (N, C) at integer labels t (N,),
    summed over the rows where `keep` (N,) bool is True and divided by n; 0 gradient on the
    others (as nn/fused.py's cupy kernels)."""
    y2 = np.ascontiguousarray(y2)
    dt = y2.dtype.type
    flat = np.ascontiguousarray(t.reshape(-1)).astype(np.int64, copy=False)
    keep = np.ascontiguousarray(keep, dtype=np.bool_)
    g = np.empty_like(y2)
    picked = np.empty(y2.shape[0], dtype=y2.dtype)
    m = y2.max(axis=1)                        # numpy's vectorised max (a NaN wins)
    _shift_rows(y2, m, g, flat, keep, picked)
    np.exp(g, out=g)                          # numpy's vectorised exp, in place
    s = g.sum(axis=1)                         # and its pairwise sums, as the xp path's
    total = _grad_rows(g, s, np.log(s), flat, keep, picked, dt(n), dt(0.0), dt(1.0))
    return total / n, g


@jit
def _scatter_rows(g, ids, dy):
    for r in range(ids.shape[0]):
        src, dst = dy[r], g[ids[r]]
        for j in range(src.shape[0]):
            dst[j] += src[j]


def takes_embedding(dy, ids, rows: int) -> bool:
    """Whether embedding_backward runs here: `use` for dy, numpy integer ids in [-rows,
    rows), and one row of dy per id (the loop indexes unchecked)."""
    return (use(dy) and type(ids) is np.ndarray and ids.dtype.kind in "iu" and ids.size > 0
            and dy.ndim >= 1 and dy.size == ids.size * dy.shape[-1]
            and -rows <= ids.min() and ids.max() < rows)


def embedding_backward(dy, ids, rows: int):
    """functional.embedding_backward on numpy: scatter-add dy (..., D) into (rows, D), each of
    dy's rows added in order (repeated ids as np.add.at adds them), where takes_embedding
    says so (ids in range, a row of dy per id)."""
    g = np.zeros((rows, dy.shape[-1]), dtype=dy.dtype)
    flat = np.ascontiguousarray(ids.reshape(-1)).astype(np.int64, copy=False)
    _scatter_rows(g, flat, np.ascontiguousarray(dy).reshape(-1, dy.shape[-1]))
    return g


__all__ = ["cross_entropy", "takes_loss", "runs_here", "embedding_backward", "takes_embedding"]

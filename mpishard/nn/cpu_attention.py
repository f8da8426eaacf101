"""Fused CPU kernels (numba) for attention's softmax on numpy, forward and backward.

The scores are transposed, p^T (B, H, Tk, Tq): keys down, queries across, so every loop
below runs along whole contiguous rows of queries (nn/attention.py says why).

    causal_softmax_t(p, o, v)  attention_block's masked softmax of p^T in place, and lse: one
                            loop for the max over visible keys, the shift and the mask,
                            numpy's exp, one loop for the sum over keys, the scaling and lse
                            (as nn/fused.py's cupy kernel): 2 passes and exp, not ~6. v: a
                            further bool mask (a packed row's documents, a KV cache's
                            padding): one pass more, its keys set to -inf.
    softmax_grad_t(ds, row, p) the softmax's backward, ds = (ds - row) p in place: one pass,
                            not two, bit for bit numpy's.

The forward's sums over keys add in another order than the xp path's matrix-vector product
and lse's log is libm's, so it equals the xp path to rounding (tests/nn/test_cpu_attention.py:
1e-12 of the largest magnitude in float64). Both run where nn/cpu_fused.py's `use` says
(numba present, float32 or float64 numpy arrays, MPISHARD_CPU_FUSED not "0"); the callers
run their xp ops otherwise.
"""
from __future__ import annotations

import numpy as np

from .cpu_fused import jit, use


@jit
def _shift_t(p, m, offset, ninf, zero):
    """Per slice of p^T (N, Tk, Tq) raw scores: m = the max over visible keys (key j is seen
    by query i iff j <= i + offset; 0 where none is, or not finite), then p = s - m where
    visible and s + -inf where hidden (-inf, whose exp is exactly 0, for a finite s; NaN for a
    NaN or inf one: the xp path's mask, an added -inf, gives the same). Each key row's visible
    queries are one slice, so every inner loop is a plain vector loop (the max as two
    selects, no branch)."""
    tk, tq = p.shape[1], p.shape[2]
    for n in range(p.shape[0]):
        s, mm = p[n], m[n]
        mm[:] = ninf
        for j in range(tk):
            lo = min(max(j - offset, 0), tq)
            row, top = s[j, lo:], mm[lo:]
            for i in range(row.shape[0]):
                x, y = row[i], top[i]
                u = x if x > y else y
                top[i] = x if x != x else u            # numpy's maximum keeps a NaN
        for i in range(tq):
            if not np.isfinite(mm[i]):
                mm[i] = zero
        for j in range(tk):
            lo = min(max(j - offset, 0), tq)
            hidden = s[j, :lo]
            for i in range(hidden.shape[0]):
                hidden[i] = hidden[i] + ninf           # the xp mask's add: NaN and inf stay NaN
            row, top = s[j, lo:], mm[lo:]
            for i in range(row.shape[0]):
                row[i] = row[i] - top[i]


@jit
def _hide_t(p, vis_t, heads, ninf):
    """p^T (N, Tk, Tq) + -inf where vis_t (B, H', Tk, Tq) bool, the mask transposed like p,
    hides the key from the query (as the xp path adds it: a finite score becomes -inf, a NaN or
    inf one NaN), slice n being batch n // heads and head n % heads (H' 1: one mask for every
    head)."""
    for n in range(p.shape[0]):
        s, v = p[n], vis_t[n // heads, (n % heads) % vis_t.shape[1]]
        for j in range(s.shape[0]):
            row, keep = s[j], v[j]
            for i in range(s.shape[1]):
                if not keep[i]:
                    row[i] = row[i] + ninf            # as the xp path adds -inf


@jit
def _normalise_t(p, m, lse, d, zero, one):
    """p^T (N, Tk, Tq) = exp(s - m) -> divided by its sum over keys d; lse = m + log d."""
    for n in range(p.shape[0]):
        s = p[n]
        for i in range(d.shape[0]):
            d[i] = zero
        for j in range(s.shape[0]):
            row = s[j]
            for i in range(d.shape[0]):
                d[i] += row[i]
        for i in range(d.shape[0]):
            lse[n, i] = m[n, i] + np.log(d[i])
            d[i] = one / (d[i] if d[i] > zero else one)
        for j in range(s.shape[0]):
            row = s[j]
            for i in range(d.shape[0]):
                row[i] *= d[i]


def takes_mask(visible, p_shape) -> bool:
    """Whether causal_softmax_t takes `visible` for scores p^T of p_shape (B, H, Tk, Tq): a
    numpy bool array of 4 axes that broadcasts to (B, H, Tq, Tk) (a packed row's documents,
    a KV cache's padding)."""
    if type(visible) is not np.ndarray or visible.dtype != np.bool_ or visible.ndim != 4 \
            or len(p_shape) != 4:
        return False
    b, h, tk, tq = p_shape
    return all(n in (1, want) for n, want in zip(visible.shape, (b, h, tq, tk)))


def causal_softmax_t(p, offset, visible=None):
    """attention.attention_block's masked softmax on numpy: p^T (B, H, Tk, Tq) raw scores (no
    mask added) -> (probabilities, in place when p is C-contiguous, lse (B, H, Tq)). offset
    None: every key visible. visible: None, or a further mask that takes_mask accepts (keys
    it hides get probability 0, as the xp path's -inf). Two loops around numpy's own exp,
    instead of ~6 passes."""
    p = np.ascontiguousarray(p)
    tk, tq = p.shape[-2:]
    dt = p.dtype.type
    p3 = p.reshape(-1, tk, tq)
    m = np.empty((p3.shape[0], tq), dtype=p.dtype)
    offset = tk if offset is None else int(offset)
    if visible is not None:                 # hidden keys -inf: no max, probability 0
        b, h = p.shape[:2]
        vis = np.broadcast_to(visible, (b, visible.shape[1], tq, tk))
        _hide_t(p3, np.ascontiguousarray(vis.swapaxes(-1, -2)), h, dt(-np.inf))
    _shift_t(p3, m, offset, dt(-np.inf), dt(0.0))
    np.exp(p3, out=p3)
    lse = np.empty_like(m)
    _normalise_t(p3, m, lse, np.empty(tq, dtype=p.dtype), dt(0.0), dt(1.0))   # log 0 = -inf
    return p, lse.reshape(p.shape[:-2] + (tq,))


@jit
def _softmax_grad_t(ds, row, p):
    """ds = (ds - row) p over (N, Tk, Tq) slices, row (N, Tq) broadcast down the keys."""
    for n in range(ds.shape[0]):
        d, pn, r = ds[n], p[n], row[n]
        for j in range(d.shape[0]):
            a, b = d[j], pn[j]
            for i in range(a.shape[0]):
                a[i] = (a[i] - r[i]) * b[i]


def takes_grad(ds, row, p) -> bool:
    """Whether softmax_grad_t runs here: `use`, ds and p C-contiguous (B, H, Tk, Tq) arrays
    of one shape (ds written in place), row (B, H, Tq)."""
    return (use(ds, row, p) and ds.ndim == 4 and p.shape == ds.shape
            and row.shape == ds.shape[:2] + ds.shape[3:]
            and ds.flags.c_contiguous and p.flags.c_contiguous)


def softmax_grad_t(ds, row, p):
    """nn/fused.py's softmax_grad_t on numpy (takes_grad): ds = (ds - row[..., None, :]) p
    in place, the same two roundings per element as the numpy ops, in one pass."""
    tk, tq = ds.shape[-2:]
    _softmax_grad_t(ds.reshape(-1, tk, tq), np.ascontiguousarray(row).reshape(-1, tq),
                    p.reshape(-1, tk, tq))
    return ds


__all__ = ["causal_softmax_t", "takes_mask", "softmax_grad_t", "takes_grad"]

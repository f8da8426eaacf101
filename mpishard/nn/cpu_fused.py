"""Fused CPU kernels (numba) for the element-wise passes of a step on numpy, the xp ops' math.

On one CPU core the GEMMs run near the BLAS rate and what a GPT step loses besides is the
chains of numpy operations over big arrays: each one a loop of its own that reads and writes
its whole operand. Here each chain is one loop compiled by numba (the `cpu-fused` extra),
with every constant in the array's dtype and without fast-math (no FMA contraction, no
reassociation), so each product and sum rounds as the numpy op does; only the LayerNorm's
sums along a row (`_sum`, `_dot2`) may reassociate, so they run in vector-wide partial sums:

    gelu(z)                 (y, dy/dz) of functional.gelu_forward: chunk by chunk, one loop
                            for c (z + 0.044715 z^3), numpy's own vectorised tanh in place,
                            one loop for the rest: 3 passes instead of ~15. Bit for bit the
                            numpy result, in float32 and float64.
    layernorm(x, ..)        (y, (xhat, rstd)) of functional.layernorm_forward, one row at a
                            time: sum, centre, sum of squares, scale and shift.
    layernorm_grad(dy, ..)  (dx, dscale, dshift) of functional.layernorm_backward, one row at
                            a time, the column sums accumulated as it goes.
    causal_softmax_t(p, o, v)  attention_block's masked softmax of p^T (B, H, Tk, Tq) in
                            place, and lse: one loop for the max over visible keys, the shift
                            and the mask, numpy's exp, one loop for the sum over keys, the
                            scaling and lse (as nn/fused.py's cupy kernel): 2 passes and exp,
                            not ~6. v: a further bool mask (a packed row's documents, a KV
                            cache's padding): one pass more, its keys set to -inf.

The LayerNorm row and column sums and the softmax's sums over keys add in another order than
numpy's matrix-vector products (vector-wide partial sums per row, rows in order per column), and
lse's log is libm's, so those results equal the xp path to rounding (tests/nn/test_cpu_fused.py:
1e-12 of the largest magnitude in float64), not bit for bit. AdamW's update
(train/optim_fused.py) uses the same switch.

`use(*arrays)`: numba imports, the arrays are numpy arrays of one dtype, float32 or float64,
and the environment variable MPISHARD_CPU_FUSED is not "0" (read at each call, so one process can
time both). Otherwise (cupy, 16-bit dtypes, no numba) the callers run their xp ops unchanged.
"""
from __future__ import annotations

import os

import numpy as np

try:                                    # the optional `cpu-fused` extra
    import numba
except ImportError:                     # pragma: no cover - depends on the environment
    numba = None

_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
_GELU_C = float(np.sqrt(2.0 / np.pi))   # as functional._GELU_C
CHUNK = 1 << 16                         # GELU elements per chunk: the call's dispatch amortised


def available() -> bool:
    """Whether numba imports (the kernels can run at all)."""
    return numba is not None


def use(*arrays) -> bool:
    """Whether the numba kernels run for `arrays`: numba present, MPISHARD_CPU_FUSED != "0",
    and all numpy arrays of one dtype, float32 or float64."""
    return (numba is not None and os.environ.get("MPISHARD_CPU_FUSED") != "0"
            and all(type(a) is np.ndarray and a.dtype == arrays[0].dtype for a in arrays)
            and arrays[0].dtype in _DTYPES)


def jit(fn):
    """numba.njit without fast-math (every operation rounds as numpy's), cached on disk."""
    return numba.njit(fastmath=False, cache=True)(fn) if numba is not None else fn


# -- GELU ----------------------------------------------------------------------------------------
@jit
def _gelu_inner(z, h, a, c):
    for i in range(z.shape[0]):           # h = z (c + 0.044715 c z^2)
        x = z[i]
        t = x * x * a
        t += c
        h[i] = t * x


@jit
def _gelu_outer(z, h, y, b, c2, one, half):
    for i in range(z.shape[0]):           # h = tanh(...) in, dy/dz out
        x = z[i]
        t = h[i] + one
        t *= half                         # 0.5 (1 + t)
        s = x * x * b
        s += c2                           # 2 u'
        s *= x
        s *= one - t                      # z (1 - t) u'
        s += one
        y[i] = x * t                      # 0.5 z (1 + t)
        h[i] = t * s                      # 0.5 (1 + t) (1 + z (1 - t) u')


def gelu(z):
    """functional.gelu_forward on numpy: (y, dy/dz), the same steps and roundings."""
    dt = z.dtype.type
    zf = np.ascontiguousarray(z).reshape(-1)
    y, dydz = np.empty_like(zf), np.empty_like(zf)
    a, c = dt(0.044715 * _GELU_C), dt(_GELU_C)
    b, c2, one, half = dt(6 * 0.044715 * _GELU_C), dt(2 * _GELU_C), dt(1.0), dt(0.5)
    for lo in range(0, zf.size, CHUNK):
        hi = min(lo + CHUNK, zf.size)
        zc, h = zf[lo:hi], dydz[lo:hi]
        _gelu_inner(zc, h, a, c)
        np.tanh(h, out=h)                 # numpy's tanh: its rounding, vectorised
        _gelu_outer(zc, h, y[lo:hi], b, c2, one, half)
    return y.reshape(z.shape), dydz.reshape(z.shape)


# -- LayerNorm -----------------------------------------------------------------------------------
def _sum_jit(fn):
    """numba.njit for a sum: fast-math's `reassoc` flag only, so the loop's running sum may be
    split into vector-wide partial sums while every product still rounds as numpy's (no FMA
    contraction, NaN and inf kept: no nnan/ninf). The order of the sum follows the host's
    vector width, so hosts of different instruction sets differ in its last bits."""
    return numba.njit(fastmath={"reassoc"}, cache=True)(fn) if numba is not None else fn


@_sum_jit
def _sum(a, zero):
    """sum(a) of a 1-D array, in partial sums as wide as the CPU's vectors."""
    s = zero
    for i in range(a.shape[0]):
        s += a[i]
    return s


@_sum_jit
def _dot2(a, b, zero):
    """sum(a b) of 1-D arrays: each product rounded, then _sum's partial sums."""
    s = zero
    for i in range(a.shape[0]):
        s += a[i] * b[i]
    return s


@jit
def _layernorm_rows(x, scale, shift, y, xhat, rstd, d, eps, one, zero):
    for r in range(x.shape[0]):
        row, xh = x[r], xhat[r]
        mean = _sum(row, zero) / d
        for j in range(row.shape[0]):
            xh[j] = row[j] - mean
        var = _dot2(xh, xh, zero) / d                     # biased variance
        rs = one / np.sqrt(var + eps)
        rstd[r] = rs
        yr = y[r]
        for j in range(row.shape[0]):
            v = xh[j] * rs
            xh[j] = v
            yr[j] = v * scale[j] + shift[j]


def layernorm(x, scale, shift, eps):
    """functional.layernorm_forward on numpy: (y, (xhat, rstd)), rstd shaped (..., 1)."""
    dt, d = x.dtype.type, x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, d)
    y, xhat = np.empty_like(x2), np.empty_like(x2)
    rstd = np.empty(x2.shape[0], dtype=x.dtype)
    _layernorm_rows(x2, scale, shift, y, xhat, rstd, dt(d), dt(eps), dt(1.0), dt(0.0))
    return y.reshape(x.shape), (xhat.reshape(x.shape), rstd.reshape(x.shape[:-1] + (1,)))


@jit
def _layernorm_grad_rows(dy, xhat, rstd, scale, dx, dscale, dshift, gs, d, zero):
    for r in range(dy.shape[0]):
        g, xh, out = dy[r], xhat[r], dx[r]
        for j in range(g.shape[0]):
            dshift[j] += g[j]
            dscale[j] += g[j] * xh[j]
            gs[j] = g[j] * scale[j]               # the input's gradient through the scale
        c1 = _dot2(gs, xh, zero) / d              # mean(gs xhat)
        c0 = _sum(gs, zero) / d                   # mean(gs)
        rs = rstd[r]
        for j in range(g.shape[0]):
            out[j] = ((gs[j] - c0) - xh[j] * c1) * rs


def layernorm_grad(dy, saved, scale):
    """functional.layernorm_backward on numpy: (dx, dscale, dshift)."""
    xhat, rstd = saved
    dt, d = dy.dtype.type, dy.shape[-1]
    dy2 = np.ascontiguousarray(dy).reshape(-1, d)
    xhat2 = np.ascontiguousarray(xhat).reshape(-1, d)
    dx = np.empty_like(dy2)
    dscale, dshift = np.zeros(d, dtype=dy.dtype), np.zeros(d, dtype=dy.dtype)
    _layernorm_grad_rows(dy2, xhat2, np.ascontiguousarray(rstd).reshape(-1), scale, dx,
                         dscale, dshift, np.empty(d, dtype=dy.dtype), dt(d), dt(0.0))
    return dx.reshape(dy.shape), dscale, dshift


# -- causal softmax over keys (attention) ----------------------------------------------------
@jit
def _shift_t(p, m, offset, ninf, zero):
    """Per slice of p^T (N, Tk, Tq) raw scores: m = the max over visible keys (key j is seen
    by query i iff j <= i + offset; 0 where none is, or not finite), then p = s - m where
    visible and s + -inf where hidden (-inf, whose exp is exactly 0, for a finite s; NaN for a
    NaN or inf one: the xp path's mask, an added -inf, gives the same)."""
    tk, tq = p.shape[1], p.shape[2]
    for n in range(p.shape[0]):
        s, mm = p[n], m[n]
        for i in range(tq):
            mm[i] = ninf
        for j in range(tk):
            row = s[j]
            for i in range(min(max(j - offset, 0), tq), tq):
                x, y = row[i], mm[i]
                mm[i] = x if x > y or x != x else y           # numpy's maximum keeps a NaN
        for i in range(tq):
            if not np.isfinite(mm[i]):
                mm[i] = zero
        for j in range(tk):
            row = s[j]
            lo = min(max(j - offset, 0), tq)
            for i in range(lo):
                row[i] = row[i] + ninf                # the xp mask's add: NaN and inf stay NaN
            for i in range(lo, tq):
                row[i] = row[i] - mm[i]


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


__all__ = ["available", "use", "jit", "gelu", "layernorm", "layernorm_grad", "causal_softmax_t",
           "takes_mask", "CHUNK"]

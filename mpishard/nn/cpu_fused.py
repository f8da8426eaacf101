"""Fused CPU kernels (numba) for the element-wise passes of a step on numpy, the xp ops' math.

On one CPU core the GEMMs run near the BLAS rate and what a GPT step loses besides is the
chains of numpy operations over big arrays: each one a loop of its own that reads and writes
its whole operand. Here each chain is one loop compiled by numba (the `cpu-fused` extra),
with every constant in the array's dtype and without fast-math (no FMA contraction, no
reassociation), so each product and sum rounds as the numpy op does; only the LayerNorm's
sums along a row (`_sum`, `_dot2`) may reassociate, so they run in vector-wide partial sums:

    gelu(z)                 (y, dy/dz) of pointwise.gelu_forward: chunk by chunk, one loop
                            for c (z + 0.044715 z^3), numpy's own vectorised tanh in place,
                            one loop for the rest: 3 passes instead of ~15. Bit for bit the
                            numpy result, in float32 and float64. gelu(z, overwrite=True): y
                            written over z (a GPT block's fc output, which nothing keeps).
    add_bias(y, b)          y += b on each row in place (a linear layer's bias): the same
                            adds, one plain loop instead of numpy's broadcast one.
    layernorm(x, ..)        (y, (xhat, rstd)) of functional.layernorm_forward, one row at a
                            time: sum, centre, sum of squares; then scale and shift.
    layernorm_grad(dy, ..)  (dx, dscale, dshift) of functional.layernorm_backward, one row at
                            a time, the column sums accumulated as it goes.

Attention's softmax, forward and backward, has its kernels in nn/cpu_attention.py, and the
cross-entropy and the embedding's backward theirs in nn/cpu_rows.py, under the same switch.

The LayerNorm row and column sums add in another order than numpy's matrix-vector products
(vector-wide partial sums per row, rows in order per column), so those results equal the xp
path to rounding (tests/nn/test_cpu_fused.py: 1e-12 of the largest magnitude in float64),
not bit for bit. AdamW's update (train/optim_fused.py) uses the same switch.

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
_GELU_C = float(np.sqrt(2.0 / np.pi))   # as pointwise._GELU_C
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
    """numba.njit without fast-math (every operation rounds as numpy's), cached on disk, and
    with numpy's error model: a float division by zero gives inf or NaN as numpy's does,
    where numba's default (Python's) tests every divisor to raise ZeroDivisionError, a
    branch that keeps a loop with a division from vectorising (AdamW's update ran 5x
    slower for it). numba's disk cache does not key on these flags, only on the source of
    the module that defines a kernel: a change of flags here must touch every module that
    uses `jit` (cpu_attention, cpu_rows, train/optim_fused), or old caches keep the old build."""
    return (numba.njit(fastmath=False, cache=True, error_model="numpy")(fn)
            if numba is not None else fn)


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


@jit
def _gelu_outer_over(zy, h, b, c2, one, half):
    for i in range(zy.shape[0]):          # _gelu_outer with y written over z: one array,
        x = zy[i]                         # so the loop needs no overlap check to vectorise
        t = h[i] + one
        t *= half
        s = x * x * b
        s += c2
        s *= x
        s *= one - t
        s += one
        zy[i] = x * t
        h[i] = t * s


def gelu(z, overwrite=False):
    """pointwise.gelu_forward on numpy: (y, dy/dz), the same steps and roundings.
    overwrite: y written over z where z is C-contiguous and writeable (the caller owns z
    and needs it no more): one fresh (B*T, F) array fewer, whose first write would cost a
    read of its memory as well."""
    dt = z.dtype.type
    over = overwrite and z.flags.c_contiguous and z.flags.writeable
    zf = np.ascontiguousarray(z).reshape(-1)
    y, dydz = (zf if over else np.empty_like(zf)), np.empty_like(zf)
    a, c = dt(0.044715 * _GELU_C), dt(_GELU_C)
    b, c2, one, half = dt(6 * 0.044715 * _GELU_C), dt(2 * _GELU_C), dt(1.0), dt(0.5)
    for lo in range(0, zf.size, CHUNK):
        hi = min(lo + CHUNK, zf.size)
        zc, h = zf[lo:hi], dydz[lo:hi]
        _gelu_inner(zc, h, a, c)
        np.tanh(h, out=h)                 # numpy's tanh: its rounding, vectorised
        if over:
            _gelu_outer_over(zc, h, b, c2, one, half)
        else:
            _gelu_outer(zc, h, y[lo:hi], b, c2, one, half)
    return y.reshape(z.shape), dydz.reshape(z.shape)


# -- bias -------------------------------------------------------------------------------------
@jit
def _add_rows(y, b):
    for r in range(y.shape[0]):
        row = y[r]
        for j in range(row.shape[0]):
            row[j] += b[j]


def add_bias(y, b) -> bool:
    """y += b over y's rows, in place, where the kernel takes it (`use`, y C-contiguous with
    b as its last axis): numpy's own add, bit for bit, at 2-3x its broadcast loop's speed.
    Returns whether it ran (the caller adds with numpy otherwise)."""
    if not (use(y, b) and b.ndim == 1 and y.ndim >= 1 and y.shape[-1] == b.shape[0] > 0
            and y.flags.c_contiguous and y.flags.writeable):
        return False
    _add_rows(y.reshape(-1, b.shape[0]), np.ascontiguousarray(b))
    return True


# -- LayerNorm -----------------------------------------------------------------------------------
def _sum_jit(fn):
    """numba.njit for a sum: fast-math's `reassoc` flag only, so the loop's running sum may be
    split into vector-wide partial sums while every product still rounds as numpy's (no FMA
    contraction, NaN and inf kept: no nnan/ninf). The order of the sum follows the host's
    vector width, so hosts of different instruction sets differ in its last bits."""
    return (numba.njit(fastmath={"reassoc"}, cache=True, error_model="numpy")(fn)
            if numba is not None else fn)


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
def _layernorm_stats(x, xhat, rstd, d, eps, one, zero):
    """Per row: xhat = x - mean, rstd = 1 / sqrt(biased variance + eps)."""
    for r in range(x.shape[0]):
        row, xh = x[r], xhat[r]
        mean = _sum(row, zero) / d
        for j in range(row.shape[0]):
            xh[j] = row[j] - mean
        var = _dot2(xh, xh, zero) / d                     # biased variance
        rstd[r] = one / np.sqrt(var + eps)


@jit
def _layernorm_scale(xhat, rstd, scale, shift, y):
    """Per row: xhat *= rstd, y = xhat scale + shift (a loop of its own: fused into the
    statistics' loop it ran at 0.7x the speed of the two)."""
    for r in range(xhat.shape[0]):
        xh, yr, rs = xhat[r], y[r], rstd[r]
        for j in range(xh.shape[0]):
            v = xh[j] * rs
            xh[j] = v
            yr[j] = v * scale[j] + shift[j]


def layernorm(x, scale, shift, eps):
    """functional.layernorm_forward on numpy: (y, (xhat, rstd)), rstd shaped (..., 1)."""
    dt, d = x.dtype.type, x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, d)
    y, xhat = np.empty_like(x2), np.empty_like(x2)
    rstd = np.empty(x2.shape[0], dtype=x.dtype)
    _layernorm_stats(x2, xhat, rstd, dt(d), dt(eps), dt(1.0), dt(0.0))
    _layernorm_scale(xhat, rstd, scale, shift, y)
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


__all__ = ["available", "use", "jit", "add_bias", "gelu", "layernorm", "layernorm_grad", "CHUNK"]

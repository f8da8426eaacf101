"""Forward/backward pairs: linear, LayerNorm and embedding, on any array module `xp`
(attention: attention.py; the element-wise activations: pointwise.py, whose names this module
also exports, as it did when they lived here).

The einsum strings are the shape documentation. `einsum` below routes every two-operand,
one-contraction spec ('bd,df->bf', 'bf,df->bd', 'bd,bf->df', ...) to a single BLAS matmul with
the right transposes, cached per spec, so the hot path runs at GEMM speed on numpy and cupy
alike; anything else falls back to `xp.einsum(..., optimize=True)`.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import cpu_fused, cpu_rows, cuda_ops
from .gemm import F32, is_low, matmul
from .pointwise import (ACTIVATIONS, GELU_CHUNK, activation_backward,  # noqa: F401 (exported)
                        activation_forward, check_activation, gelu_backward, gelu_forward,
                        identity_backward, identity_forward, relu_backward, relu_forward,
                        sigmoid_backward, sigmoid_forward, tanh_backward, tanh_forward)
from .xp import array_module


@lru_cache(maxsize=None)
def _matmul_plan(spec: str):
    """For 'ij,jk->ik'-like specs, optionally behind the same batch letters in all three
    ('bhtd,bhsd->bhts'): (transpose a?, transpose b?, transpose out?) or None."""
    try:
        ins, out = spec.replace(" ", "").split("->")
        a, b = ins.split(",")
    except ValueError:
        return None
    if not len(a) == len(b) == len(out) >= 2 or not a[:-2] == b[:-2] == out[:-2]:
        return None
    batch, (a, b, out) = a[:-2], (a[-2:], b[-2:], out[-2:])
    if set(batch) & set(a + b + out) or len(set(batch)) != len(batch):
        return None
    shared = set(a) & set(b)
    if len(shared) != 1 or len(set(a + b)) != 3:
        return None
    c = shared.pop()
    i = a.replace(c, "")
    k = b.replace(c, "")
    if c in out or set(out) != {i, k}:
        return None
    return (a[0] == c, b[1] == c, out != i + k)


def _t(a):
    """Swap the last two axes (the transpose of each matrix of a batch)."""
    return a.swapaxes(-1, -2)


CACHE_PATHS = True
"""Reuse numpy's contraction path per (spec, shapes) for non-matmul specs (switchable)."""
_PATHS: dict = {}


def _einsum_path(spec, a, b):
    key = (spec, a.shape, b.shape)
    path = _PATHS.get(key)
    if path is None:
        path = _PATHS[key] = np.einsum_path(spec, a, b, optimize="greedy")[0]
    return path


def einsum(spec: str, a, b):
    """`xp.einsum(spec, a, b)`, on BLAS for matmul-shaped specs (nn/gemm.py's matmul: 16-bit
    operands give a 16-bit result, summed in float32; other specs sum them in float32)."""
    plan = _matmul_plan(spec)
    xp = array_module(a)
    if plan is None:
        if is_low(a) or is_low(b):         # 16-bit operands: widened (exact), float32 sums
            a, b = a.astype(F32), b.astype(F32)
        if CACHE_PATHS and xp is np:       # path search once per (spec, shapes), not per call
            return np.einsum(spec, a, b, optimize=_einsum_path(spec, a, b))
        return xp.einsum(spec, a, b, optimize=True)
    ta, tb, tout = plan
    if tout:  # (A B)^T = B^T A^T: swap operands instead of transposing the result
        return matmul(xp, b if tb else _t(b), a if ta else _t(a))
    return matmul(xp, _t(a) if ta else a, _t(b) if tb else b)   # 16-bit: nn/gemm.py


# -- linear ------------------------------------------------------------------------------------
# Leading dims are rows: x (B, T, D) runs as (B*T, D), so 'bd,df->bf' reads b = B*T.
def linear_forward(x, w, b=None):
    """y = x W + b.   'bd,df->bf'  (x: (..., D) as rows b, w: (D, F), b: (F,))."""
    x2 = x.reshape(-1, x.shape[-1])
    if b is not None and is_low(x2):       # 16-bit: the bias goes into the float32 product
        y = wide_product(x2, w)            # (autocast's addmm: one rounding, by the caller)
    else:
        y = einsum("bd,df->bf", x2, w)
    y = y.reshape(x.shape[:-1] + w.shape[1:])
    if b is not None and not cpu_fused.add_bias(y, b):     # numpy + numba: a plain loop
        y += b
    return y


def wide_product(x2, w):
    """x2 @ w of 16-bit (rows, D) and (D, F) as float32, unrounded: the product a bias is
    added to before autocast's one rounding."""
    xp = array_module(x2)
    return matmul(xp, x2, w, out=xp.empty((x2.shape[0],) + w.shape[1:], dtype=F32))


def linear_backward(dy, x, w, need_dx=True):
    """Undo linear_forward: returns (dx, dw, db).

    dw = x^T dy   'bd,bf->df'   (undoes the contraction over d)
    db = sum_b dy              (undoes the broadcast of b over rows)
    dx = dy W^T   'bf,df->bd'   (None when the input needs no gradient)
    """
    dw, db = linear_backward_weights(dy, x)
    return (linear_backward_input(dy, w, x.shape) if need_dx else None), dw, db


def linear_backward_input(dy, w, x_shape):
    """dx = dy W^T   'bf,df->bd', reshaped to the input's shape (a zero-bubble B pass)."""
    return einsum("bf,df->bd", dy.reshape(-1, dy.shape[-1]), w).reshape(x_shape)


def linear_backward_weights(dy, x):
    """(dw, db): dw = x^T dy 'bd,bf->df', db = sum_b dy (a zero-bubble W pass)."""
    x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
    return einsum("bd,bf->df", x2, dy2), column_sums(dy2)


def row_sums(a):
    """Sums over the last axis, kept as a length-1 axis: a BLAS matrix-vector product with ones
    (numpy's own reduction along a short last axis runs several times slower)."""
    return (a @ array_module(a).ones(a.shape[-1], dtype=a.dtype))[..., None]


def column_sums(a2):
    """Sums over the rows of a 2-D array: ones @ a2 (a BLAS matrix-vector product)."""
    xp = array_module(a2)
    return matmul(xp, xp.ones(a2.shape[0], dtype=a2.dtype), a2)    # 16-bit: float32 sums


# -- layer norm and embedding ------------------------------------------------------------------
LN_EPS = 1e-5


def layernorm_forward(x, scale, shift, eps=LN_EPS):
    """PyTorch's LayerNorm over the last dim: y = (x - mean) / sqrt(var + eps) * scale + shift,
    var the biased variance. Returns (y, saved). Row sums are matrix-vector products
    (row_sums) and the variance one einsum, no squared temporary. saved is (xhat, rstd), or
    on cupy with the fused kernels (cuda_ops.norm_takes) (x, mean, rstd) of one kernel's
    forward, whose backward kernel recomputes xhat."""
    if cpu_fused.use(x, scale, shift):                       # numpy + numba: one loop per row
        return cpu_fused.layernorm(x, scale, shift, eps)
    xp = array_module(x)
    if cuda_ops.norm_takes(xp, x, scale, shift):             # cupy: one kernel (cuda_ops)
        x = cuda_ops.saved_input(xp, x)
        y, mean, rstd = cuda_ops.layernorm_forward(xp, x, scale, shift, eps)
        return y, (x, mean, rstd)                            # xhat recomputed in backward
    d = x.shape[-1]
    xc = x - row_sums(x) / d
    var = xp.einsum("...d,...d->...", xc, xc)[..., None] / d     # biased variance
    rstd = 1.0 / xp.sqrt(var + eps)
    xhat = xc
    xhat *= rstd                                            # in place: xc is ours
    y = xhat * scale
    y += shift
    return y, (xhat, rstd)


def layernorm_backward(dy, saved, scale):
    """Undo layernorm_forward: (dx, dscale, dshift).

    dshift = sum over rows of dy               (undoes + shift)
    dscale = sum over rows of dy * xhat        (undoes * scale)
    dx = rstd (g - mean(g) - xhat mean(g xhat)),  g = dy * scale   (undoes the normalisation)

    The row means are matrix-vector products with scale: mean(g) = dy scale / D and
    mean(g xhat) = (dy xhat) scale / D, so g xhat is never formed.
    """
    if cpu_fused.use(dy, *saved, scale):                     # numpy + numba: one loop per row
        return cpu_fused.layernorm_grad(dy, saved, scale)
    xp = array_module(dy)
    if len(saved) == 3:                                      # the forward ran cuda_ops' kernel
        x, mean, rstd = saved
        return cuda_ops.layernorm_backward(xp, dy, x, scale, mean, rstd)
    xhat, rstd = saved
    d = dy.shape[-1]
    dshift = column_sums(dy.reshape(-1, d))
    gx = dy * xhat                                          # dy xhat
    dscale = column_sums(gx.reshape(-1, d))
    c1 = ((gx @ scale) / d)[..., None]                      # mean(g xhat)
    c0 = ((dy @ scale) / d)[..., None]                      # mean(g)
    dx = dy * scale                                         # g
    dx -= c0                                                # g - mean(g)
    xp.multiply(xhat, c1, out=gx)                           # xhat mean(g xhat), in gx
    dx -= gx
    dx *= rstd
    return dx, dscale, dshift


def embedding_forward(table, ids):
    """Rows of `table` (V, D) picked by integer `ids` (...): (..., D)."""
    return table[ids]


def embedding_backward(dy, ids, rows: int):
    """Undo the gather: scatter-add dy (..., D) into a (rows, D) gradient (repeated ids add).

    On numpy: nn/cpu_rows.py's loop where numba runs (np.add.at's sums, in its order), else
    sort the ids, sum each run of equal ids with one add.reduceat and write the sums to their
    rows (one buffered pass instead of the unbuffered, element-at-a-time `np.add.at`); other
    array modules (cupy: an atomic scatter-add kernel) use `xp.add.at`."""
    xp = array_module(dy)
    if cpu_rows.takes_embedding(dy, ids, rows):             # numpy + numba: one pass, in order
        return cpu_rows.embedding_backward(dy, ids, rows)
    g = xp.zeros((rows, dy.shape[-1]), dtype=dy.dtype)
    flat, dy2 = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
    if xp is not np or flat.size == 0:
        xp.add.at(g, flat, dy2)
        return g
    flat = np.where((flat < 0) & (flat >= -rows), flat + rows, flat)   # -1, rows - 1: one run
    order = np.argsort(flat, kind="stable")                 # equal ids keep their order
    sorted_ids = flat[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])   # each run
    g[sorted_ids[starts]] = np.add.reduceat(dy2[order], starts, axis=0)
    return g

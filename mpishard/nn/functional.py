"""Forward/backward pairs: linear, LayerNorm, embedding and activations, on any array module
`xp` (attention: attention.py).

The einsum strings are the shape documentation. `einsum` below routes every two-operand,
one-contraction spec ('bd,df->bf', 'bf,df->bd', 'bd,bf->df', ...) to a single BLAS matmul with
the right transposes, cached per spec, so the hot path runs at GEMM speed on numpy and cupy
alike; anything else falls back to `xp.einsum(..., optimize=True)`.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from . import cpu_fused, cpu_rows, cuda_ops, fused
from .gemm import F32, is_low, matmul


def array_module(a):
    """numpy or cupy, whichever owns `a` (another device array: its `__array_namespace__`)."""
    mod = type(a).__module__.split(".")[0]
    if mod == "cupy":
        import cupy

        return cupy
    namespace = getattr(a, "__array_namespace__", None)
    return np if namespace is None or isinstance(a, np.ndarray) else namespace()


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
        xp = array_module(x2)              # (autocast's addmm: one rounding, by the caller)
        y = matmul(xp, x2, w, out=xp.empty((x2.shape[0],) + w.shape[1:], dtype=F32))
    else:
        y = einsum("bd,df->bf", x2, w)
    y = y.reshape(x.shape[:-1] + w.shape[1:])
    if b is not None and not cpu_fused.add_bias(y, b):     # numpy + numba: a plain loop
        y += b
    return y


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
    if cpu_rows.takes_embedding(dy, ids) and ids.size and -rows <= ids.min() \
            and ids.max() < rows:                           # numpy + numba: one pass, in order
        return cpu_rows.embedding_backward(dy, ids, rows)
    g = xp.zeros((rows, dy.shape[-1]), dtype=dy.dtype)
    flat, dy2 = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
    if xp is not np or flat.size == 0:
        xp.add.at(g, flat, dy2)
        return g
    order = np.argsort(flat, kind="stable")                 # equal ids keep their order
    sorted_ids = flat[order]
    starts = np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]])   # each run
    g[sorted_ids[starts]] = np.add.reduceat(dy2[order], starts, axis=0)
    return g


# -- activations -------------------------------------------------------------------------------
# Each forward returns (y, saved); each backward takes (dy, saved) and returns dx.
_GELU_C = float(np.sqrt(2.0 / np.pi))


def relu_forward(z):
    return z * (z > 0), z


def relu_backward(dy, z):
    return dy * (z > 0)                        # d relu/dz = 1 where z > 0


GELU_CHUNK = 1 << 16
"""Elements per pass in gelu_forward: its ~15 element-wise passes run on a chunk that stays in
cache instead of streaming whole (B*T, F) arrays through memory each time."""


def gelu_forward(z, overwrite=False):
    """GELU, tanh form (PyTorch approximate='tanh'): y = 0.5 z (1 + t), t = tanh(c (z + 0.044715
    z^3)). Saves the derivative dy/dz instead of z and t (one array on the tape, not two), so
    the backward is one multiply:

        dy/dz = 0.5 (1 + t) + 0.5 z (1 - t^2) c (1 + 3 0.044715 z^2)
              = 0.5 (1 + t) (1 + z (1 - t) u'),   u' = c (1 + 3 0.044715 z^2)

    Computed chunk by chunk (GELU_CHUNK elements) on numpy, in place on the chunk's buffers;
    on cupy one fused kernel of the same steps (fused.py). overwrite: the caller owns z and
    needs it no more, so y may be written over it (the numba kernel does: cpu_fused.gelu)."""
    xp = array_module(z)
    if fused.use(xp):                                        # cupy: the same steps, one kernel
        return fused.gelu(xp, z)
    if cpu_fused.use(z):                                     # numpy + numba: 3 passes, not ~15
        return cpu_fused.gelu(z, overwrite)
    zf = z.reshape(-1)
    y, dydz = xp.empty_like(zf), xp.empty_like(zf)
    n = zf.size
    chunk = min(GELU_CHUNK, n) if xp is np else n
    sq = xp.empty(max(chunk, 1), dtype=z.dtype)              # z^2, then 1 + z (1 - t) u'
    for lo in range(0, n, max(chunk, 1)):
        hi = min(lo + chunk, n)
        zc, s, yc, h = zf[lo:hi], sq[:hi - lo], y[lo:hi], dydz[lo:hi]
        xp.multiply(zc, zc, out=s)           # z^2
        xp.multiply(s, 0.044715 * _GELU_C, out=h)
        h += _GELU_C
        h *= zc                              # c (z + 0.044715 z^3) as z (c + 0.044715 c z^2)
        xp.tanh(h, out=h)                    # t
        h += 1.0
        h *= 0.5                             # h = 0.5 (1 + t)
        s *= 6 * 0.044715 * _GELU_C
        s += 2 * _GELU_C                     # 2 u' = 2 c (1 + 3 0.044715 z^2)
        s *= zc
        xp.subtract(1.0, h, out=yc)          # 0.5 (1 - t), y's chunk as scratch
        s *= yc                              # z (1 - t) u'
        s += 1.0
        xp.multiply(zc, h, out=yc)           # y = 0.5 z (1 + t)
        h *= s                               # dy/dz = 0.5 (1 + t) (1 + z (1 - t) u')
    return y.reshape(z.shape), dydz.reshape(z.shape)


def gelu_backward(dy, dydz, overwrite=False):
    """dz = dy dy/dz (the derivative gelu_forward saved). overwrite: written into dydz, which
    the caller owns and needs no more (the Activation layer's popped tape entry), where shapes
    and dtypes allow: no new (B*T, F) array to write."""
    xp = array_module(dy)
    if overwrite and dy.shape == dydz.shape and dy.dtype == dydz.dtype \
            and array_module(dydz) is xp:
        return xp.multiply(dy, dydz, out=dydz)
    return dy * dydz


def sigmoid_forward(z):
    xp = array_module(z)
    y = 0.5 * (xp.tanh(0.5 * z) + 1.0)         # stable for large |z|
    return y, y


def sigmoid_backward(dy, y):
    return dy * y * (1.0 - y)


def tanh_forward(z):
    xp = array_module(z)
    y = xp.tanh(z)
    return y, y


def tanh_backward(dy, y):
    return dy * (1.0 - y * y)


def identity_forward(z):
    return z, None


def identity_backward(dy, _):
    return dy


ACTIVATIONS = {
    "relu": (relu_forward, relu_backward),
    "gelu": (gelu_forward, gelu_backward),
    "sigmoid": (sigmoid_forward, sigmoid_backward),
    "tanh": (tanh_forward, tanh_backward),
    "identity": (identity_forward, identity_backward),
}


def check_activation(name) -> str:
    if name not in ACTIVATIONS:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(ACTIVATIONS)}")
    return name


def activation_forward(name, z, overwrite=False):
    """(act(z), what the backward needs); overwrite: the caller owns z and needs it no more,
    so GELU may write y over it (gelu_forward)."""
    if overwrite and name == "gelu":
        return gelu_forward(z, overwrite=True)
    return ACTIVATIONS[name][0](z)


def activation_backward(name, dy, saved, overwrite=False):
    """dL/dz from dL/dy and what the forward saved; overwrite: the caller owns `saved` and
    needs it no more, so GELU may write dz into it (gelu_backward)."""
    if overwrite and name == "gelu":
        return gelu_backward(dy, saved, overwrite=True)
    return ACTIVATIONS[name][1](dy, saved)

"""Element-wise activations as forward/backward pairs, on any array module `xp`.

Each forward returns (y, saved); each backward takes (dy, saved) and returns dx. GELU is the
tanh form and saves its derivative (one array on the tape); on cupy and on numpy with numba
its passes run fused (fused.py, cpu_fused.py). `ACTIVATIONS` maps a name to its pair;
`activation_forward`/`activation_backward` dispatch by name (the Activation layer's calls).
"""
from __future__ import annotations

import numpy as np

from . import cpu_fused, cuda_ops, fused
from .xp import array_module

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


class LowSaved(tuple):
    """What a 16-bit GELU keeps for its backward on cupy: (u,), its 16-bit input, from which
    the kernel recomputes the derivative (a tuple: the tape meter counts u)."""


def low_activation_forward(name, z):
    """(act(z), saved) of a 16-bit z (the GPT MLP's fc output under a device's 16-bit
    compute): act's float32 value on the exactly widened z, rounded once to z's dtype (what
    the next matmul would round it to). GELU on cupy: one kernel that reads z as stored and
    keeps it (cuda_ops.bias_gelu_forward, the derivative recomputed in the backward; half
    the bytes of a float32 derivative); otherwise the float32 activation on a widened copy,
    keeping its own saved value."""
    xp = array_module(z)
    if name == "gelu" and cuda_ops.use(xp):
        y, u = cuda_ops.bias_gelu_forward(xp, z)
        return y, LowSaved((u,))
    y, saved = activation_forward(name, z.astype(np.float32), overwrite=True)
    return y.astype(z.dtype), saved


def low_activation_backward(name, dy, saved):
    """dL/dz of low_activation_forward from a 16-bit dy (or a float32 one on the 16-bit
    grid): the GELU kernel's dz = dy gelu'(u) rounded to u's dtype (the next matmul rounds
    it so), or the float32 activation's backward on dy widened."""
    if isinstance(saved, LowSaved):
        (u,) = saved
        return cuda_ops.gelu_backward(array_module(u), dy.astype(u.dtype, copy=False), u)
    return activation_backward(name, dy.astype(np.float32), saved, overwrite=True)

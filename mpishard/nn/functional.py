"""Forward/backward pairs: linear layers and activations, on any array module `xp`.

The einsum strings are the shape documentation. `einsum` below routes every two-operand,
one-contraction spec ('bd,df->bf', 'bf,df->bd', 'bd,bf->df', ...) to a single BLAS matmul with
the right transposes, cached per spec, so the hot path runs at GEMM speed on numpy and cupy
alike; anything else falls back to `xp.einsum(..., optimize=True)`.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np


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
    """For 'ij,jk->ik'-like specs: (transpose a?, transpose b?, transpose out?) or None."""
    try:
        ins, out = spec.replace(" ", "").split("->")
        a, b = ins.split(",")
    except ValueError:
        return None
    if len(a) != 2 or len(b) != 2 or len(out) != 2:
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
    """`xp.einsum(spec, a, b)`, on BLAS for matmul-shaped specs."""
    plan = _matmul_plan(spec)
    xp = array_module(a)
    if plan is None:
        if CACHE_PATHS and xp is np:       # path search once per (spec, shapes), not per call
            return np.einsum(spec, a, b, optimize=_einsum_path(spec, a, b))
        return xp.einsum(spec, a, b, optimize=True)
    ta, tb, tout = plan
    if tout:  # (A B)^T = B^T A^T: swap operands instead of transposing the result
        return xp.matmul(b if tb else b.T, a if ta else a.T)
    return xp.matmul(a.T if ta else a, b.T if tb else b)


# -- linear ------------------------------------------------------------------------------------
def linear_forward(x, w, b=None):
    """y = x W + b.   'bd,df->bf'  (x: (B, D), w: (D, F), b: (F,))."""
    y = einsum("bd,df->bf", x, w)
    if b is not None:
        y += b
    return y


def linear_backward(dy, x, w, need_dx=True):
    """Undo linear_forward: returns (dx, dw, db).

    dw = x^T dy   'bd,bf->df'   (undoes the contraction over d)
    db = sum_b dy              (undoes the broadcast of b over rows)
    dx = dy W^T   'bf,df->bd'   (None when the input needs no gradient)
    """
    dw = einsum("bd,bf->df", x, dy)
    db = dy.sum(axis=0)
    dx = einsum("bf,df->bd", dy, w) if need_dx else None
    return dx, dw, db


# -- activations -------------------------------------------------------------------------------
# Each forward returns (y, saved); each backward takes (dy, saved) and returns dx.
_GELU_C = float(np.sqrt(2.0 / np.pi))


def relu_forward(z):
    return z * (z > 0), z


def relu_backward(dy, z):
    return dy * (z > 0)                        # d relu/dz = 1 where z > 0


def gelu_forward(z):
    """GELU, tanh form (PyTorch approximate='tanh'): 0.5 z (1 + tanh(c (z + 0.044715 z^3)))."""
    xp = array_module(z)
    t = xp.tanh(_GELU_C * (z + 0.044715 * z ** 3))
    return 0.5 * z * (1.0 + t), (z, t)


def gelu_backward(dy, saved):
    z, t = saved
    dt = _GELU_C * (1.0 + 3 * 0.044715 * z ** 2)
    return dy * (0.5 * (1.0 + t) + 0.5 * z * (1.0 - t * t) * dt)


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


def activation_forward(name, z):
    return ACTIVATIONS[name][0](z)


def activation_backward(name, dy, saved):
    return ACTIVATIONS[name][1](dy, saved)

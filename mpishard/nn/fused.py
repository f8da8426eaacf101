"""Fused cupy kernels for the memory-bound passes of a GPT step, the same math as xp ops.

On a GPU the GEMMs run near peak and the step's extra time is element-wise passes over big
arrays: each xp operation is one kernel that reads and writes its whole operand. Per layer at
B 8, H 12, T 1024 the attention scores p^T (B, H, Tk, Tq) are 400 MB in float32, the GELU
input (B T, 4 D) 100 MB, and the loss's logits (B T, V) 1.6 GB. Here each of those chains is
one kernel (`cupy.ElementwiseKernel` / `cupy.ReductionKernel`, built once per process and
memoised as parallel/bf16.py does, compiled by cupy on first use, without FMA contraction so
every product and sum rounds as the xp op does; their specs are data, ELEMENTWISE and
REDUCTION, which tests/nn/test_nvrtc.py compiles with NVRTC without a GPU):

    causal_softmax_t(p, offset)   p^T (B, H, Tk, Tq) raw scores -> probabilities in place, and
                                  lse (B, H, Tq): per query column i the keys j <= i + offset
                                  are visible; m = max of them (0 if none or not finite),
                                  d = sum exp(s - m), p = exp(s - m) * (1 / d) (0 hidden,
                                  1 / 1 when d = 0), lse = m + log d.  Three reads of the
                                  visible half and one write, instead of ~11 full passes
                                  (mask add, max halvings, subtract, exp, sum, scale).
                                  The causal mask only: attention with a further `visible`
                                  mask (packed documents, a KV cache's padding) runs the
                                  xp ops instead (attention.attention_block), the same math.
    softmax_grad_t(ds, row, p)    ds = (ds - row) p in place (attention backward), one pass.
    dot_over_keys(a, b)           sum_s a b over the keys of (B, H, Tk, Tq) arrays (the softmax
                                  backward's row sums under autocast), one pass, no copies.
    matmul_tn(a, b)               a^T b of batched matrices without cupy's copy of a^T (the
                                  attention's p^T v and ds^T k: 2 x 400 MB copies per layer).
    gelu(z)                       (y, dy/dz) of pointwise.gelu_forward, one pass, not ~15.
    cross_entropy(y2, t)          (value, dy) of losses.CrossEntropy: row max, sum of
                                  exp(y - m), then dy = (exp((y - m) - log s) - onehot) / N in
                                  one pass: 4 passes over the logits instead of ~11.

The sums run in another order than cupy's matmul-with-ones / reduction (and matmul_tn's GEMM
is cuBLAS's on the transposed problem), so a fused result equals the xp-op one to rounding
(tests/nn/test_fused.py: rtol 1e-12 in float64), not bit for bit; every other operation is
the same. `use(xp)`: only on cupy, and only while the environment variable
MPISHARD_FUSED is not "0" (read at each call, so one process can time both). On numpy and any
other array module the callers run their xp ops unchanged.
"""
from __future__ import annotations

import math
import os
from functools import lru_cache

from . import gemm

_GELU_C = math.sqrt(2.0 / math.pi)
_NO_FMA = ("--fmad=false",)


def use(xp) -> bool:
    """Whether the fused kernels run for arrays of `xp`: cupy and MPISHARD_FUSED != "0"."""
    return getattr(xp, "__name__", "") == "cupy" and os.environ.get("MPISHARD_FUSED") != "0"


_SOFTMAX_T = """
const long long col = i % tq;                      // the query column of p^T
const long long base = (i / tq) * tk * tq + col;   // p^T[b, h, 0, col]
long long last = col + offset;                     // keys 0..last are visible
if (last > tk - 1) last = tk - 1;
T m = 0;
if (last >= 0) {
    m = p[base];
    for (long long j = 1; j <= last; ++j) { T v = p[base + j * tq]; if (v > m) m = v; }
    if (!isfinite(m)) m = 0;
}
T d = 0;
for (long long j = 0; j <= last; ++j) d += exp(p[base + j * tq] - m);
const T inv = (T)1 / (d > 0 ? d : (T)1);
for (long long j = 0; j < tk; ++j) {
    const long long at = base + j * tq;
    p[at] = j <= last ? exp(p[at] - m) * inv : (T)0;
}
lse = m + log(d);
"""

_GELU = """
T s = z * z;
T h = s * (T)({a});
h += (T)({c});
h *= z;
h = tanh(h);
h += (T)1;
h *= (T)0.5;
s *= (T)({b});
s += (T)({c2});
s *= z;
s *= (T)1 - h;
s += (T)1;
y = z * h;
dydz = h * s;
""".format(a=repr(0.044715 * _GELU_C), c=repr(_GELU_C), b=repr(6 * 0.044715 * _GELU_C),
           c2=repr(2 * _GELU_C))

_CE_GRAD = """
const long long r = i / c;
if (!k[r]) { g = (T)0; } else {
T e = exp((y - m[r]) - logs[r]);
if (i - r * c == (long long)t[r]) e -= (T)1;
g = e / n;
}
"""


ELEMENTWISE = {
    "softmax_t": ("int64 tk, int64 tq, int64 offset", "raw T p, T lse", _SOFTMAX_T,
                  "mpishard_causal_softmax_t"),
    "softmax_grad": ("T row, T p", "T ds", "ds = (ds - row) * p", "mpishard_softmax_grad_t"),
    "gelu": ("T z", "T y, T dydz", _GELU, "mpishard_gelu_tanh"),
    "ce_grad": ("T y, raw T m, raw T logs, raw I t, raw bool k, int64 c, T n", "T g", _CE_GRAD,
                "mpishard_ce_grad"),
}
"""The ElementwiseKernels by name: (in params, out params, body, kernel name)."""
REDUCTION = {
    "sumexp": ("T y, T m", "T s", "exp(y - m)", "a + b", "s = a", "0", "mpishard_sumexp"),
    "dot_keys": ("T x, T y", "T r", "x * y", "a + b", "r = a", "0", "mpishard_dot_over_keys"),
}
"""The ReductionKernels by name: (in, out, map, reduce, post, identity, kernel name)."""


@lru_cache(maxsize=None)
def kernels(cupy) -> dict:
    """The kernels, by name (kernel code, no state)."""
    out = {name: cupy.ElementwiseKernel(*spec, options=_NO_FMA)
           for name, spec in ELEMENTWISE.items()}
    out.update((name, cupy.ReductionKernel(*spec, options=_NO_FMA))
               for name, spec in REDUCTION.items())
    return out


def causal_softmax_t(xp, p, offset):
    """p^T (B, H, Tk, Tq) contiguous raw scores -> probabilities in place; returns lse."""
    tk, tq = p.shape[-2:]
    lse = xp.empty(p.shape[:-2] + (tq,), dtype=p.dtype)
    kernels(xp)["softmax_t"](tk, tq, tk if offset is None else int(offset), p, lse)
    return lse


def dot_over_keys(xp, a, b):
    """'bhst,bhst->bht': sum over the keys (axis -2) of a * b, one pass without temporaries
    on cupy (cupy's einsum copied both (B, H, T, T) operands first: 2 x 400 MB a layer in
    the H200's bfloat16 profile); xp.einsum off it."""
    if use(xp):
        return kernels(xp)["dot_keys"](a, b, axis=-2)
    return xp.einsum("bhst,bhst->bht", a, b)


def softmax_grad_t(xp, ds, row, p):
    """ds = (ds - row[..., None, :]) * p, in place (xp ops off cupy)."""
    if use(xp):
        kernels(xp)["softmax_grad"](row[..., None, :], p, ds)
        return ds
    ds -= row[..., None, :]
    ds *= p
    return ds


def matmul_tn(xp, a, b, out=None):
    """'...ji,...jk->...ik' (a^T b over the last two axes), into `out` when given.

    cupy's batched matmul makes every operand C-contiguous first, so xp.matmul(a^T, b) copies
    the transposed (B, H, T, T) a (a strided 400 MB copy per call at GPT size) before the
    GEMM. With `use(xp)` it runs as (b^T a)^T instead: a is read as it lies and only the
    (B, H, T, Dh) b^T and result are copied; the same products, summed in cuBLAS's order."""
    if not use(xp) or gemm.is_low(a):        # 16-bit: cuBLAS reads a^T where it lies
        return gemm.matmul(xp, a.swapaxes(-1, -2), b, out=out)
    r = xp.matmul(b.swapaxes(-1, -2), a).swapaxes(-1, -2)
    if out is None:
        return r
    out[...] = r
    return out


def gelu(xp, z):
    """(y, dy/dz) of the tanh GELU, one pass (cupy only)."""
    y, dydz = xp.empty_like(z), xp.empty_like(z)
    kernels(xp)["gelu"](z, y, dydz)
    return y, dydz


def cross_entropy(xp, y2, t, keep, n):
    """(value, dy) of the softmax cross entropy of logits y2 (N, C) at labels t, summed over
    the rows where `keep` (N,) is True and divided by n (cupy); 0 gradient on the others.
    n: a number, or a 0-d device array (the count of kept labels, not read back); value: a
    0-d device array (read it with float(), a wait for the device)."""
    c = y2.shape[1]
    y2 = xp.ascontiguousarray(y2)
    keep = xp.ascontiguousarray(keep)
    labels = xp.ascontiguousarray(xp.where(keep, t.reshape(-1), 0))
    m = y2.max(axis=-1, keepdims=True)
    logs = xp.log(kernels(xp)["sumexp"](y2, xp.broadcast_to(m, y2.shape), axis=-1,
                                        keepdims=True))
    rows = xp.arange(y2.shape[0])
    value = -xp.where(keep, (y2[rows, labels] - m[:, 0]) - logs[:, 0], 0).sum() / n
    g = xp.empty_like(y2)
    n = n.astype(y2.dtype) if hasattr(n, "astype") else y2.dtype.type(n)
    kernels(xp)["ce_grad"](y2, m, logs, labels, keep, c, n, g)
    return value, g

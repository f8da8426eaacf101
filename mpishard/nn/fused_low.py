"""The attention softmax read and written in 16 bits (cupy): no float32 copy of the scores.

Under a 16-bit compute_dtype on a device (nn/autocast.py `Narrow`) the scores' matmul
returns bfloat16 or float16 s^T (B, H, Tk, Tq), and the xp path then widened them to float32,
ran the softmax there and narrowed the probabilities again for the PV matmul: per layer and
step three (B, H, T, T) casts each way (the H200's bfloat16 profile: 51 ms of a 110 ms step
were such casts, 400 MB of float32 a layer at GPT-2-small size). These two kernels read the
16-bit scores where the GEMM wrote them, compute in float32 (each element widened exactly,
the same float32 operations as fused.py's float32 kernels) and write 16 bits in place:

    causal_softmax_t(s, offset)    s^T raw 16-bit scores -> 16-bit probabilities in place;
                                   returns lse (B, H, Tq) float32. Per query column i the keys
                                   j <= i + offset are visible; m = their max (0 if none or
                                   not finite), d = sum exp(s - m), p = exp(s - m) (1 / d)
                                   rounded to 16 bits (0 where hidden), lse = m + log d: the
                                   values fused.causal_softmax_t gives the widened scores,
                                   rounded as the PV matmul's input is.
    softmax_grad_t(s, ds, lse, offset)
                                   the softmax's backward from the recomputed 16-bit scores
                                   s^T and the 16-bit dp^T / sqrt Dh (the matmul's output),
                                   in place: p = exp(s - lse) in float32 (lse -inf read as
                                   0, 0 where hidden), row = sum_s p dp (the softmax's own
                                   row sums, autocast's), then s <- p and ds <- (dp - row) p,
                                   each rounded to 16 bits: the dv and dq, dk matmuls' inputs.

One thread per (b, h, query column), looping over the keys down a column of s^T: adjacent
threads read adjacent words, and each thread loads UNROLL keys at once (the H200 ran the
one-key-at-a-time loop at 1.2 ms a layer, 7x the time its bytes take: too few loads in
flight). What the float32 path keeps unrounded (the softmax's p, the row sums, ds before
rounding) stays float32 in registers; the values written are those the xp path rounds at
the next matmul. The sums (d, the row sum) run in UNROLL interleaved partial sums, where
cupy's reduction adds in a tree: equal to rounding, not bit for bit; the max is exact.

    round_in_place(y, dtype)       float32 y rounded to the 16-bit grid in place, one pass
                                   (autocast.Narrow.output's float32 matmul outputs: a
                                   weight's gradient, a biased product; astype there and back
                                   took two).

The bodies are cupy ElementwiseKernel code over `unsigned short` words, with a preamble that
defines ms16_ld (a word widened to float: exact) and ms16_st (a float narrowed, nearest even;
a NaN becomes the quiet NaN of its sign, as parallel/bf16.py and cuda_src.py round). PREAMBLE
holds the CUDA versions; tests/nn/test_fused_low.py compiles the same bodies with a C++
preamble on the host and runs them against the xp path, and tests/nn/test_nvrtc.py compiles
them to PTX.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .cuda_ops import OPTIONS

_BF16 = r"""
__device__ __forceinline__ float ms16_ld(unsigned short w) {
    return __uint_as_float(((unsigned int)w) << 16);
}
__device__ __forceinline__ unsigned short ms16_st(float v) {
    unsigned int u = __float_as_uint(v);
    return (unsigned short)(((u & 0x7FFFFFFFu) > 0x7F800000u)
                            ? (((u >> 16) & 0x8000u) | 0x7FC0u)
                            : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16));
}
"""
_F16 = r"""
__device__ __forceinline__ float ms16_ld(unsigned short w) {
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(w)); return f;
}
__device__ __forceinline__ unsigned short ms16_st(float v) {
    unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(v)); return h;
}
"""
PREAMBLE = {"bfloat16": _BF16, "float16": _F16}
"""The CUDA preamble of each 16-bit storage dtype, by dtype name."""

_COLUMN = """
const long long col = i % tq;                      // the query column of s^T
const long long base = (i / tq) * tk * tq + col;   // s^T[b, h, 0, col]
long long last = col + offset;                     // keys 0..last are visible
if (last > tk - 1) last = tk - 1;
"""

UNROLL = 8
"""Keys a thread loads at once: independent loads in flight (one thread per column leaves
~0.1 M threads at GPT-2-small size, too few to cover the memory's latency one load each)."""

_SOFTMAX = _COLUMN + """
float m = 0.0f;
if (last >= 0) {
    float mx[UNROLL];
    const float first = ms16_ld(s[base]);
    for (int u = 0; u < UNROLL; ++u) mx[u] = first;
    long long j = 0;
    for (; j + UNROLL - 1 <= last; j += UNROLL) {
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const float v = ms16_ld(s[base + (j + u) * tq]);
            if (v > mx[u]) mx[u] = v;
        }
    }
    for (; j <= last; ++j) { const float v = ms16_ld(s[base + j * tq]); if (v > mx[0]) mx[0] = v; }
    m = mx[0];
    for (int u = 1; u < UNROLL; ++u) if (mx[u] > m) m = mx[u];
    if (!isfinite(m)) m = 0.0f;
}
float dd[UNROLL];
for (int u = 0; u < UNROLL; ++u) dd[u] = 0.0f;
long long j = 0;
for (; j + UNROLL - 1 <= last; j += UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) dd[u] += exp(ms16_ld(s[base + (j + u) * tq]) - m);
}
for (; j <= last; ++j) dd[0] += exp(ms16_ld(s[base + j * tq]) - m);
float d = 0.0f;
for (int u = 0; u < UNROLL; ++u) d += dd[u];
const float inv = 1.0f / (d > 0.0f ? d : 1.0f);
#pragma unroll 8
for (j = 0; j <= last; ++j) {
    const long long at = base + j * tq;
    s[at] = ms16_st(exp(ms16_ld(s[at]) - m) * inv);
}
for (; j < tk; ++j) s[base + j * tq] = ms16_st(0.0f);
lse = m + log(d);
""".replace("UNROLL", str(UNROLL))

_SOFTMAX_GRAD = _COLUMN + """
const float l = isfinite(lse) ? lse : 0.0f;
float rr[UNROLL];
for (int u = 0; u < UNROLL; ++u) rr[u] = 0.0f;
long long j = 0;
for (; j + UNROLL - 1 <= last; j += UNROLL) {
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const long long at = base + (j + u) * tq;
        rr[u] += ms16_ld(ds[at]) * exp(ms16_ld(s[at]) - l);
    }
}
for (; j <= last; ++j) {
    const long long at = base + j * tq;
    rr[0] += ms16_ld(ds[at]) * exp(ms16_ld(s[at]) - l);
}
float row = 0.0f;
for (int u = 0; u < UNROLL; ++u) row += rr[u];
#pragma unroll 8
for (j = 0; j <= last; ++j) {
    const long long at = base + j * tq;
    const float p = exp(ms16_ld(s[at]) - l);
    const float g = (ms16_ld(ds[at]) - row) * p;
    s[at] = ms16_st(p);
    ds[at] = ms16_st(g);
}
for (; j < tk; ++j) {                              // hidden: p = 0, ds = (dp - row) 0
    const long long at = base + j * tq;
    const float g = (ms16_ld(ds[at]) - row) * 0.0f;
    s[at] = ms16_st(0.0f);
    ds[at] = ms16_st(g);
}
""".replace("UNROLL", str(UNROLL))

_ROUND = "y = ms16_ld(ms16_st(x))"

ELEMENTWISE = {
    "softmax_t": ("int64 tk, int64 tq, int64 offset", "raw uint16 s, float32 lse", _SOFTMAX,
                  "mpishard_causal_softmax16_t"),
    "softmax_grad_t": ("int64 tk, int64 tq, int64 offset, float32 lse",
                       "raw uint16 s, raw uint16 ds", _SOFTMAX_GRAD,
                       "mpishard_softmax16_grad_t"),
    "round": ("float32 x", "float32 y", _ROUND, "mpishard_round16_f32"),
}
"""The ElementwiseKernels by name: (in params, out params, body, kernel name); each runs with
PREAMBLE[dtype] before it."""


@lru_cache(maxsize=None)
def kernels(cupy, dtype_name: str) -> dict:
    """The kernels for one 16-bit storage dtype, by name (kernel code, no state)."""
    return {name: cupy.ElementwiseKernel(*spec, preamble=PREAMBLE[dtype_name], options=OPTIONS)
            for name, spec in ELEMENTWISE.items()}


def _words(s, what):
    if not s.flags.c_contiguous:
        raise ValueError(f"fused_low: {what} must be C-contiguous")
    return s.view(np.uint16)


def _offset(tk, offset):
    return tk if offset is None else int(offset)


def causal_softmax_t(xp, s, offset):
    """s^T (B, H, Tk, Tq), 16-bit raw scores, C-contiguous -> 16-bit probabilities in place;
    returns lse (B, H, Tq) float32. offset None: every key visible."""
    tk, tq = s.shape[-2:]
    lse = xp.empty(s.shape[:-2] + (tq,), dtype=np.float32)
    kernels(xp, s.dtype.name)["softmax_t"](tk, tq, _offset(tk, offset), _words(s, "s"), lse)
    return lse


def softmax_grad_t(xp, s, ds, lse, offset):
    """In place: s (16-bit raw scores s^T) -> 16-bit p^T, ds (16-bit dp^T / sqrt Dh) ->
    16-bit ds^T / sqrt Dh = (dp - sum_s p dp) p; lse (B, H, Tq) the forward's."""
    tk, tq = s.shape[-2:]
    if ds.shape != s.shape or ds.dtype != s.dtype:
        raise ValueError(f"fused_low: ds {ds.shape} {ds.dtype} is not like s {s.shape} {s.dtype}")
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    kernels(xp, s.dtype.name)["softmax_grad_t"](tk, tq, _offset(tk, offset), lse,
                                                _words(s, "s"), _words(ds, "ds"))
    return s, ds


def round_in_place(xp, y, dtype):
    """float32 y (any layout) rounded to the grid of the 16-bit `dtype` in place; returns y."""
    kernels(xp, np.dtype(dtype).name)["round"](y, y)
    return y

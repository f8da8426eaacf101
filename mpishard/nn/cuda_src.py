"""CUDA C sources of the hand-written kernels (cupy.RawModule), one module for all of them.

Each kernel is a C++ template over the storage type S of its activations, instantiated as
`extern "C"` entry points named `mpishard_<kernel>_<suffix>`:

    suffix   S (storage)                          A (arithmetic and statistics)
    f64      double                               double
    f32      float                                float
    bf16     bfloat16 as its raw 16-bit word      float
    f16      IEEE half as its raw 16-bit word     float

16-bit values travel as their words (a struct of one unsigned short), so no CUDA header is
needed (NVRTC compiles this module as it stands): a bf16 word widens exactly as the upper
half of a float32 and narrows with parallel/bf16.py's rounding (nearest, ties to even; a
NaN becomes the quiet NaN of its sign); a half converts with PTX's cvt (round to nearest).
Statistics (LayerNorm's mean and rstd, RMSNorm's rstd, the norms' per-block column sums)
are A-typed arrays: float32 for every 16-bit input, as autocast keeps them.

Reductions over a row run in one block of MS_BLOCK threads: thread t sums columns t,
t + MS_BLOCK, ... in order, a butterfly of warp shuffles adds the lanes, and every thread adds
the warps' partials in warp order, so the result is the same on every thread and on every run
(tests/cuda_mirror.py mirrors this order in numpy). Compiled without FMA contraction
(cuda_ops.OPTIONS), so each product and sum rounds as the xp op's does.

The norms' kernels are in cuda_norms_src.py, attention's in cuda_attention_src.py, the
cross entropy's in cuda_loss_src.py; here the
header, bias+GELU, SwiGLU, the residual add, the embedding backward, the multi-tensor AdamW,
and the instantiation of them all.
"""
from __future__ import annotations

import math
import re

from . import cuda_attention_src as attention
from . import cuda_loss_src as loss
from . import cuda_norms_src as norms

BLOCK = 256        # threads per block of every kernel here (a multiple of the warp, 32)

SUFFIXES = {"f64": "double", "f32": "float", "bf16": "ms_bf16", "f16": "ms_f16"}

_HEADER = r"""
#define MS_BLOCK %(block)d
typedef long long i64;
struct ms_bf16 { unsigned short w; };
struct ms_f16 { unsigned short w; };
template <typename S> struct ms_acc { typedef float T; };
template <> struct ms_acc<double> { typedef double T; };

__device__ __forceinline__ double ms_ld(const double* p, i64 i) { return p[i]; }
__device__ __forceinline__ float ms_ld(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float ms_ld(const ms_bf16* p, i64 i) {
    return __uint_as_float(((unsigned int)p[i].w) << 16);
}
__device__ __forceinline__ float ms_ld(const ms_f16* p, i64 i) {
    float f; asm("cvt.f32.f16 %%0, %%1;" : "=f"(f) : "h"(p[i].w)); return f;
}
__device__ __forceinline__ void ms_st(double* p, i64 i, double v) { p[i] = v; }
__device__ __forceinline__ void ms_st(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void ms_st(ms_bf16* p, i64 i, float v) {
    unsigned int u = __float_as_uint(v);
    p[i].w = (unsigned short)(((u & 0x7FFFFFFFu) > 0x7F800000u)
                              ? (((u >> 16) & 0x8000u) | 0x7FC0u)
                              : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16));
}
__device__ __forceinline__ void ms_st(ms_f16* p, i64 i, float v) {
    unsigned short h; asm("cvt.rn.f16.f32 %%0, %%1;" : "=h"(h) : "f"(v)); p[i].w = h;
}

// The sum of v over the block, the same value on every thread (see the module docstring).
template <typename A> __device__ A ms_block_sum(A v) {
    __shared__ A part[MS_BLOCK / 32];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();                              // part may still be read by a previous call
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    A t = part[0];
    for (int w = 1; w < MS_BLOCK / 32; ++w) t += part[w];
    return t;
}
""" % {"block": BLOCK}

_POINTWISE = r"""
// The tanh GELU of pointwise.gelu_forward, its steps in its order: (y, dy/dz) of z.
template <typename A> __device__ void ms_gelu(A z, A& y, A& dydz) {
    A s = z * z;
    A h = s * (A)%(a)s;
    h += (A)%(c)s;
    h *= z;
    h = tanh(h);
    h += (A)1;
    h *= (A)0.5;
    s *= (A)%(b)s;
    s += (A)%(c2)s;
    s *= z;
    s *= (A)1 - h;
    s += (A)1;
    y = z * h;
    dydz = h * s;
}

// u = z + bias (bias of length f along the last axis; none when bias is null), y = gelu(u);
// u is kept for the backward, which recomputes dy/du from it.
template <typename S> __device__ void bias_gelu_fwd(const S* z, const S* bias, S* u, S* y,
                                                    i64 n, i64 f) {
    typedef typename ms_acc<S>::T A;
    for (i64 i = blockIdx.x * (i64)MS_BLOCK + threadIdx.x; i < n; i += (i64)gridDim.x * MS_BLOCK) {
        A v = ms_ld(z, i);
        if (bias) v += ms_ld(bias, i %% f);
        if (bias) ms_st(u, i, v);
        A g, dg;
        ms_gelu(v, g, dg);
        ms_st(y, i, g);
    }
}

template <typename S> __device__ void gelu_bwd(const S* dy, const S* u, S* du, i64 n) {
    typedef typename ms_acc<S>::T A;
    for (i64 i = blockIdx.x * (i64)MS_BLOCK + threadIdx.x; i < n; i += (i64)gridDim.x * MS_BLOCK) {
        A g, dg;
        ms_gelu(ms_ld(u, i), g, dg);
        ms_st(du, i, ms_ld(dy, i) * dg);
    }
}

// a (rows, 2 f) = gate | up -> y (rows, f) = silu(gate) up, sigmoid(g) = (tanh(g / 2) + 1) / 2.
template <typename S> __device__ void swiglu_fwd(const S* a, S* y, i64 rows, i64 f) {
    typedef typename ms_acc<S>::T A;
    for (i64 i = blockIdx.x * (i64)MS_BLOCK + threadIdx.x; i < rows * f;
         i += (i64)gridDim.x * MS_BLOCK) {
        const i64 r = i / f, at = r * 2 * f + (i - r * f);
        const A g = ms_ld(a, at), s = (A)0.5 * (tanh((A)0.5 * g) + (A)1);
        ms_st(y, i, (g * s) * ms_ld(a, at + f));
    }
}

// da (rows, 2 f): dgate = dy up s (1 + g (1 - s)), dup = dy silu(g), s recomputed from a.
template <typename S> __device__ void swiglu_bwd(const S* dy, const S* a, S* da, i64 rows, i64 f) {
    typedef typename ms_acc<S>::T A;
    for (i64 i = blockIdx.x * (i64)MS_BLOCK + threadIdx.x; i < rows * f;
         i += (i64)gridDim.x * MS_BLOCK) {
        const i64 r = i / f, at = r * 2 * f + (i - r * f);
        const A g = ms_ld(a, at), u = ms_ld(a, at + f), d = ms_ld(dy, i);
        const A s = (A)0.5 * (tanh((A)0.5 * g) + (A)1);
        ms_st(da, at + f, d * (g * s));
        A slope = (A)1 - s;
        slope *= g;
        slope += (A)1;
        slope *= s;
        ms_st(da, at, (d * u) * slope);
    }
}

// h += branch: the residual stream h (A) plus a branch stored as S, one pass.
template <typename S> __device__ void residual_add(typename ms_acc<S>::T* h, const S* branch,
                                                   i64 n) {
    for (i64 i = blockIdx.x * (i64)MS_BLOCK + threadIdx.x; i < n; i += (i64)gridDim.x * MS_BLOCK)
        h[i] += ms_ld(branch, i);
}

// Embedding backward, deterministic: the rows of dy sorted by id (order), run k of equal ids
// from starts[k] to starts[k + 1] (starts[runs] = n); block k sums its run's rows in order
// (float32 for 16-bit dy) into table row ids[k] of g.
template <typename S> __device__ void embedding_bwd(const S* dy, const i64* order,
                                                    const i64* starts, const i64* ids, S* g,
                                                    i64 runs, i64 d) {
    typedef typename ms_acc<S>::T A;
    for (i64 k = blockIdx.x; k < runs; k += gridDim.x)
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) {
            A s = 0;
            for (i64 j = starts[k]; j < starts[k + 1]; ++j) s += ms_ld(dy, order[j] * d + c);
            ms_st(g, ids[k] * d + c, s);
        }
}
"""

_ADAMW = r"""
// AdamW over many tensors in one launch (train/optim.py's AdamW.update, element by element):
// tensor k has its p, g, m, v addresses at table[4 k .. 4 k + 3], size[k] elements, and its
// own bias corrections hyper[2 k] = lr / (1 - b1^t), hyper[2 k + 1] = sqrt(1 - b2^t); block
// b updates elements chunk_start[b] .. + chunk of tensor chunk_tensor[b].
template <typename A> __device__ void adamw(
        const unsigned long long* table, const i64* size, const A* hyper,
        const i64* chunk_tensor, const i64* chunk_start, i64 chunk, A decay, A one_minus_b1,
        A b2, A one_minus_b2, A eps) {
    const i64 k = chunk_tensor[blockIdx.x], lo = chunk_start[blockIdx.x];
    A* p = (A*)table[4 * k];
    const A* g = (const A*)table[4 * k + 1];
    A* m = (A*)table[4 * k + 2];
    A* v = (A*)table[4 * k + 3];
    const A step_size = hyper[2 * k], bc2 = hyper[2 * k + 1];
    i64 hi = lo + chunk;
    if (hi > size[k]) hi = size[k];
    for (i64 i = lo + threadIdx.x; i < hi; i += MS_BLOCK) {
        const A gi = g[i];
        A pi = p[i] * decay;
        A mi = m[i];
        mi += one_minus_b1 * (gi - mi);
        A vi = v[i] * b2;
        vi += one_minus_b2 * (gi * gi);
        const A denom = sqrt(vi) / bc2 + eps;
        pi -= step_size * (mi / denom);
        p[i] = pi; m[i] = mi; v[i] = vi;
    }
}
"""

_ENTRIES = {
    **norms.ENTRIES,
    "bias_gelu_fwd": ("const S* z, const S* bias, S* u, S* y, i64 n, i64 f",
                      "z, bias, u, y, n, f"),
    "gelu_bwd": ("const S* dy, const S* u, S* du, i64 n", "dy, u, du, n"),
    "swiglu_fwd": ("const S* a, S* y, i64 rows, i64 f", "a, y, rows, f"),
    "swiglu_bwd": ("const S* dy, const S* a, S* da, i64 rows, i64 f", "dy, a, da, rows, f"),
    "residual_add": ("A* h, const S* branch, i64 n", "h, branch, n"),
    "embedding_bwd": ("const S* dy, const i64* order, const i64* starts, const i64* ids, S* g, "
                      "i64 runs, i64 d", "dy, order, starts, ids, g, runs, d"),
    **attention.ENTRIES,
    **loss.ENTRIES,
}
_ADAMW_ARGS = ("const unsigned long long* table, const i64* size, const A* hyper, "
               "const i64* chunk_tensor, const i64* chunk_start, i64 chunk, A decay, "
               "A one_minus_b1, A b2, A one_minus_b2, A eps")
_ADAMW_CALL = ("table, size, hyper, chunk_tensor, chunk_start, chunk, decay, one_minus_b1, b2, "
               "one_minus_b2, eps")


def _gelu_constants() -> dict:
    """The constants of pointwise.gelu_forward, as C literals."""
    c = math.sqrt(2.0 / math.pi)
    return {"a": repr(0.044715 * c), "c": repr(c), "b": repr(6 * 0.044715 * c),
            "c2": repr(2 * c)}


def entry_name(kernel: str, suffix: str) -> str:
    """The extern "C" name of `kernel` for storage `suffix` (f64, f32, bf16, f16)."""
    return f"mpishard_{kernel}_{suffix}"


def _instances() -> str:
    out = []
    for kernel, (params, call) in _ENTRIES.items():
        for suffix, s in SUFFIXES.items():
            sig = re.sub(r"\bA\b", "double" if s == "double" else "float",
                         re.sub(r"\bS\b", s, params))
            out.append(f'extern "C" __global__ void {entry_name(kernel, suffix)}({sig}) '
                       f'{{ {kernel}<{s}>({call}); }}')
    for suffix, a in (("f64", "double"), ("f32", "float")):
        sig = re.sub(r"\bA\b", a, _ADAMW_ARGS)
        out.append(f'extern "C" __global__ void {entry_name("adamw", suffix)}({sig}) '
                   f'{{ adamw<{a}>({_ADAMW_CALL}); }}')
    return "\n".join(out) + "\n"


SOURCE = (_HEADER + norms.SOURCE + (_POINTWISE % _gelu_constants()) + _ADAMW + attention.SOURCE
          + loss.SOURCE + _instances())
"""The whole module: every kernel of cuda_ops, for every storage type."""

ENTRIES = tuple(entry_name(k, s) for k in _ENTRIES for s in SUFFIXES) + tuple(
    entry_name("adamw", s) for s in ("f64", "f32"))
"""Every extern "C" name SOURCE defines."""

"""The attention softmax read and written in 16 bits (cupy): no float32 copy of the scores.

Under a 16-bit compute_dtype on a device (nn/autocast.py `Narrow`) the scores' matmul
returns bfloat16 or float16 s^T (B, H, Tk, Tq), and the xp path then widened them to float32,
ran the softmax there and narrowed the probabilities again for the PV matmul: per layer and
step three (B, H, T, T) casts each way (the H200's bfloat16 profile: 51 ms of a 110 ms step
were such casts, 400 MB of float32 a layer at GPT-2-small size). These two kernels read the
16-bit scores where the GEMM wrote them, compute in float32 (each element widened exactly,
fused.py's float32 operations but for the order of the sums) and write 16 bits in place:

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

Each runs as three launches, so that the work spreads over many threads: the statistics
of each chunk of CHUNK keys of each query column (its max and sum, or its share of the row
sum; one thread each), then each column's (one thread each, over its chunks), then every
element on its own thread (coalesced: adjacent threads, adjacent words; a hidden element
written without being read). One thread per column walking all its keys, the first design,
ran at 0.9-1.2 ms a layer on the H200, 7x the time its bytes take: a chain of ~1000
dependent loads per thread and too few threads to hide them. What the float32 path keeps
unrounded (the softmax's p, the statistics, ds before rounding) stays float32; the values
written are those the xp path rounds at the next matmul. The sums (d, the row sum) add per
chunk, then the chunks (d's rescaled by exp(m_chunk - m)), where cupy's reduction adds in a
tree: equal to rounding, not bit for bit; the max is exact. On the H200 (GPT-2-small
size, bfloat16) the three launches took ~1.5 ms a layer for both directions, against 1.9
ms for one thread per column; most of it is the per-element launch (0.62 and 0.75 ms, ~5x
its bytes' time), whose index arithmetic, two 64-bit divisions an element then, now runs in
32 bits for arrays under INDEX32 elements (run on the H200 since: docs/gpus.md). Where
cuDNN's flash attention runs (nn/cudnn_attention.py) these two are not called.

    round_in_place(y, dtype)       float32 y rounded to the 16-bit grid in place, one pass
                                   (autocast.Narrow.output's float32 matmul outputs: a
                                   weight's gradient, a row-parallel layer's biased sum;
                                   astype there and back took two).
    add_bias_round(y, b)           float32 y (…, F) <- round16(y + b) in place, b (F,) 16-bit:
                                   a linear layer's product and bias in one pass
                                   (autocast.Narrow.linear_output), not an add and a round.
    add_bias_narrow(y, b)          round16(y + b) as a new 16-bit array: the same pass written
                                   in 16 bits, for a unit that reads them (the GPT MLP's
                                   GELU: autocast.Narrow.linear_kept).

The bodies are cupy ElementwiseKernel code over `unsigned short` words, with a preamble that
defines ms16_ld (a word widened to float: exact) and ms16_st (a float narrowed, nearest even,
a NaN stays a NaN; bfloat16 as parallel/bf16.py and cuda_src.py round, float16 by PTX's
cvt). PREAMBLE holds the CUDA versions; tests/nn/test_fused_low.py compiles the same
bodies with a C++ preamble on the host and runs them against the xp path, and
tests/nn/test_nvrtc.py compiles them to PTX.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from .cuda_ops import OPTIONS

BF16_TO_WORDS = """
unsigned int u = __float_as_uint(x);
w = (unsigned short)(((u & 0x7FFFFFFFu) > 0x7F800000u)
                     ? (((u >> 16) & 0x8000u) | 0x7FC0u)
                     : ((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16));
"""
"""float32 x -> its bfloat16 word w (nearest even; a NaN becomes the quiet NaN of its sign):
a CUDA statement list, also parallel/bf16.py's kernel body."""
BF16_TO_FLOAT32 = "x = __uint_as_float(((unsigned int)w) << 16);"
"""A bfloat16 word w -> float32 x, exactly (also parallel/bf16.py's kernel body)."""



def bf16_helpers(qualifier: str) -> str:
    """ms16_ld and ms16_st of bfloat16 words, each function declared `qualifier`: the device
    preamble's, and (with host definitions of __float_as_uint and __uint_as_float)
    tests/nn/host_kernels.py's, so both run the same rounding text."""
    return (f"{qualifier} float ms16_ld(unsigned short w) {{\nfloat x;\n{BF16_TO_FLOAT32}\n"
            f"return x;\n}}\n{qualifier} unsigned short ms16_st(float x) {{\n"
            f"unsigned short w;{BF16_TO_WORDS}return w;\n}}\n")


_BF16 = bf16_helpers("__device__ __forceinline__")
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

CHUNK = 64
"""Keys per thread in the statistics kernels: a column's keys are cut into chunks of CHUNK,
each walked by its own thread, so ~1.5 M threads share the work at GPT-2-small size (one
thread per column, ~0.1 M, ran 0.9-1.0 ms a layer on the H200: a chain of ~1000 dependent
loads per thread, 7x the time its bytes take)."""

_VISIBLE = """
long long last = col + offset;                     // keys 0..last are visible to col
if (last > tk - 1) last = tk - 1;
"""

_CHUNK = """
const long long col = i % tq;                      // thread (g, c, col): chunk c of column
const long long c = (i / tq) % nc;                 // col of s^T[g] (keys down, queries
const long long g = i / (tq * nc);                 // across)
const long long base = g * tk * tq + col;
""" + _VISIBLE + """
const long long j0 = c * CHUNK;
long long j1 = j0 + CHUNK - 1;
if (j1 > last) j1 = last;
"""

_COLUMN = """
const long long col = i % tq;                      // thread (g, col): one query column
const long long g = i / tq;
const long long at0 = g * nc * tq + col;           // its chunk 0 in a (G, nc, tq) array
""" + _VISIBLE + """
const long long chunks = last >= 0 ? last / CHUNK + 1 : 0;   // the chunks with a visible key
"""
_CHUNK, _COLUMN = (src.replace("CHUNK", str(CHUNK)) for src in (_CHUNK, _COLUMN))

INDEX32 = 1 << 32
"""Arrays of fewer elements than this run the per-element kernels' index arithmetic in 32
bits (the "32" variants): two divisions per element, each a long routine in 64 bits."""

_ELEMENT = """
const IDX q = (IDX)i / (IDX)tq;                    // thread (g, j, col): one element of s^T,
const IDX c32 = (IDX)i - q * (IDX)tq;              // row q = g tk + j of the (G tk, tq) view
const IDX g32 = q / (IDX)tk;
const long long col = (long long)c32;
const long long j = (long long)(q - g32 * (IDX)tk);
const long long stat = (long long)g32 * tq + col;  // its column's statistics
""" + _VISIBLE

_SOFTMAX_STATS = _CHUNK + """
float mc = 0.0f, dc = 0.0f;
if (j0 <= j1) {
    mc = ms16_ld(s[base + j0 * tq]);
#pragma unroll 8
    for (long long j = j0 + 1; j <= j1; ++j) {
        const float v = ms16_ld(s[base + j * tq]);
        if (v > mc) mc = v;
    }
    const float mz = isfinite(mc) ? mc : 0.0f;
#pragma unroll 8
    for (long long j = j0; j <= j1; ++j) dc += exp(ms16_ld(s[base + j * tq]) - mz);
}
m = mc;
d = dc;
"""

_SOFTMAX_COMBINE = _COLUMN + """
float mm = 0.0f;
if (chunks > 0) {
    mm = m[at0];
    for (long long c = 1; c < chunks; ++c) { const float v = m[at0 + c * tq]; if (v > mm) mm = v; }
    if (!isfinite(mm)) mm = 0.0f;
}
float dd = 0.0f;
for (long long c = 0; c < chunks; ++c) {            // a chunk of -inf scores adds nothing
    const float v = m[at0 + c * tq], dc = d[at0 + c * tq];   // (not 0 exp(0 - mm): NaN when
    if (dc != 0.0f) dd += dc * exp((isfinite(v) ? v : 0.0f) - mm);   // mm < -88)
}
mx = mm;
inv = 1.0f / (dd > 0.0f ? dd : 1.0f);
lse = mm + log(dd);
"""

_SOFTMAX_WRITE = _ELEMENT + """
s = ms16_st(j <= last ? exp(ms16_ld(s) - mx[stat]) * inv[stat] : 0.0f);
"""

_GRAD_STATS = _CHUNK + """
const float l = isfinite(lse[g * tq + col]) ? lse[g * tq + col] : 0.0f;
float rc = 0.0f;
#pragma unroll 8
for (long long j = j0; j <= j1; ++j) {
    const long long at = base + j * tq;
    rc += ms16_ld(ds[at]) * exp(ms16_ld(s[at]) - l);
}
r = rc;
"""

_GRAD_COMBINE = _COLUMN + """
float rr = 0.0f;
for (long long c = 0; c < chunks; ++c) rr += r[at0 + c * tq];
row = rr;
"""

_GRAD_WRITE = _ELEMENT + """
const float l = isfinite(lse[stat]) ? lse[stat] : 0.0f;
const float p = j <= last ? exp(ms16_ld(s) - l) : 0.0f;   // hidden: p = 0, ds = (dp - row) 0
const float gr = (ms16_ld(ds) - row[stat]) * p;
s = ms16_st(p);
ds = ms16_st(gr);
"""

_SHAPE = "int64 tk, int64 tq, int64 offset"

_ROUND = "y = ms16_ld(ms16_st(x))"

_BIAS_ROUND = """
const IDX col = (IDX)i % (IDX)f;                   // y (rows, f) C-ordered: its column
y = ms16_ld(ms16_st(y + ms16_ld(b[col])));
"""

_BIAS_NARROW = """
const IDX col = (IDX)i % (IDX)f;                   // y (rows, f) C-ordered: its column
z = ms16_st(y + ms16_ld(b[col]));
"""

ELEMENTWISE = {
    "softmax_stats": (f"raw uint16 s, {_SHAPE}, int64 nc", "float32 m, float32 d",
                      _SOFTMAX_STATS, "mpishard_softmax16_stats"),
    "softmax_combine": (f"raw float32 m, raw float32 d, {_SHAPE}, int64 nc",
                        "float32 mx, float32 inv, float32 lse", _SOFTMAX_COMBINE,
                        "mpishard_softmax16_combine"),
    "softmax_write": (f"raw float32 mx, raw float32 inv, {_SHAPE}", "uint16 s", _SOFTMAX_WRITE,
                      "mpishard_softmax16_write"),
    "grad_stats": (f"raw uint16 s, raw uint16 ds, raw float32 lse, {_SHAPE}, int64 nc",
                   "float32 r", _GRAD_STATS, "mpishard_softmax16_grad_stats"),
    "grad_combine": (f"raw float32 r, {_SHAPE}, int64 nc", "float32 row", _GRAD_COMBINE,
                     "mpishard_softmax16_grad_combine"),
    "grad_write": (f"raw float32 lse, raw float32 row, {_SHAPE}", "uint16 s, uint16 ds",
                   _GRAD_WRITE, "mpishard_softmax16_grad_write"),
    "round": ("float32 x", "float32 y", _ROUND, "mpishard_round16_f32"),
    "bias_round": ("raw uint16 b, int64 f", "float32 y", _BIAS_ROUND,
                   "mpishard_bias_round16"),
    "bias_narrow": ("float32 y, raw uint16 b, int64 f", "uint16 z", _BIAS_NARROW,
                    "mpishard_bias_narrow16"),
}
for _name in ("softmax_write", "grad_write", "bias_round", "bias_narrow"):   # 64-, 32-bit index
    _in, _out, _body, _entry = ELEMENTWISE[_name]
    ELEMENTWISE[_name] = (_in, _out, "typedef long long IDX;" + _body, _entry)
    ELEMENTWISE[_name + "32"] = (_in, _out, "typedef unsigned int IDX;" + _body, _entry + "32")
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


def _shape(s, offset):
    """(tk, tq, the offset as the kernels take it, chunks per column) of s^T."""
    tk, tq = s.shape[-2:]
    return tk, tq, tk if offset is None else int(offset), -(-tk // CHUNK)


def _index(s) -> str:
    """The per-element kernels' variant for s: "32" (32-bit index arithmetic) or ""."""
    return "32" if s.size < INDEX32 else ""


def causal_softmax_t(xp, s, offset):
    """s^T (B, H, Tk, Tq), 16-bit raw scores, C-contiguous -> 16-bit probabilities in place;
    returns lse (B, H, Tq) float32. offset None: every key visible. Three launches: each
    chunk's max and sum, each column's (the max m, 1 / d, lse), then every element."""
    tk, tq, off, nc = _shape(s, offset)
    k = kernels(xp, s.dtype.name)
    words = _words(s, "s")
    m = xp.empty(s.shape[:-2] + (nc, tq), dtype=np.float32)
    d = xp.empty_like(m)
    k["softmax_stats"](words, tk, tq, off, nc, m, d)
    mx, inv, lse = (xp.empty(s.shape[:-2] + (tq,), dtype=np.float32) for _ in range(3))
    k["softmax_combine"](m, d, tk, tq, off, nc, mx, inv, lse)
    k["softmax_write" + _index(s)](mx, inv, tk, tq, off, words)
    return lse


def softmax_grad_t(xp, s, ds, lse, offset):
    """In place: s (16-bit raw scores s^T) -> 16-bit p^T, ds (16-bit dp^T / sqrt Dh) ->
    16-bit ds^T / sqrt Dh = (dp - sum_s p dp) p; lse (B, H, Tq) the forward's. Three launches:
    each chunk's share of the row sums, each column's row sum, then every element."""
    if ds.shape != s.shape or ds.dtype != s.dtype:
        raise ValueError(f"fused_low: ds {ds.shape} {ds.dtype} is not like s {s.shape} {s.dtype}")
    tk, tq, off, nc = _shape(s, offset)
    k = kernels(xp, s.dtype.name)
    words, dwords = _words(s, "s"), _words(ds, "ds")
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    r = xp.empty(s.shape[:-2] + (nc, tq), dtype=np.float32)
    k["grad_stats"](words, dwords, lse, tk, tq, off, nc, r)
    row = xp.empty(s.shape[:-2] + (tq,), dtype=np.float32)
    k["grad_combine"](r, tk, tq, off, nc, row)
    k["grad_write" + _index(s)](lse, row, tk, tq, off, words, dwords)
    return s, ds


def round_in_place(xp, y, dtype):
    """float32 y (any layout) rounded to the grid of the 16-bit `dtype` in place; returns y."""
    kernels(xp, np.dtype(dtype).name)["round"](y, y)
    return y


def add_bias_round(xp, y, b):
    """float32 y (…, F), C-contiguous, <- y + b rounded to the grid of b's 16-bit dtype, in
    place, one pass (a linear layer's float32 product, its rounded bias b (F,) added before
    the one rounding, as autocast's addmm does); returns y."""
    if not y.flags.c_contiguous or y.shape[-1:] != b.shape:
        raise ValueError(f"fused_low: bias {b.shape} does not fit a C-ordered {y.shape}")
    k = kernels(xp, b.dtype.name)["bias_round" + ("32" if y.size < INDEX32 else "")]
    k(_words(xp.ascontiguousarray(b), "b"), b.shape[0], y)
    return y


def add_bias_narrow(xp, y, b):
    """round16(y + b), a new array of b's 16-bit dtype: add_bias_round's one pass, written
    in 16 bits (a product whose next unit reads 16 bits: autocast.Narrow.linear_kept)."""
    if not y.flags.c_contiguous or y.shape[-1:] != b.shape:
        raise ValueError(f"fused_low: bias {b.shape} does not fit a C-ordered {y.shape}")
    z = xp.empty(y.shape, dtype=b.dtype)
    k = kernels(xp, b.dtype.name)["bias_narrow" + ("32" if y.size < INDEX32 else "")]
    k(y, _words(xp.ascontiguousarray(b), "b"), b.shape[0], _words(z, "z"))
    return z

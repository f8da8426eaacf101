"""CUDA C of the flash-style attention kernels (part of cuda_src.SOURCE: its header, storage
types and instantiation).

One warp per query row (forward, dq) or per key row (dk, dv), head dim up to 128 (4 values per
lane); scores are never stored: each is a warp-shuffle dot product used at once. The softmax
is online (the running max m and sum l rescaled as each key comes), statistics in A (float32
for 16-bit storage). The mask is nn/attention.py's causal_mask: query i sees key j iff
j <= i + offset (offset tk: every key). The arithmetic follows attention_block and
attention_block_backward: q (and dout) scaled by 1/sqrt(Dh) before the products, a row that
sees no key gets out 0 and lse -inf, the backward's p = exp(s - lse) with lse -inf read as 0,
ds = (dp / sqrt(Dh) - sum_d dout out / sqrt(Dh)) p, dq = ds k, dk = ds q, dv = p dout.
"""
from __future__ import annotations

MAX_DH = 128

SOURCE = r"""
template <typename A> __device__ A ms_neg_inf();
template <> __device__ float ms_neg_inf<float>() { return __int_as_float(0xff800000); }
template <> __device__ double ms_neg_inf<double>() {
    return __longlong_as_double((long long)0xfff0000000000000ULL);
}

template <typename A> __device__ __forceinline__ A ms_warp_sum(A v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

#define MS_PER_LANE 4
#define MS_LANES for (int jj = 0; jj < MS_PER_LANE; ++jj)

// Forward: warp w = (g, i) of bh * tq; out (bh, tq, dh) and lse (bh, tq).
template <typename S> __device__ void attention_fwd(
        const S* q, const S* k, const S* v, S* out, typename ms_acc<S>::T* lse, i64 bh,
        i64 tq, i64 tk, i64 dh, i64 offset, typename ms_acc<S>::T scale) {
    typedef typename ms_acc<S>::T A;
    const i64 w = (blockIdx.x * (i64)MS_BLOCK + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= bh * tq) return;                           // the whole warp: w is the warp's
    const i64 g = w / tq, i = w - g * tq;
    const S* kg = k + g * tk * dh;
    const S* vg = v + g * tk * dh;
    A qs[MS_PER_LANE], o[MS_PER_LANE];
    MS_LANES { const i64 d = lane + 32 * jj; qs[jj] = d < dh ? ms_ld(q, w * dh + d) * scale : 0;
               o[jj] = 0; }
    i64 last = i + offset;
    if (last > tk - 1) last = tk - 1;
    A m = ms_neg_inf<A>(), l = 0;
    for (i64 j = 0; j <= last; ++j) {
        A s = 0;
        MS_LANES { const i64 d = lane + 32 * jj; if (d < dh) s += ms_ld(kg, j * dh + d) * qs[jj]; }
        s = ms_warp_sum(s);
        const A mn = s > m ? s : m;
        const A corr = exp(m - mn), e = exp(s - mn);
        l = l * corr + e;
        MS_LANES { const i64 d = lane + 32 * jj;
                   if (d < dh) o[jj] = o[jj] * corr + e * ms_ld(vg, j * dh + d); }
        m = mn;
    }
    const A inv = (A)1 / (l > 0 ? l : (A)1);
    MS_LANES { const i64 d = lane + 32 * jj; if (d < dh) ms_st(out, w * dh + d, o[jj] * inv); }
    if (lane == 0) lse[w] = l > 0 ? m + log(l) : ms_neg_inf<A>();
}

// Backward, queries: dq (bh, tq, dh) and row[w] = sum_d dout out / sqrt(dh) for dkv.
template <typename S> __device__ void attention_bwd_dq(
        const S* q, const S* k, const S* v, const S* out, const S* dout,
        const typename ms_acc<S>::T* lse, S* dq, typename ms_acc<S>::T* row, i64 bh, i64 tq,
        i64 tk, i64 dh, i64 offset, typename ms_acc<S>::T scale) {
    typedef typename ms_acc<S>::T A;
    const i64 w = (blockIdx.x * (i64)MS_BLOCK + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= bh * tq) return;
    const i64 g = w / tq, i = w - g * tq;
    const S* kg = k + g * tk * dh;
    const S* vg = v + g * tk * dh;
    A qs[MS_PER_LANE], ds_[MS_PER_LANE], acc[MS_PER_LANE], r = 0;
    MS_LANES { const i64 d = lane + 32 * jj; const bool in = d < dh;
               qs[jj] = in ? ms_ld(q, w * dh + d) * scale : 0;
               ds_[jj] = in ? ms_ld(dout, w * dh + d) * scale : 0; acc[jj] = 0;
               if (in) r += ms_ld(dout, w * dh + d) * ms_ld(out, w * dh + d); }
    r = ms_warp_sum(r) * scale;
    if (lane == 0) row[w] = r;
    const A lz = isfinite(lse[w]) ? lse[w] : (A)0;
    i64 last = i + offset;
    if (last > tk - 1) last = tk - 1;
    for (i64 j = 0; j <= last; ++j) {
        A s = 0, dp = 0;
        MS_LANES { const i64 d = lane + 32 * jj;
                   if (d < dh) { s += ms_ld(kg, j * dh + d) * qs[jj];
                                 dp += ms_ld(vg, j * dh + d) * ds_[jj]; } }
        s = ms_warp_sum(s);
        dp = ms_warp_sum(dp);
        const A dsj = (dp - r) * exp(s - lz);
        MS_LANES { const i64 d = lane + 32 * jj;
                   if (d < dh) acc[jj] += dsj * ms_ld(kg, j * dh + d); }
    }
    MS_LANES { const i64 d = lane + 32 * jj; if (d < dh) ms_st(dq, w * dh + d, acc[jj]); }
}

// Backward, keys: warp w = (g, j) of bh * tk; dk, dv (bh, tk, dh) over the queries that see j.
template <typename S> __device__ void attention_bwd_dkv(
        const S* q, const S* k, const S* v, const S* dout, const typename ms_acc<S>::T* lse,
        const typename ms_acc<S>::T* row, S* dk, S* dv, i64 bh, i64 tq, i64 tk, i64 dh,
        i64 offset, typename ms_acc<S>::T scale) {
    typedef typename ms_acc<S>::T A;
    const i64 w = (blockIdx.x * (i64)MS_BLOCK + threadIdx.x) >> 5;
    const int lane = threadIdx.x & 31;
    if (w >= bh * tk) return;
    const i64 g = w / tk, j = w - g * tk;
    A kj[MS_PER_LANE], vj[MS_PER_LANE], dka[MS_PER_LANE], dva[MS_PER_LANE];
    MS_LANES { const i64 d = lane + 32 * jj; const bool in = d < dh;
               kj[jj] = in ? ms_ld(k, w * dh + d) : 0; vj[jj] = in ? ms_ld(v, w * dh + d) : 0;
               dka[jj] = 0; dva[jj] = 0; }
    i64 first = j - offset;
    if (first < 0) first = 0;
    for (i64 i = first; i < tq; ++i) {
        const i64 qi = (g * tq + i) * dh;
        A s = 0, dp = 0;
        MS_LANES { const i64 d = lane + 32 * jj;
                   if (d < dh) { s += kj[jj] * (ms_ld(q, qi + d) * scale);
                                 dp += vj[jj] * (ms_ld(dout, qi + d) * scale); } }
        s = ms_warp_sum(s);
        dp = ms_warp_sum(dp);
        const A li = lse[g * tq + i];
        const A p = exp(s - (isfinite(li) ? li : (A)0));
        const A dsi = (dp - row[g * tq + i]) * p;
        MS_LANES { const i64 d = lane + 32 * jj;
                   if (d < dh) { dka[jj] += dsi * ms_ld(q, qi + d);
                                 dva[jj] += p * ms_ld(dout, qi + d); } }
    }
    MS_LANES { const i64 d = lane + 32 * jj;
               if (d < dh) { ms_st(dk, w * dh + d, dka[jj]); ms_st(dv, w * dh + d, dva[jj]); } }
}
"""

_SHAPE = "i64 bh, i64 tq, i64 tk, i64 dh, i64 offset, A scale"
_CALL = "bh, tq, tk, dh, offset, scale"
ENTRIES = {
    "attention_fwd": (f"const S* q, const S* k, const S* v, S* out, A* lse, {_SHAPE}",
                      f"q, k, v, out, lse, {_CALL}"),
    "attention_bwd_dq": (f"const S* q, const S* k, const S* v, const S* out, const S* dout, "
                         f"const A* lse, S* dq, A* row, {_SHAPE}",
                         f"q, k, v, out, dout, lse, dq, row, {_CALL}"),
    "attention_bwd_dkv": (f"const S* q, const S* k, const S* v, const S* dout, const A* lse, "
                          f"const A* row, S* dk, S* dv, {_SHAPE}",
                          f"q, k, v, dout, lse, row, dk, dv, {_CALL}"),
}
"""kernel -> (its parameters, S and A placeholders; the call of the template)."""

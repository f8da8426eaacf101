"""CUDA C of the LayerNorm and RMSNorm kernels, forward and backward (part of cuda_src.SOURCE:
its header, storage types, block reduction and instantiation).

One block per row (a grid-stride loop over rows), the row's sums by ms_block_sum, statistics
in A (float32 for 16-bit storage). The forwards save the statistics (LayerNorm mean and rstd,
RMSNorm rstd) instead of the normalised x; each backward recomputes it from x, writes dx, and
adds the parameter gradients of its block's rows into that block's row of a (blocks, d)
partial array, which the caller sums over blocks (deterministic: no atomics).
"""
from __future__ import annotations

SOURCE = r"""
// LayerNorm forward, one block per row: y = (x - mean) rstd scale + shift.
template <typename S> __device__ void layernorm_fwd(
        const S* x, const S* scale, const S* shift, S* y, typename ms_acc<S>::T* mean,
        typename ms_acc<S>::T* rstd, i64 rows, i64 d, typename ms_acc<S>::T eps) {
    typedef typename ms_acc<S>::T A;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 o = r * d;
        A s = 0;
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) s += ms_ld(x, o + c);
        const A m = ms_block_sum(s) / (A)d;
        A q = 0;
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) {
            const A xc = ms_ld(x, o + c) - m;
            q += xc * xc;
        }
        const A rs = (A)1 / sqrt(ms_block_sum(q) / (A)d + eps);
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) {
            A v = (ms_ld(x, o + c) - m) * rs;
            v *= ms_ld(scale, c);
            ms_st(y, o + c, v + ms_ld(shift, c));
        }
        if (threadIdx.x == 0) { mean[r] = m; rstd[r] = rs; }
    }
}

// LayerNorm backward: dx = rstd (g - mean(g) - xhat mean(g xhat)), g = dy scale, xhat
// recomputed from x, mean, rstd; block b adds dy xhat and dy of its rows into row b of
// dscale_part and dshift_part (gridDim.x, d), which the caller sums over blocks.
template <typename S> __device__ void layernorm_bwd(
        const S* dy, const S* x, const S* scale, const typename ms_acc<S>::T* mean,
        const typename ms_acc<S>::T* rstd, S* dx, typename ms_acc<S>::T* dscale_part,
        typename ms_acc<S>::T* dshift_part, i64 rows, i64 d) {
    typedef typename ms_acc<S>::T A;
    A* ps = dscale_part + blockIdx.x * d;
    A* pb = dshift_part + blockIdx.x * d;
    for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) { ps[c] = 0; pb[c] = 0; }
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 o = r * d;
        const A m = mean[r], rs = rstd[r];
        A s0 = 0, s1 = 0;
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) {
            const A g = ms_ld(dy, o + c) * ms_ld(scale, c);
            s0 += g;
            s1 += g * ((ms_ld(x, o + c) - m) * rs);
        }
        const A c0 = ms_block_sum(s0) / (A)d, c1 = ms_block_sum(s1) / (A)d;
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) {
            const A g = ms_ld(dy, o + c);
            const A xh = (ms_ld(x, o + c) - m) * rs;
            A v = g * ms_ld(scale, c);
            v -= c0;
            v -= xh * c1;
            ms_st(dx, o + c, v * rs);
            ps[c] += g * xh;
            pb[c] += g;
        }
    }
}

// RMSNorm forward: y = (x rstd) scale, rstd = 1 / sqrt(mean(x^2) + eps).
template <typename S> __device__ void rmsnorm_fwd(
        const S* x, const S* scale, S* y, typename ms_acc<S>::T* rstd, i64 rows, i64 d,
        typename ms_acc<S>::T eps) {
    typedef typename ms_acc<S>::T A;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 o = r * d;
        A q = 0;
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) { A v = ms_ld(x, o + c); q += v * v; }
        const A rs = (A)1 / sqrt(ms_block_sum(q) / (A)d + eps);
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK)
            ms_st(y, o + c, (ms_ld(x, o + c) * rs) * ms_ld(scale, c));
        if (threadIdx.x == 0) rstd[r] = rs;
    }
}

// RMSNorm backward: dx = rstd (g - n mean(g n)), g = dy scale, n = x rstd; dy n of the block's
// rows into row blockIdx.x of dscale_part (gridDim.x, d).
template <typename S> __device__ void rmsnorm_bwd(
        const S* dy, const S* x, const S* scale, const typename ms_acc<S>::T* rstd, S* dx,
        typename ms_acc<S>::T* dscale_part, i64 rows, i64 d) {
    typedef typename ms_acc<S>::T A;
    A* ps = dscale_part + blockIdx.x * d;
    for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) ps[c] = 0;
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 o = r * d;
        const A rs = rstd[r];
        A s = 0;
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK)
            s += (ms_ld(dy, o + c) * ms_ld(scale, c)) * (ms_ld(x, o + c) * rs);
        const A c1 = ms_block_sum(s) / (A)d;
        for (i64 c = threadIdx.x; c < d; c += MS_BLOCK) {
            const A g = ms_ld(dy, o + c), n = ms_ld(x, o + c) * rs;
            const A v = g * ms_ld(scale, c) - n * c1;
            ms_st(dx, o + c, v * rs);
            ps[c] += g * n;
        }
    }
}
"""

ENTRIES = {
    "layernorm_fwd": ("const S* x, const S* scale, const S* shift, S* y, A* mean, A* rstd, "
                      "i64 rows, i64 d, A eps", "x, scale, shift, y, mean, rstd, rows, d, eps"),
    "layernorm_bwd": ("const S* dy, const S* x, const S* scale, const A* mean, const A* rstd, "
                      "S* dx, A* dscale_part, A* dshift_part, i64 rows, i64 d",
                      "dy, x, scale, mean, rstd, dx, dscale_part, dshift_part, rows, d"),
    "rmsnorm_fwd": ("const S* x, const S* scale, S* y, A* rstd, i64 rows, i64 d, A eps",
                    "x, scale, y, rstd, rows, d, eps"),
    "rmsnorm_bwd": ("const S* dy, const S* x, const S* scale, const A* rstd, S* dx, "
                    "A* dscale_part, i64 rows, i64 d",
                    "dy, x, scale, rstd, dx, dscale_part, rows, d"),
}
"""kernel -> (its parameters, S and A placeholders; the call of the template)."""

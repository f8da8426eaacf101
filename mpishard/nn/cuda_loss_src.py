"""CUDA C of the softmax cross entropy on logits as they are stored (part of cuda_src.SOURCE:
its header, storage types and instantiation).

A 16-bit step's head writes its logits in 16 bits (nn/autocast.py `Narrow.kept`), and this
kernel reads them there: the loss's arithmetic is float32 (A) on exactly widened values, as
autocast's float32 loss is, and the gradient is written in the storage type, the 16-bit
array the head's backward matmul takes. Against fused.cross_entropy on float32 logits (a max
pass, a sum-of-exp pass, a gradient pass, and a float32 gradient: 16 bytes an element), the
logits are read three times at 2 bytes and the gradient written once at 2 bytes (8 bytes),
and the casts around it (the logits widened before, the gradient rounded after: 12 bytes)
are gone: 8 bytes an element where there were 28. An ignored row adds 0 to the loss
whatever its logits, as PyTorch's ignore_index does, and 0 to the gradient (PyTorch's is nan
on a row of inf or nan logits), as every path of losses.CrossEntropy does.

One block per row r of y (rows, c), MS_BLOCK threads, labels t already 0 on ignored rows:

    m      = max_j y[r, j]                  each thread over columns t, t + MS_BLOCK, ...;
                                            then the block's max (exact in any order)
    s      = sum_j exp(y[r, j] - m)         each thread in its column order, then
                                            ms_block_sum (tests/cuda_mirror.py's order)
    lse    = log s
    loss[r] = keep[r] ? (y[r, t_r] - m) - lse : 0       (the value: -sum(loss) / n)
    g[r, j] = keep[r] ? ((exp((y[r, j] - m) - lse) - [j == t_r]) / n) * scale : 0

A kept label outside [0, c) (the engine's check_targets refuses one before every step; a
direct CrossEntropy.pair call does not check) gives its row a nan loss and gradient instead
of a read outside the row.

n is read from device memory (a count of the kept labels that is never read back, or the
engine's global count); scale is the step's gradient scale (1 / microbatches, a loss scale),
applied before the 16-bit store as the float32 path applies it before the matmul rounds it.
These are fused.cross_entropy's formulas (its ce_grad, step_pair's scale after it), so the
result equals the xp path to the order of the sum s (rtol 1e-12 in float64).
"""
from __future__ import annotations

SOURCE = r"""
// The max of v over the block, the same value on every thread (ms_block_sum's pattern).
template <typename A> __device__ A ms_block_max(A v) {
    __shared__ A part[MS_BLOCK / 32];
    for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    if ((threadIdx.x & 31) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    A t = part[0];
    for (int w = 1; w < MS_BLOCK / 32; ++w) t = fmax(t, part[w]);
    return t;
}

template <typename S> __device__ void cross_entropy(
        const S* y, const i64* t, const bool* keep, const typename ms_acc<S>::T* n,
        typename ms_acc<S>::T scale, typename ms_acc<S>::T* loss, S* g, i64 rows, i64 c) {
    typedef typename ms_acc<S>::T A;
    const A count = n[0];
    for (i64 r = blockIdx.x; r < rows; r += gridDim.x) {
        const i64 at = r * c;
        A m = ms_ld(y, at + (threadIdx.x < c ? threadIdx.x : 0));
        for (i64 j = threadIdx.x; j < c; j += MS_BLOCK) m = fmax(m, ms_ld(y, at + j));
        m = ms_block_max(m);
        A s = 0;
        for (i64 j = threadIdx.x; j < c; j += MS_BLOCK) s += exp(ms_ld(y, at + j) - m);
        const A lse = log(ms_block_sum(s));
        const bool k = keep[r];
        const i64 label = t[r];
        if (k && (label < 0 || label >= c)) {        // never read outside the row: nan
            const A nan = (A)__int_as_float(0x7fffffff);
            if (threadIdx.x == 0) loss[r] = nan;
            for (i64 j = threadIdx.x; j < c; j += MS_BLOCK) ms_st(g, at + j, nan);
            continue;
        }
        if (threadIdx.x == 0) loss[r] = k ? (ms_ld(y, at + label) - m) - lse : (A)0;
        for (i64 j = threadIdx.x; j < c; j += MS_BLOCK) {
            A e = 0;
            if (k) {
                e = exp((ms_ld(y, at + j) - m) - lse);
                if (j == label) e -= (A)1;
                e = e / count;
                e *= scale;
            }
            ms_st(g, at + j, e);
        }
    }
}
"""

ENTRIES = {
    "cross_entropy": ("const S* y, const i64* t, const bool* keep, const A* n, A scale, "
                      "A* loss, S* g, i64 rows, i64 c",
                      "y, t, keep, n, scale, loss, g, rows, c"),
}
"""kernel -> (its parameters, S and A placeholders; the call of the template)."""

"""numpy mirrors of the CUDA kernels' algorithms (mpishard/nn/cuda_src.py), statement by
statement: the block reduction's order (thread t sums columns t, t + BLOCK, ... ; a butterfly
of shuffles over each warp's 32 lanes; the warps' partials added in order), the norms'
backward recomputing xhat / n from x and the saved statistics and summing the parameter
gradients per block of rows, GELU's derivative recomputed from u, SwiGLU's sigmoid recomputed
from the gate, the embedding backward's stable sort and runs, AdamW's host scalars rounded to
the dtype, attention's online softmax (running max and sum rescaled key by key) and its
backward's per-key sums. Used by tests/nn/test_cuda_kernels.py (against the xp paths) and
tests/gpu/test_gpu_kernels_check.py (the GPU check's kernel part on the CPU).
"""
import numpy as np

from mpishard.nn import cuda_src

BLOCK = cuda_src.BLOCK


def block_sum(v):
    """ms_block_sum over each row of v (rows, d), in the kernel's order."""
    rows, d = v.shape
    k = -(-d // BLOCK)
    lanes = np.zeros((rows, k * BLOCK), dtype=v.dtype)
    lanes[:, :d] = v                                 # zeros beyond d: exact additions
    lanes = lanes.reshape(rows, k, BLOCK)
    t = lanes[:, 0].copy()
    for j in range(1, k):                            # thread t: columns t, t + BLOCK, ...
        t += lanes[:, j]
    w = t.reshape(rows, BLOCK // 32, 32)
    lane = np.arange(32)
    for o in (16, 8, 4, 2, 1):                       # __shfl_xor_sync butterfly
        w = w + w[..., lane ^ o]
    total = w[:, 0, 0].copy()
    for j in range(1, BLOCK // 32):                  # the warps' partials, in order
        total += w[:, j, 0]
    return total[:, None]


def layernorm_fwd(x, scale, shift, eps):
    d = x.shape[-1]
    m = block_sum(x) / d
    xc = x - m
    rs = 1 / np.sqrt(block_sum(xc * xc) / d + eps)
    return ((x - m) * rs) * scale + shift, m, rs


def per_block(rows, blocks, fn):
    """Sum over blocks b of the per-row values fn(r) for r = b, b + blocks, ... in order."""
    parts = []
    for b in range(blocks):
        acc = None
        for r in range(b, rows, blocks):
            acc = fn(r) if acc is None else acc + fn(r)
        parts.append(acc)
    return np.sum(parts, axis=0)


def layernorm_bwd(dy, x, scale, m, rs, blocks):
    d = x.shape[-1]
    xh = (x - m) * rs
    g = dy * scale
    c0, c1 = block_sum(g) / d, block_sum(g * xh) / d
    dx = ((dy * scale - c0) - xh * c1) * rs
    return (dx, per_block(len(x), blocks, lambda r: dy[r] * xh[r]),
            per_block(len(x), blocks, lambda r: dy[r]))


def rmsnorm_fwd(x, scale, eps):
    rs = 1 / np.sqrt(block_sum(x * x) / x.shape[-1] + eps)
    return (x * rs) * scale, rs


def rmsnorm_bwd(dy, x, scale, rs, blocks):
    n = x * rs
    c1 = block_sum((dy * scale) * n) / x.shape[-1]
    return (dy * scale - n * c1) * rs, per_block(len(x), blocks, lambda r: dy[r] * n[r])


def gelu(z):
    """ms_gelu's steps (fused._GELU's)."""
    c = np.sqrt(2 / np.pi)
    s = z * z
    h = s * (0.044715 * c)
    h += c
    h *= z
    h = np.tanh(h)
    h += 1
    h *= 0.5
    s *= 6 * 0.044715 * c
    s += 2 * c
    s *= z
    s *= 1 - h
    s += 1
    return z * h, h * s


def swiglu(a, dy=None):
    f = a.shape[-1] // 2
    g, u = a[..., :f], a[..., f:]
    s = 0.5 * (np.tanh(0.5 * g) + 1)
    if dy is None:
        return (g * s) * u
    slope = ((1 - s) * g + 1) * s
    return np.concatenate([(dy * u) * slope, dy * (g * s)], axis=-1)


def embedding_bwd(dy, ids, rows):
    flat, dy2 = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    starts = np.r_[np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]), flat.size]
    g = np.zeros((rows, dy2.shape[1]), dtype=dy.dtype)
    for k in range(len(starts) - 1):
        acc = np.zeros(dy2.shape[1], dtype=dy.dtype)
        for j in range(starts[k], starts[k + 1]):
            acc += dy2[order[j]]
        g[sorted_ids[starts[k]]] = acc
    return g


def adamw(p, g, m, v, hyper, k):
    """The adamw kernel's statements on tensor k, with cuda_ops.adamw_hyper's scalars rounded
    to the tensor's dtype (the kernel's A arguments)."""
    per, decay, omb1, b2, omb2, eps = hyper
    s = p.dtype.type
    step_size, bc2 = (s(x) for x in per[k])
    p *= s(decay)
    m += s(omb1) * (g - m)
    v[...] = v * s(b2)
    v += s(omb2) * (g * g)
    p -= step_size * (m / (np.sqrt(v) / bc2 + s(eps)))


def attention_fwd(q, k, v, offset):
    """The attention_fwd kernel's online softmax, every query row at once, key by key."""
    tq, dh, tk = q.shape[2], q.shape[3], k.shape[2]
    last = np.arange(tq) + (tk if offset is None else offset)      # query i sees j <= last
    qs = q * (1 / np.sqrt(dh))
    m, total, o = np.full(q.shape[:3], -np.inf), np.zeros(q.shape[:3]), np.zeros(q.shape)
    for j in range(tk):
        sees = j <= last
        s = np.einsum("bhid,bhd->bhi", qs, k[:, :, j])
        mn = np.where(sees, np.maximum(s, m), m)
        with np.errstate(invalid="ignore"):                        # -inf - -inf, unseen
            corr, e = np.exp(m - mn), np.exp(s - mn)
        total = np.where(sees, total * corr + e, total)
        o = np.where(sees[:, None], o * corr[..., None] + e[..., None] * v[:, :, j, None], o)
        m = mn
    with np.errstate(divide="ignore"):
        lse = np.where(total > 0, m + np.log(np.where(total > 0, total, 1)), -np.inf)
    return o * (1 / np.where(total > 0, total, 1))[..., None], lse


def attention_bwd(dout, q, k, v, out, lse, offset):
    """attention_bwd_dq's and attention_bwd_dkv's sums (p recomputed from lse), key by key."""
    tq, dh, tk = q.shape[2], q.shape[3], k.shape[2]
    last = np.arange(tq) + (tk if offset is None else offset)
    scale = 1 / np.sqrt(dh)
    qs, dos = q * scale, dout * scale
    row = (dout * out).sum(axis=-1) * scale
    lz = np.where(np.isfinite(lse), lse, 0)
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    for j in range(tk):
        s = np.einsum("bhid,bhd->bhi", qs, k[:, :, j])
        dp = np.einsum("bhid,bhd->bhi", dos, v[:, :, j])
        p = np.where(j <= last, np.exp(s - lz), 0)
        ds = (dp - row) * p
        dq += ds[..., None] * k[:, :, j, None]
        dk[:, :, j] = np.einsum("bhi,bhid->bhd", ds, q)
        dv[:, :, j] = np.einsum("bhi,bhid->bhd", p, dout)
    return dq, dk, dv


def cross_entropy(y, t, keep, n, scale):
    """ms cross_entropy (cuda_loss_src): per row the exact max, the sum of exp(y - m) in the
    block's order, lse = log of it; loss (y[t] - m) - lse and g = ((exp((y - m) - lse) -
    onehot) / n) * scale on kept rows, 0 on the others, nan on a kept row whose label is
    outside [0, C). y (N, C) in A; t 0 on ignored rows."""
    a = y.dtype.type
    bad = keep & ((t < 0) | (t >= y.shape[1]))
    t = np.where(bad, 0, t)
    m = y.max(axis=1, keepdims=True)
    lse = np.log(block_sum(np.exp(y - m)))
    rows = np.arange(len(y))
    loss = np.where(keep, (y[rows, t] - m[:, 0]) - lse[:, 0], a(0))
    e = np.exp((y - m) - lse)
    e[rows, t] -= a(1)
    g = np.where(keep[:, None], (e / a(n)) * a(scale), a(0))
    return np.where(bad, a(np.nan), loss), np.where(bad[:, None], a(np.nan), g)

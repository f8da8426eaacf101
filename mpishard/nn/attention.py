"""Causal softmax attention: forward/backward pairs built from one block primitive.

Shapes: q (B, H, Tq, Dh) queries, k and v (B, H, Tk, Dh) keys and values, one head per h.

    scores  s = 'bhtd,bhsd->bhts' (q, k) / sqrt(Dh)        masked: query i sees key j <= i
    probs   p = softmax over s (row max subtracted, so exp never overflows)
    out     o = 'bhts,bhsd->bhtd' (p, v)

`attention_block` is one block of that (a query chunk against a key chunk, the mask given by
the chunks' offset) and returns its output normalised within the block plus the block's
log-sum-exp `lse` of the scaled scores. Blocks over disjoint key chunks combine with
`merge_blocks` (the online softmax: rescale each by exp(lse_block - lse_total)), so a ring
attention walks key chunks block by block and never holds scores for the whole sequence.
`attention_block_backward` takes the *final* output and lse (after every merge) and returns
one block's share of dq, dk, dv; the shares of all blocks add up to the full gradients.
`causal_attention_forward/backward` are the one-block case, offset 0.

Heads: `split_heads` cuts the (B, T, 3 D) output of the qkv projection into q | k | v (columns
[0:D], [D:2D], [2D:3D]) and each of those into heads (head h: columns h*Dh:(h+1)*Dh);
`merge_heads` concatenates head outputs back in order. Both work on local head counts.
"""
from __future__ import annotations

import math

import numpy as np

from . import cpu_attention, cpu_fused, cudnn_attention, fused, fused_low
from .autocast import FULL, Narrow
from .functional import array_module
from .gemm import is_low, matmul


def causal_mask(xp, tq: int, tk: int, offset: int):
    """(tq, tk) bool: query i sees key j iff j <= i + offset, offset = (position of query 0)
    - (position of key 0)."""
    return xp.arange(tk)[None, :] <= xp.arange(tq)[:, None] + offset


def _finite_or_zero(xp, a):
    """-inf (a row that sees no key) replaced by 0, so exp(s - a) is exactly 0 there."""
    return xp.where(xp.isfinite(a), a, 0.0)


def _t(a):
    """Swap the last two axes (each matrix of a batch transposed, a view)."""
    return a.swapaxes(-1, -2)


def wide(x):
    """The dtype the attention's outputs and gradients are held in: x's, or float32 for a
    16-bit x (nn/autocast.py Narrow: only matmul inputs are 16-bit arrays)."""
    return np.dtype(np.float32) if is_low(x) else x.dtype


def inv_sqrt(x):
    """1 / sqrt(Dh) for scaling x (…, Dh): a Python float, or for a 16-bit x a float32 one,
    so the product is a float32 one rounded once to x's dtype (the rounding emulation's),
    not taken in 16 bits with the factor itself rounded to 16 bits."""
    scale = 1.0 / math.sqrt(x.shape[-1])
    return np.float32(scale) if is_low(x) else scale


def _masked_scores_t(q, k, offset, visible=None, cast=FULL):
    """The scores transposed, keys down and queries across (B, H, Tk, Tq):
    s^T = 'bhsd,bhtd->bhst' (k, q / sqrt(Dh)), -inf where the causal mask hides the key and,
    when `visible` (bool, broadcastable to (B, H, Tq, Tk)) is given, where it is False.

    Why transposed: the softmax then reduces over axis -2 (whole contiguous rows at a time)
    instead of along a short last axis, and both GEMMs of the forward are plain or
    transposed-left products, which OpenBLAS runs faster than q k^T on these small blocks.
    cast (nn/autocast.py): the matmul's inputs and its output rounded (before the mask).
    """
    xp = array_module(q)
    s = cast.output(_product_t(q, k, cast))                      # 'bhsd,bhdt->bhst'
    if offset is not None:                  # + 0 or -inf: hides keys; flat (Tk Tq) rows, so
        hide = xp.where(causal_mask(xp, q.shape[-2], k.shape[-2], offset).T, 0.0, -xp.inf)
        flat = s.reshape(s.shape[:-2] + (-1,))          # the add runs in long contiguous loops
        flat += hide.astype(s.dtype).reshape(-1)
        s = flat.reshape(s.shape)                       # (a view of s, or of a copy of it)
    if visible is not None:                 # e.g. a KV cache's padding mask (kv_cache.py)
        s = s + xp.where(_t(visible), 0.0, -xp.inf).astype(s.dtype)
    return s


def _scaled_t(x):
    """(x / sqrt Dh)^T of (…, T, Dh) x, C-ordered (…, Dh, T) in x's dtype: one copy."""
    xp = array_module(x)
    out = xp.empty(x.shape[:-2] + (x.shape[-1], x.shape[-2]), dtype=x.dtype)
    xp.multiply(_t(x), inv_sqrt(x), out=out)
    return out


def _product_t(q, k, cast=FULL):
    """s^T = 'bhsd,bhdt->bhst' (k, (q / sqrt Dh)^T) as the matmul returns it: unmasked, its
    output not yet through cast.output (16-bit under a `Narrow` cast)."""
    return matmul(array_module(q), cast.round(k), cast.round(_scaled_t(q)))


def _takes_low(q, cast) -> bool:
    """Whether nn/fused_low.py's kernels take this attention: cupy with the fused kernels
    on and a `Narrow` cast (16-bit compute on a device), whose _product_t is 16-bit."""
    return isinstance(cast, Narrow) and fused.use(array_module(q))


def _max_over_keys(s):
    """max over axis -2 of s (B, H, Tk, Tq), kept as (B, H, 1, Tq): halving the key rows
    with element-wise maxima (each pass whole rows) instead of numpy's strided reduction."""
    xp = array_module(s)
    n = s.shape[-2]
    if n <= 1:
        return s.max(axis=-2, keepdims=True) if n == 0 else s.copy()
    half = (n + 1) // 2                          # an odd count: the middle row twice
    m = xp.maximum(s[..., :half, :], s[..., n - half:, :])
    n = half
    while n > 1:
        half = (n + 1) // 2
        xp.maximum(m[..., :half, :], m[..., n - half:n, :], out=m[..., :half, :])
        n = half
    return m[..., :1, :]


def attention_block(q, k, v, offset=None, keep_probs=False, visible=None, cast=FULL):
    """One block: (out (B, H, Tq, Dh) normalised within the block, lse (B, H, Tq)).

    offset None: every query sees every key; an int: the causal mask of causal_mask.
    visible: None, or a bool mask broadcastable to (B, H, Tq, Tk), False hiding a key from a
    query (with offset, a key must pass both; the backward takes the same mask); with it the
    xp ops run on a device (nn/fused.py's kernel is causal-only); on numpy the numba kernel
    (nn/cpu_attention.py) takes a 4-axis bool mask (cpu_attention.takes_mask), the xp ops any
    other.
    A row
    that sees no key gets out 0 and lse -inf (merge_blocks then gives it weight 0). `out` is a
    (B, H, Tq, Dh) view of a (B, Tq, H, Dh) array, so merge_heads needs no copy.
    keep_probs: also return the probabilities p^T (B, H, Tk, Tq), for a backward that keeps
    them instead of recomputing the scores (one (B, H, T, T) array more per layer on the tape),
    or None where recomputing is the cheaper: 16-bit scores on a device (below), whose one
    tensor-core GEMM costs less than writing and reading back the kept array.
    cast (nn/autocast.py): the precision of the two matmuls (inputs and outputs rounded; the
    softmax, lse and the kept probabilities stay float32, as under torch.autocast). Under a
    `Narrow` cast on cupy with the fused kernels on and no `visible`, the softmax reads the
    16-bit scores where the GEMM wrote them and writes the 16-bit probabilities the PV matmul
    takes (nn/fused_low.py): the same values, no float32 (B, H, Tk, Tq) array.
    """
    xp = array_module(q)
    low = visible is None and _takes_low(q, cast)
    if low:                               # 16-bit scores: the softmax in place, in 16 bits
        p = _product_t(q, k, cast)
        lse = fused_low.causal_softmax_t(xp, p, offset)
    elif visible is None and fused.use(xp):                  # the same softmax, one kernel
        p = _masked_scores_t(q, k, None, cast=cast)
        lse = fused.causal_softmax_t(xp, p, offset)
    elif cpu_fused.use(q, k) and (visible is None or cpu_attention.takes_mask(
            visible, k.shape[:2] + (k.shape[-2], q.shape[-2]))):   # numpy + numba: two loops
        p, lse = cpu_attention.causal_softmax_t(_masked_scores_t(q, k, None, cast=cast),
                                                offset, visible)
    else:
        p = _masked_scores_t(q, k, offset, visible, cast)    # s^T, then p^T in place
        m = _finite_or_zero(xp, _max_over_keys(p))           # per query max: exp(s - m) <= 1
        p -= m
        xp.exp(p, out=p)                                     # unnormalised probabilities
        denom = xp.matmul(xp.ones(p.shape[-2], dtype=p.dtype), p)   # sum over keys (B,H,Tq)
        p *= (1.0 / xp.where(denom > 0, denom, 1.0))[..., None, :]   # normalised: p^T
        with np.errstate(divide="ignore"):                   # log 0 = -inf: no key seen
            lse = m[..., 0, :] + xp.log(denom)
    b, h, tq, dh = q.shape
    out = xp.empty((b, tq, h, dh), dtype=wide(q)).transpose(0, 2, 1, 3)   # float32 for 16 bits
    cast.output(fused.matmul_tn(xp, cast.round(p), cast.round(v), out=out))  # 'bhst,bhsd->bhtd'
    if not keep_probs:
        return out, lse
    return out, lse, (None if low else p)               # 16-bit: recomputed (_backward_low)


def merge_blocks(out_a, lse_a, out_b, lse_b):
    """Online softmax: two blocks over disjoint keys as one, (out, lse).

    lse = log(exp(lse_a) + exp(lse_b));  out = exp(lse_a - lse) out_a + exp(lse_b - lse) out_b
    """
    xp = array_module(out_a)
    lse = xp.logaddexp(lse_a, lse_b)
    ref = _finite_or_zero(xp, lse)
    wa, wb = xp.exp(lse_a - ref)[..., None], xp.exp(lse_b - ref)[..., None]
    return wa * out_a + wb * out_b, lse


def attention_block_backward(dout, q, k, v, out, lse, offset=None, into=None, probs=None,
                             visible=None, cast=FULL, whole=False):
    """One block's share of (dq, dk, dv), given dL/dout and the final out and lse.

    p  = exp(s - lse)                    the final softmax on this block's keys (recomputed,
                                         transposed as in the forward: p^T (B, H, Tk, Tq))
    dv = 'bhts,bhtd->bhsd' (p, dout)     undoes o = p v (in v)
    dp = 'bhtd,bhsd->bhts' (dout, v)     undoes o = p v (in p)
    ds = p (dp - sum_d dout * out)       undoes the softmax (the row sum uses the final out;
                                         under a rounding cast with `whole`: sum_s p dp)
    dq = 'bhts,bhsd->bhtd' (ds, k) / sqrt(Dh)    undoes s = q k^T / sqrt(Dh) (in q)
    dk = 'bhts,bhtd->bhsd' (ds, q) / sqrt(Dh)    ... (in k)

    into: three (B, H, T, Dh) arrays (views allowed) to write dq, dk, dv to, e.g. the views
    of split_heads_grads; None: fresh arrays. probs: the p^T the forward kept (keep_probs),
    used as it is (read only) instead of recomputed from q, k and lse. visible: the forward's
    mask (attention_block), hiding the same keys when p is recomputed. cast: the forward's
    (nn/autocast.py): the four matmuls' inputs and outputs rounded, the softmax's backward
    (ds from p, dp and the row sums) in float32. whole: this block holds every key its
    queries see (one block, not a ring's share), so under a rounding cast the row sums are
    the softmax's own, sum_s p dp from the rounded dp (its autograd's, as under
    torch.autocast); blocks of a ring share the final out's sum_d dout * out instead.
    Under a `Narrow` cast on cupy (attention_block's 16-bit path), a whole block without
    `probs` or `visible` recomputes the 16-bit scores and runs the softmax's backward in 16
    bits (_backward_low).
    """
    xp = array_module(q)
    scale = 1.0 / math.sqrt(q.shape[-1])
    dq, dk, dv = (None, None, None) if into is None else into
    if probs is None and visible is None and whole and _takes_low(q, cast):
        return _backward_low(dout, q, k, v, lse, offset, cast, (dq, dk, dv))
    p = probs
    if p is None:
        p = _masked_scores_t(q, k, offset, visible, cast)    # s^T, then p^T in place
        p -= _finite_or_zero(xp, lse)[..., None, :]
        xp.exp(p, out=p)
    dout = cast.round(dout)
    dv = cast.output(matmul(xp, cast.round(p), dout, out=dv))    # 'bhst,bhtd->bhsd' (p^T, dout)
    ds = cast.output(matmul(xp, cast.round(v), cast.round(_scaled_t(dout))))  # dp^T / sqrt Dh
    #                                                          'bhsd,bhdt->bhst'
    if cast.active and whole:          # sum_s p dp / sqrt Dh, from the rounded dp: the
        row = fused.dot_over_keys(xp, ds, p)         # softmax's own backward (autocast's)
    else:
        pair = (dout.astype(p.dtype, copy=False), out.astype(p.dtype, copy=False))   # 16-bit
        row = xp.einsum("bthd,bthd->bht", *(u.transpose(0, 2, 1, 3) for u in pair))
        row *= scale                                         # sum_d dout * out / sqrt Dh
    if cpu_attention.takes_grad(ds, row, p):                 # numpy + numba: one pass
        cpu_attention.softmax_grad_t(ds, row, p)
    else:
        fused.softmax_grad_t(xp, ds, row, p)                 # ds^T / sqrt Dh = (ds - row) p
    ds = cast.round(ds)
    dq = cast.output(fused.matmul_tn(xp, ds, cast.round(k), out=dq))   # 'bhts,bhsd->bhtd'
    dk = cast.output(matmul(xp, ds, cast.round(q), out=dk))  # 'bhst,bhtd->bhsd' (ds^T, q)
    return dq, dk, dv


def _backward_low(dout, q, k, v, lse, offset, cast, into):
    """attention_block_backward of a whole block under a `Narrow` cast on cupy (_takes_low),
    from the recomputed 16-bit scores s^T: the softmax's backward in 16 bits
    (nn/fused_low.py), the same products and roundings as the float32 path, no (B, H, Tk,
    Tq) float32 array."""
    xp = array_module(q)
    dq, dk, dv = into
    s = _product_t(q, k, cast)                               # 16-bit s^T, recomputed
    dout = cast.round(dout)
    ds = matmul(xp, cast.round(v), cast.round(_scaled_t(dout)))   # 16-bit dp^T / sqrt Dh
    p, ds = fused_low.softmax_grad_t(xp, s, ds, lse, offset)  # p^T, ds^T / sqrt Dh: 16 bits
    dv = cast.output(matmul(xp, p, dout, out=dv))            # 'bhst,bhtd->bhsd' (p^T, dout)
    dq = cast.output(fused.matmul_tn(xp, ds, cast.round(k), out=dq))   # 'bhts,bhsd->bhtd'
    dk = cast.output(matmul(xp, ds, cast.round(q), out=dk))  # 'bhst,bhtd->bhsd' (ds^T, q)
    return dq, dk, dv


def causal_attention_forward(q, k, v, keep_probs=False, visible=None, cast=FULL):
    """Causal self-attention of a whole sequence: (out, lse), one block at offset 0 (and the
    probabilities with keep_probs); visible: a further mask, e.g. packed documents'
    (nn.documents.visible). Under a `Narrow` cast on cupy without `visible`, cuDNN's flash
    kernels take it where they can (nn/cudnn_attention.py: `out` then 16-bit, p None)."""
    if visible is None and isinstance(cast, Narrow):
        fast = cudnn_attention.forward(cast.round(q), cast.round(k), cast.round(v))
        if fast is not None:
            return fast + (None,) if keep_probs else fast
    return attention_block(q, k, v, offset=0, keep_probs=keep_probs, visible=visible,
                           cast=cast)


def causal_attention_backward(dout, q, k, v, out, lse, into=None, probs=None, visible=None,
                              cast=FULL):
    """Undo causal_attention_forward: (dq, dk, dv) (written to `into` when given; `probs`:
    the forward's kept probabilities, else recomputed under the same `visible`). A forward
    by cuDNN (a 16-bit `out`) has its backward by cuDNN (nn/cudnn_attention.py)."""
    if probs is None and visible is None and isinstance(cast, Narrow) and is_low(out):
        grads = cudnn_attention.backward(cast.round(dout), cast.round(q), cast.round(k),
                                         cast.round(v), out, lse, into)
        if grads is not None:
            return grads
    return attention_block_backward(dout, q, k, v, out, lse, offset=0, into=into, probs=probs,
                                    visible=visible, cast=cast, whole=True)


# -- heads ---------------------------------------------------------------------------------------
def split_heads(a, n_heads: int):
    """(B, T, 3 D) q | k | v columns -> q, k, v each (B, H, T, Dh), head h = columns
    h*Dh:(h+1)*Dh of its third."""
    b, t, three_d = a.shape
    qkv = a.reshape(b, t, 3, n_heads, three_d // (3 * n_heads)).transpose(2, 0, 3, 1, 4)
    return qkv[0], qkv[1], qkv[2]


def split_heads_backward(dq, dk, dv):
    """Undo split_heads: (B, H, T, Dh) x 3 -> (B, T, 3 D)."""
    da, views = split_heads_grads(dq)
    for view, d in zip(views, (dq, dk, dv)):
        view[...] = d
    return da


def split_heads_grads(q, dtype=None):
    """A (B, T, 3 D) gradient of split_heads' input for heads shaped like q (B, H, T, Dh),
    and its q, k, v parts as (B, H, T, Dh) views: a backward that writes dq, dk, dv there
    (attention_block_backward's `into`) has undone split_heads without a copy. dtype: the
    gradient's, default wide(q) (a cuDNN backward writes 16-bit ones, which the qkv matmul's
    backward takes as they are)."""
    xp = array_module(q)
    b, h, t, dh = q.shape
    da = xp.empty((b, t, 3, h, dh), dtype=wide(q) if dtype is None else dtype)
    return da.reshape(b, t, 3 * h * dh), tuple(da[:, :, i].transpose(0, 2, 1, 3)
                                               for i in range(3))


def merge_heads(o):
    """(B, H, T, Dh) -> (B, T, H Dh): heads concatenated in order."""
    b, h, t, dh = o.shape
    return o.transpose(0, 2, 1, 3).reshape(b, t, h * dh)


def merge_heads_backward(dy, n_heads: int):
    """Undo merge_heads: (B, T, H Dh) -> (B, H, T, Dh)."""
    b, t, d = dy.shape
    return dy.reshape(b, t, n_heads, d // n_heads).transpose(0, 2, 1, 3)

"""Llama attention: rotary positions and grouped-query attention (units of units.py).

The activation between FusedLinear(q, k, v) and the attention core is (B, T, (Hq + 2 Hkv) Dh): the
q | k | v columns, each cut into heads of Dh columns (Hq, Hkv: the heads this rank computes).

    Rotary                 q and k turned by position (HF's rotate-half convention); v as is
    GroupedQueryAttention  causal attention, query head i against kv head kv_heads[i]
                           (KVHeads; HF's repeat_kv: i // (Hq / Hkv)); a KV cache gets the
                           un-repeated k, v
    RepeatKV               q | k, v repeated to every query head: the (B, T, 3 Hq Dh) input
                           of cp's ring or Ulysses unit

Packed rows (nn/documents.py): the rotary turns each token by its position within its document
(cos/sin per row, (B, T, 1, Dh)) and the attention core keeps each query to the keys of its
own document; cp's ring and Ulysses units do the same for the attention (context_parallel.py,
ulysses.py).

RoPE: inv_freq = 1 / theta^(arange(0, Dh, 2) / Dh), angle = pos inv_freq, cos/sin =
cat(angle, angle), x' = x cos + rotate_half(x) sin with rotate_half(x) = cat(-x2, x1); its
adjoint is dx = dx' cos - rotate_half(dx' sin) (rotate_half^T = -rotate_half). The angles are
taken in float64 and cast to the activations' dtype (transformers takes them in float32).
"""
from __future__ import annotations

from ...nn import attention as att
from ...nn import documents as docs
from ...nn import functional as nn
from ...nn.autocast import FULL
from ...nn.layers import Layer
from ...nn.transformer import leading_positions, unit_positions


def rope_angles(xp, positions, d_head: int, theta: float):
    """(cos, sin) of HF's rotary embedding for `positions` (a slice, a tuple of slices, or an
    integer array (B, t)), each (t, 1, Dh) or (B, t, 1, Dh) to broadcast against (B, t, heads,
    Dh): angle = pos / theta^(arange(0, Dh, 2) / Dh), cos/sin = cat(angle, angle), float64."""
    if isinstance(positions, slice):
        positions = (positions,)
    if isinstance(positions, tuple):
        pos = xp.concatenate([xp.arange(s.start or 0, s.stop) for s in positions])
    else:
        pos = xp.asarray(positions)
    inv_freq = 1.0 / theta ** (xp.arange(0, d_head, 2, dtype=xp.float64) / d_head)
    angles = pos.astype(xp.float64)[..., None] * inv_freq           # (..., t, Dh/2)
    angles = xp.concatenate([angles, angles], axis=-1)[..., None, :]  # (..., t, 1, Dh)
    return xp.cos(angles), xp.sin(angles)


class Rotary(Layer):
    """(B, T, (Hq + 2 Hkv) Dh) q | k | v -> the same with q and k rotated by position:
    x' = x cos + rotate_half(x) sin (HF's apply_rotary_pos_emb); v passes through. No
    parameters. token_positions(t): the global positions of the t tokens (a slice, cp's tuple
    of slices, or a (B, t) array while decoding; kv_cache.caching sets it); in a packed
    microbatch (`documents`) each token's position within its document instead, so cos/sin
    are per row (nn.transformer.unit_positions). The angles are taken in float64 and cast to
    the activations' dtype (HF takes them in float32).

    backward  dx = dx' cos - rotate_half(dx' sin)   (rotate_half^T = -rotate_half)
    Both run half by half: x' = cat(x1 c - x2 s, x2 c + x1 s), c, s the angle's cos and sin.
    """

    documents = None           # the rank's nn.documents.Documents (documents.attach)

    def __init__(self, n_q, n_kv, d_head, theta, token_positions=leading_positions):
        super().__init__()
        self.n_rot, self.heads = n_q + n_kv, n_q + 2 * n_kv       # q and k rotate, v not
        self.d_head, self.theta = d_head, float(theta)
        self.token_positions = token_positions

    def __repr__(self):
        return f"Rotary(heads={self.n_rot}, theta={self.theta:g})"

    def _heads(self, a):
        return a.reshape(a.shape[:2] + (self.heads, self.d_head))   # (B, T, heads, Dh)

    def forward(self, a, mb=0, record=True):
        xp, h = nn.array_module(a), self.d_head // 2
        cos, sin = rope_angles(xp, unit_positions(self, a.shape[1], mb), self.d_head,
                               self.theta)        # (T, 1, Dh); packed: (B, T, 1, Dh)
        c = cos[..., :h].astype(a.dtype, copy=False)             # cos/sin = cat(angle, angle):
        s = sin[..., :h].astype(a.dtype, copy=False)             # one half is enough
        x = self._heads(a)[:, :, :self.n_rot]
        y = self._heads(a).copy()
        y[:, :, :self.n_rot, :h] = x[..., :h] * c - x[..., h:] * s   # x cos + rotate_half(x)
        y[:, :, :self.n_rot, h:] = x[..., h:] * c + x[..., :h] * s   # sin, half by half
        self.save(mb, record, (c, s))
        return y.reshape(a.shape)

    def backward(self, dy, mb=0):
        c, s = self.pop(mb)
        h = self.d_head // 2
        g = self._heads(dy)[:, :, :self.n_rot]
        dx = self._heads(dy).copy()
        dx[:, :, :self.n_rot, :h] = g[..., :h] * c + g[..., h:] * s     # undoes the rotation
        dx[:, :, :self.n_rot, h:] = g[..., h:] * c - g[..., :h] * s     # (its transpose)
        return dx.reshape(dy.shape)


def split_qkv(a, n_q, n_kv):
    """(B, T, (Hq + 2 Hkv) Dh) -> q (B, Hq, T, Dh), k and v (B, Hkv, T, Dh) (views)."""
    b, t, width = a.shape
    heads = a.reshape(b, t, n_q + 2 * n_kv, width // (n_q + 2 * n_kv)).transpose(0, 2, 1, 3)
    return heads[:, :n_q], heads[:, n_q:n_q + n_kv], heads[:, n_q + n_kv:]


def merge_qkv(dq, dk, dv):
    """Undo split_qkv: (B, Hq, T, Dh), (B, Hkv, T, Dh) x 2 -> (B, T, (Hq + 2 Hkv) Dh)."""
    xp = nn.array_module(dq)
    return xp.concatenate([att.merge_heads(g) for g in (dq, dk, dv)], axis=-1)


class KVHeads:
    """Which kv head serves each query head: kv_heads[i] for local query head i (default the
    uniform i // (Hq / Hkv), HF's repeat_kv)."""

    def __init__(self, n_q, n_kv, kv_heads=None):
        self.n_q, self.n_kv = n_q, n_kv
        uniform = tuple(i // (n_q // n_kv) for i in range(n_q)) if n_q % n_kv == 0 else None
        self.kv_heads = uniform if kv_heads is None else tuple(kv_heads)
        self.uniform = self.kv_heads == uniform

    def repeat(self, k):
        """(B, Hkv, T, Dh) -> (B, Hq, T, Dh): head i is k's head kv_heads[i]."""
        xp = nn.array_module(k)
        if self.uniform:
            return xp.repeat(k, self.n_q // self.n_kv, axis=1)
        return k[:, list(self.kv_heads)]

    def repeat_backward(self, dk_rep):
        """Undo repeat: each kv head's gradient is the sum over the query heads it served."""
        xp = nn.array_module(dk_rep)
        b, _, t, d = dk_rep.shape
        if self.uniform:
            return dk_rep.reshape(b, self.n_kv, self.n_q // self.n_kv, t, d).sum(axis=2)
        dk = xp.zeros((b, self.n_kv, t, d), dtype=dk_rep.dtype)
        for i, j in enumerate(self.kv_heads):
            dk[:, j] += dk_rep[:, i]
        return dk


class GroupedQueryAttention(Layer):
    """(B, T, (Hq + 2 Hkv) Dh) q | k | v -> (B, T, Hq Dh): causal softmax attention, query
    head i against kv head kv_heads[i] (heads: a KVHeads). No parameters. `cache`: a
    kv_cache.KVCache while decoding; it gets the un-repeated k, v (B, Hkv, t, Dh) when the
    grouping is uniform (repeated ones otherwise: tp with replicated kv heads). `documents`:
    when microbatch mb is packed, a query sees only the keys of its own document (the
    probabilities kept for backward carry that mask). `autocast` (nn/autocast.py): the
    precision of its matmuls (q, k, v rounded and kept so; attention_block's `cast`)."""

    autocast = FULL
    attention_core = True      # what recompute=attn wraps
    documents = None           # the rank's nn.documents.Documents (documents.attach)

    def __init__(self, heads):
        super().__init__()
        self.heads = heads
        self.cache = None

    def __repr__(self):
        return f"GroupedQueryAttention(q={self.heads.n_q}, kv={self.heads.n_kv})"

    def forward(self, a, mb=0, record=True):
        h = self.heads
        q, k, v = split_qkv(a, h.n_q, h.n_kv)
        if self.cache is not None:                                # decoding: no tape
            assert not record, "a KV-cached forward is inference only"
            if not h.uniform:
                k, v = h.repeat(k), h.repeat(v)
            return att.merge_heads(self.cache.attend(self, q, k, v, self.autocast))
        cast = self.autocast
        q, k, v = cast.round(q), h.repeat(cast.round(k)), h.repeat(cast.round(v))  # (B,Hq,T,Dh)
        ids = docs.rows_of(self.documents, mb)                    # packed: (B, T) or None
        visible = None if ids is None else docs.visible(ids, ids)
        out, lse, p = att.causal_attention_forward(q, k, v, keep_probs=True, visible=visible,
                                                   cast=cast)
        self.save(mb, record, (q, k, v, out, None if p is not None else lse, p))  # p, or lse
        return att.merge_heads(out)                               # heads concatenated

    def backward(self, dy, mb=0):
        q, k, v, out, lse, p = self.pop(mb)
        dout = att.merge_heads_backward(dy, self.heads.n_q)       # undoes merge_heads
        dq, dk, dv = att.causal_attention_backward(dout, q, k, v, out, lse, probs=p,
                                                   cast=self.autocast)
        return merge_qkv(dq, self.heads.repeat_backward(dk),     # undoes repeat and
                         self.heads.repeat_backward(dv))          # split_qkv


class RepeatKV(Layer):
    """(B, T, (Hq + 2 Hkv) Dh) -> (B, T, 3 Hq Dh): q | k, v repeated to every query head, the
    input a GPT attention unit (cp's ring or Ulysses) takes. heads: a KVHeads."""

    def __init__(self, heads):
        super().__init__()
        self.heads = heads

    def __repr__(self):
        return f"RepeatKV(q={self.heads.n_q}, kv={self.heads.n_kv})"

    def forward(self, a, mb=0, record=True):
        q, k, v = split_qkv(a, self.heads.n_q, self.heads.n_kv)
        return merge_qkv(q, self.heads.repeat(k), self.heads.repeat(v))

    def backward(self, dy, mb=0):
        q, k, v = split_qkv(dy, self.heads.n_q, self.heads.n_q)
        return merge_qkv(q, self.heads.repeat_backward(k), self.heads.repeat_backward(v))

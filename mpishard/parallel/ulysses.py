"""Ulysses context parallelism (`cp=N,cp_kind=ulysses`): attention on a share of the heads.

all_to_all from sequence-sharded (B, H, T/c, Dh) to head-sharded (B, H/c, T, Dh), the chunks put
back in global order (sequence_split.py), full causal attention on the local heads, then the
inverse. The adjoint of each all_to_all is the inverse all_to_all (here the same exchange with
the roles of the two split axes swapped).
"""
from __future__ import annotations

from ..nn import attention as att
from ..nn import documents as docs
from ..nn.autocast import FULL
from ..nn.functional import array_module
from ..nn.layers import Layer
from .sequence_split import to_global_order, to_rank_order


class UlyssesAttention(Layer):
    """(B, T/c, 3 D_local) -> (B, T/c, D_local) by head-sharded attention: all_to_all to
    (B, H/c, T, Dh) on this rank's heads (sequence in global order), causal attention, and the
    inverse all_to_all back. No parameters; cp: the Comm of the cp group. `documents`
    (nn/documents.py): when microbatch mb is packed, the whole sequence's ids mask the
    attention to each document (every cp peer holds them: no communication). `autocast`
    (nn/autocast.py): the attention's matmul precision (q, k, v rounded and kept so)."""

    autocast = FULL
    attention_core = True      # recompute=attn wraps it like CausalSelfAttention
    documents = None           # the rank's nn.documents.Documents (documents.attach)

    def __init__(self, n_heads, cp):
        super().__init__()
        self.n_heads, self.cp = n_heads, cp
        self.c = cp.mesh.layout.size("cp")
        assert n_heads % self.c == 0, "check_cp refuses heads that do not divide by cp"

    def __repr__(self):
        return f"UlyssesAttention(heads={self.n_heads}, cp={self.c})"

    def to_heads(self, x):
        """(m, B, H, T/c, Dh) sequence-sharded -> (m, B, H/c, T, Dh) head-sharded, global
        order. all_to_all over cp; adjoint: to_sequence."""
        m, b, h, t, d = x.shape
        x = x.reshape(m, b, self.c, h // self.c, t, d).transpose(2, 0, 1, 3, 4, 5)
        x = self.cp.all_to_all(x, axis=0)                # head group j to rank j; (src, m, ...)
        x = x.transpose(1, 2, 3, 0, 4, 5).reshape(m, b, h // self.c, self.c * t, d)
        return to_global_order(x, 3, self.c)             # rank order -> sequence order

    def to_sequence(self, x):
        """Inverse of to_heads: (m, B, H/c, T, Dh) -> (m, B, H, T/c, Dh)."""
        m, b, h, t, d = x.shape
        x = to_rank_order(x, 3, self.c)                  # undoes to_global_order
        x = x.reshape(m, b, h, self.c, t // self.c, d).transpose(3, 0, 1, 2, 4, 5)
        x = self.cp.all_to_all(x, axis=0)                # undoes the all_to_all of to_heads
        return x.transpose(1, 2, 0, 3, 4, 5).reshape(m, b, h * self.c, t // self.c, d)

    def forward(self, a, mb=0, record=True):
        xp = array_module(a)
        q, k, v = self.to_heads(xp.stack(att.split_heads(a, self.n_heads)))   # (B, h, T, Dh)
        ids = docs.rows_of(self.documents, mb)           # packed: (B, T), else None
        visible = None if ids is None else docs.visible(ids, ids)
        cast = self.autocast
        q, k, v = cast.round(q), cast.round(k), cast.round(v)
        out, lse = att.causal_attention_forward(q, k, v, visible=visible, cast=cast)
        self.save(mb, record, (q, k, v, out, lse, ids))  # the ids, not the (B,1,T,T) mask
        return att.merge_heads(self.to_sequence(out[None])[0])

    def backward(self, dy, mb=0):
        q, k, v, out, lse, ids = self.pop(mb)
        xp = array_module(q)
        visible = None if ids is None else docs.visible(ids, ids)   # the forward's mask
        dout = self.to_heads(att.merge_heads_backward(dy, self.n_heads)[None])[0]  # undoes
        dq, dk, dv = att.causal_attention_backward(dout, q, k, v, out, lse,   # the last two
                                                   visible=visible, cast=self.autocast)
        return att.split_heads_backward(*self.to_sequence(xp.stack([dq, dk, dv])))  # 1st two


__all__ = ["UlyssesAttention"]

"""Generic transformer units: the pieces decoder models share (nn/ holds no model's layout).

    LayerNorm            x -> y                      {prefix}/scale, {prefix}/shift
    CausalSelfAttention  q | k | v -> heads' output  (no parameters; the attention core)
    Embedding            tokens (B, T) -> h (B, T, D) embed/tokens, embed/positions
    TiedHead             h -> logits (B, T, V)       embed/tokens^T
    position_rows, add_position_grads: the rows of a learned positions table and their adjoint

Packed rows (nn/documents.py): the units that depend on where a token sits, the attention
core and the embedding's positions, read the rank's `documents` (set by documents.attach);
when a microbatch is packed, attention is block-diagonal causal and positions restart at 0 at
each document, so a packed row computes what its documents compute alone.

Activations are (B, T, features); a Linear treats the leading dims as rows ('bd,df->bf' with
b = B*T). Like nn.layers.Linear, every unit reaches its parameters through the access policy
(`get` before use, `release` after, `add_grad` for the gradient), so FSDP's gather-before-use
and the data-parallel gradient sync compose with these units unchanged. Each unit saves what
its backward needs on its tape per microbatch `mb`.

A model's block builds each projection from a `linear(access, w_name, b_name, role)` factory
(plain_linear here; tensor parallelism passes its column/row units), so the same block serves
every layout.
"""
from __future__ import annotations

from . import attention as att
from . import documents as docs
from . import functional as nn
from .autocast import FULL
from .gemm import is_low
from .layers import Layer, Linear


class LayerNorm(Layer):
    """PyTorch's LayerNorm over the last dim (biased variance, eps 1e-5): x -> y."""

    def __init__(self, access, prefix):
        super().__init__()
        self.access = access
        self.scale, self.shift = f"{prefix}/scale", f"{prefix}/shift"
        self.param_names = (self.scale, self.shift)

    def __repr__(self):
        return f"LayerNorm({self.scale.rsplit('/', 1)[0]})"

    def forward(self, x, mb=0, record=True):
        scale, shift = self.access.get(self.scale, mb), self.access.get(self.shift, mb)
        y, saved = nn.layernorm_forward(x, scale, shift)         # (x - mu) rstd scale + shift
        self.access.release(self.scale, mb)
        self.access.release(self.shift, mb)
        self.save(mb, record, saved)
        return y

    def backward(self, dy, mb=0):
        saved = self.pop(mb)
        scale = self.access.get(self.scale, mb)
        dx, dscale, dshift = nn.layernorm_backward(dy, saved, scale)   # undoes the forward
        self.access.release(self.scale, mb)
        self.access.add_grad(self.scale, dscale)
        self.access.add_grad(self.shift, dshift)
        return dx


class CausalSelfAttention(Layer):
    """(B, T, 3 D_local) q | k | v -> (B, T, D_local): causal softmax attention of `n_heads`
    heads (the local count under tp). No parameters. `cache`: a kv_cache.KVCache while
    decoding (set by kv_cache.caching): the T new positions attend to the cached ones too.
    `documents` (nn/documents.py): when microbatch mb is packed, a query sees only the keys
    of its own document (the probabilities kept for backward carry that mask). `autocast`
    (nn/autocast.py): the policy of its four matmuls (attention.attention_block's `cast`)."""

    autocast = FULL
    attention_core = True      # what recompute=attn wraps (so do cp's ring and Ulysses units)
    documents = None           # the rank's nn.documents.Documents (documents.attach)

    def __init__(self, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.cache = None

    def __repr__(self):
        return f"CausalSelfAttention(heads={self.n_heads})"

    def forward(self, a, mb=0, record=True):
        q, k, v = att.split_heads(a, self.n_heads)               # (B, H, T, Dh) each
        if self.cache is not None:                                # decoding: no tape
            assert not record, "a KV-cached forward is inference only"
            return att.merge_heads(self.cache.attend(self, q, k, v, self.autocast))
        ids = docs.rows_of(self.documents, mb)                    # packed: (B, T) or None
        visible = None if ids is None else docs.visible(ids, ids)
        cast = self.autocast
        q, k, v = cast.round(q), cast.round(k), cast.round(v)    # the 16-bit q, k, v saved
        out, lse, p = att.causal_attention_forward(q, k, v, keep_probs=True,  # softmax(q k^T
                                                   visible=visible,  # / sqrt Dh) v, in docs
                                                   cast=cast)
        self.save(mb, record, (q, k, v, out, None if p is not None else lse, p))  # p, or lse
        #                          (the 16-bit device path recomputes p: attention_block)
        return att.merge_heads(out)                               # heads concatenated

    def backward(self, dy, mb=0):
        q, k, v, out, lse, p = self.pop(mb)
        dout = att.merge_heads_backward(dy, self.n_heads)         # undoes merge_heads
        low = out.dtype if is_low(out) else None                  # cuDNN's: 16-bit grads
        da, into = att.split_heads_grads(q, low)                  # undoes split_heads as
        att.causal_attention_backward(dout, q, k, v, out, lse, into=into, probs=p,  # attn's
                                      cast=self.autocast)
        return da                                                 # undone


def leading_positions(t: int):
    """The positions of a whole sequence's first t tokens: 0 .. t-1."""
    return slice(0, t)


def unit_positions(unit, t: int, mb: int):
    """The positions of the t tokens a unit with `token_positions` and `documents` embeds in
    microbatch mb: token_positions(t), or when mb is packed, the (B, t) positions within their
    documents of those tokens (documents.local_positions)."""
    where = unit.token_positions(t)
    pos = docs.positions_of(unit.documents, mb)
    return where if pos is None else docs.take_positions(pos, where)


def position_rows(pos, where, lo=0, n=None):
    """Rows `where` of a positions table, in the three forms of `token_positions(t)`: a slice
    -> (t, D); a tuple of slices (cp: a rank's two chunks) taken in order -> (t, D); an integer
    array (B, t) of per-row positions (batched decoding with left padding, nn/kv_cache.py)
    -> (B, t, D). lo, n: only tokens lo .. lo + n - 1 of the t (the token axis is -2 in every
    form). Slices stay slices, so no host index meets a device table."""
    if isinstance(where, slice):
        rows = pos[where]
    elif isinstance(where, tuple):
        rows = nn.array_module(pos).concatenate([pos[s] for s in where])
    else:
        rows = nn.embedding_forward(pos, where)              # 'bt -> btd': pos[where]
    return rows if lo == 0 and n is None else rows[..., lo:None if n is None else lo + n, :]


def add_position_grads(dpos, where, dy):
    """Undo position_rows: add dy (B, t, D) into the rows `where` of dpos (slices: the batch
    sum row by row; a (B, t) array: a scatter-add of every row's)."""
    if not isinstance(where, (slice, tuple)):
        dpos += nn.embedding_backward(dy, where, dpos.shape[0])
        return
    g, start = dy.sum(axis=0), 0
    for s in ([where] if isinstance(where, slice) else where):
        stop = start + (s.stop - (s.start or 0))             # contiguous, step 1
        dpos[s] += g[start:stop]
        start = stop


class Embedding(Layer):
    """tokens (B, T) ints -> h = embed/tokens[tokens] + embed/positions[:T]  (B, T, D).

    token_positions(t): the global positions of the t tokens this rank holds (default 0..t-1;
    context parallelism gives its two chunks'; a KV cache per-row (B, t) positions, see
    position_rows). Packed rows (`documents`): each token's position within its document
    instead (unit_positions). The tokens need no gradient: backward returns None."""

    documents = None           # the rank's nn.documents.Documents (documents.attach)

    def __init__(self, access, tokens="embed/tokens", positions="embed/positions",
                 token_positions=leading_positions):
        super().__init__()
        self.access = access
        self.tokens, self.positions = tokens, positions
        self.token_positions = token_positions
        self.param_names = (tokens, positions)

    def __repr__(self):
        return "Embedding"

    def forward(self, ids, mb=0, record=True):
        table, pos = self.access.get(self.tokens, mb), self.access.get(self.positions, mb)
        where = unit_positions(self, ids.shape[1], mb)
        h = nn.embedding_forward(table, ids) + position_rows(pos, where)   # rows, + positions
        self.save(mb, record, (ids, where, table.shape[0], pos.shape[0]))
        self.access.release(self.tokens, mb)
        self.access.release(self.positions, mb)
        return h

    def backward(self, dy, mb=0):
        ids, where, n_tokens, n_positions = self.pop(mb)
        xp = nn.array_module(dy)
        dpos = xp.zeros((n_positions, dy.shape[-1]), dtype=dy.dtype)
        add_position_grads(dpos, where, dy)                       # undoes + positions
        self.access.add_grad(self.tokens, nn.embedding_backward(dy, ids, n_tokens))  # scatter
        self.access.add_grad(self.positions, dpos)
        return None


class TiedHead(Layer):
    """logits = x embed/tokens^T   'bd,vd->bv'  (b = B*T): the head that reuses the token
    embedding. Its gradient adds to the embedding's own (two add_grad calls per backward).
    `autocast` (nn/autocast.py): x, the table and dy rounded before use, the logits, dx and
    the table's gradient after; the tape keeps the rounded x. `low_logits` (a model's own
    head, model_head): a training forward's logits are `cast.kept`, in 16 bits
    under a device's 16-bit compute, for the loss to read as they are."""

    autocast = FULL
    low_logits = False

    def __init__(self, access, w_name="embed/tokens"):
        super().__init__()
        self.access, self.w_name = access, w_name
        self.param_names = (w_name,)

    def __repr__(self):
        return f"TiedHead({self.w_name})"

    def forward(self, x, mb=0, record=True):
        cast = self.autocast
        x, w = cast.round(x), cast.round(self.access.get(self.w_name, mb))
        out = cast.kept if self.low_logits and record else cast.output
        y = out(nn.einsum("bd,vd->bv", x.reshape(-1, x.shape[-1]), w))
        self.access.release(self.w_name, mb)
        self.save(mb, record, x)
        return y.reshape(x.shape[:-1] + (w.shape[0],))

    def backward(self, dy, mb=0):
        x, cast = self.pop(mb), self.autocast
        x2, dy2 = x.reshape(-1, x.shape[-1]), cast.round(dy.reshape(-1, dy.shape[-1]))
        w = cast.round(self.access.get(self.w_name, mb))
        dx = cast.output(nn.einsum("bv,vd->bd", dy2, w))          # undoes 'bd,vd->bv' in x
        self.access.release(self.w_name, mb)
        cast.enter()
        self.access.add_grad(self.w_name, cast.output(nn.einsum("bv,bd->vd", dy2, x2)))  # w
        return dx.reshape(x.shape)


def model_head(access, tied: bool) -> list:
    """A decoder's own head unit: the tied embedding (TiedHead) or head/weights (a Linear),
    handing a training step's logits to the loss as its matmul stores them (`low_logits`:
    16 bits under a device's 16-bit compute); a replacement head (tp's vocab-parallel one)
    widens them as every other matmul output."""
    head = TiedHead(access) if tied else Linear(access, "head/weights")
    head.low_logits = True
    return [head]


def plain_linear(access, w_name, b_name, role) -> list:
    """The projection units without tensor parallelism: one Linear (role unused)."""
    return [Linear(access, w_name, b_name)]

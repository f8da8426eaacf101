"""Context parallelism: the sequence split over the cp group, attention across the split.

Cp rank r holds chunks r and 2c-1-r of the sequence's 2c (sequence_split.py: the balanced
split, every rank the same causal work). Everything outside attention is per token, so
LayerNorm, the projections, the MLP and the head run on the local tokens unchanged; only the
embedding and the rotary need the global positions of its tokens (`token_positions`).
Parameters are replicated on cp: their gradients are averaged over cp like over a data axis
(comm.mesh.AVERAGE_AXES), each rank's loss being the mean over its (equally many) tokens, or
with masked targets its sum over the global count (parallel/token_batch.py).

Ring attention (`cp=N`, `RingAttention`). The local queries stay; the keys and values travel:

    step j = 0 .. c-1: this rank holds the (k, v) block of rank s = r - j (mod c)
      send_async(block) to r+1 / receive_async from r-1   (the next block, while computing)
      for each (query chunk, key chunk) pair not wholly in the future (by global positions):
        out_j, lse_j = attention_block(q_chunk, k_chunk, v_chunk, offset)   scores (B,H,n,n)
        out, lse     = merge_blocks(out, lse, out_j, lse_j)                 online softmax

so no rank holds scores for more than one (n, n) chunk pair: 1/(4 c^2) of single's (T, T).
Backward goes around the ring once more with the final out and lse: dq accumulates locally;
each (k, v) block travels with its (dk, dv) accumulator, every rank adds its share
(attention_block_backward) and passes it on; after the last step the accumulator reaches the
block's home rank. Adjoints: the forward's (k, v) send to r+1 is undone by the (dk, dv) that
travels the same way and arrives home from r-1 (a send's adjoint is the matching receive of
the gradient, summed where the block was used several times).

Packed rows (nn/documents.py): every cp peer holds the same rows' document ids of the whole
sequence, so each (query chunk, key chunk) pair takes its block-diagonal mask from the two
chunks' ids, with no communication; a pair whose queries and keys share no document is
skipped like a future one (exact: its block would add out 0 at lse -inf, and no gradient).

Ulysses (`cp=N,cp_kind=ulysses`): ulysses.py.
"""
from __future__ import annotations

from ..nn import attention as att
from ..nn import documents as docs
from ..nn.autocast import FULL
from ..nn.functional import array_module
from ..nn.layers import Layer
from .sequence_split import (TokenPositions, check_cp_length, chunk_ids, sequence_part,
                             to_global_order)
from .ulysses import UlyssesAttention
from .unit_costs import decoder_stage

FUTURE = "future"
"""pair_offset's answer for a key chunk wholly after the query chunk (skipped)."""


def shard_sequence(arr, mesh):
    """This rank's part of the rows `arr` (B, T, ...) under the DeviceMesh `mesh`: its
    sequence_part over cp; `arr` itself without cp."""
    c = mesh.layout.size("cp")
    return arr if c == 1 else sequence_part(arr, c, mesh.coords["cp"])


def gather_sequence(cp, y):
    """Collective over cp (its Comm): the local (B, T/c, ...) outputs -> (B, T, ...) in global
    order. Adjoint: sequence_part (each rank keeps its own two chunks)."""
    return to_global_order(cp.all_gather(y, axis=1), 1, cp.size())


class SequenceOutput:
    """The engine's output seam under cp around another one (`inner`, e.g. vocab-parallel):
    the loss unchanged (each rank's is the mean over its tokens, or its sum over the global
    count: parallel/token_batch.py), gather_batch also puts the sequence chunks back in order
    over cp (cp: the Comm of the cp group)."""

    def __init__(self, inner, cp):
        self.inner, self.cp = inner, cp

    def loss(self, loss):
        return self.inner.loss(loss)

    def gather(self, y):
        return gather_sequence(self.cp, self.inner.gather(y))


def sequence_output(output, layout, cp):
    """`output` wrapped in a SequenceOutput under cp > 1, else `output` itself."""
    return SequenceOutput(output, cp) if layout.size("cp") > 1 else output


def pair_offset(q0: int, k0: int, n: int):
    """Mask of query chunk [q0, q0+n) against key chunk [k0, k0+n): None (every key in the
    past: no mask), FUTURE (every key after every query: skip), else the causal offset."""
    if k0 + n - 1 <= q0:
        return None
    if k0 > q0 + n - 1:
        return FUTURE
    return q0 - k0


def visible_pairs(r: int, s: int, c: int, n: int) -> list:
    """(query chunk index, key chunk index, offset) of rank r's queries against rank s's keys
    for every pair not wholly in the future (local chunk indices 0, 1)."""
    pairs = []
    for qi, qg in enumerate(chunk_ids(r, c)):
        for ki, kg in enumerate(chunk_ids(s, c)):
            offset = pair_offset(qg * n, kg * n, n)
            if offset != FUTURE:
                pairs.append((qi, ki, offset))
    return pairs


# -- ring attention --------------------------------------------------------------------------------
class RingAttention(Layer):
    """(B, T/c, 3 D_local) q | k | v of this rank's two chunks -> (B, T/c, D_local): causal
    attention of the local queries against the whole sequence's keys, which come around the
    cp ring block by block (see the module docstring). No parameters.

    cp: the Comm of this rank's cp group. `peak_scores`: the largest score block (B, H, n, n)
    this unit has built, in elements (a measurement for tests and reports). `split`, `merge`,
    `expand` and `reduce` are where grouped-query attention (models/llama) differs: its
    (k, v) travel with their kv heads only and are repeated to the query heads per block.
    `documents` (nn/documents.py): when microbatch mb is packed, each chunk pair is masked to
    its documents (module docstring); the forward's ids stay on the tape for the backward.
    `autocast` (nn/autocast.py): each block's matmul precision (q, k, v rounded and kept so;
    the merge and the row sums of the backward in float32).
    """

    autocast = FULL
    attention_core = True      # recompute=attn wraps it like CausalSelfAttention
    documents = None           # the rank's nn.documents.Documents (documents.attach)

    KV, KV_BACK, DKV = 0, 1, 2            # message tags: forward (k, v), backward (k, v), (dk, dv)

    def __init__(self, n_heads, cp):
        super().__init__()
        self.n_heads, self.cp = n_heads, cp
        self.c, self.r = cp.mesh.layout.size("cp"), cp.mesh.coords["cp"]   # no MPI here
        self.next, self.prev = (self.r + 1) % self.c, (self.r - 1) % self.c
        self.peak_scores = 0

    def __repr__(self):
        return f"RingAttention(heads={self.n_heads}, cp={self.c})"

    def split(self, a):                                  # -> q, k, v (B, H, 2n, Dh)
        return att.split_heads(a, self.n_heads)

    def merge(self, dq, dk, dv):                         # undoes split
        return att.split_heads_backward(dq, dk, dv)

    def expand(self, kv_part):                           # k or v as the query heads read it
        return kv_part

    def reduce(self, dkv_part):                          # undoes expand on a gradient
        return dkv_part

    def _pairs(self, step, t_local, ids):
        """Block of step `step` comes from rank s = r - step: (query slice, key slice, causal
        offset, document mask) of its chunk pairs, less those wholly in the future and, in
        packed rows (ids: the rows' (B, T) document ids, else None), those wholly in other
        documents."""
        n = t_local // 2
        s = (self.r - step) % self.c
        pairs = []
        for qi, ki, offset in visible_pairs(self.r, s, self.c, n):
            mask = None
            if ids is not None:                          # the two chunks' ids, global order
                qg, kg = chunk_ids(self.r, self.c)[qi], chunk_ids(s, self.c)[ki]
                mask = docs.visible(ids[:, qg * n:(qg + 1) * n], ids[:, kg * n:(kg + 1) * n])
                if not bool(mask.any()):                 # no shared document: skipped
                    continue
            pairs.append((slice(qi * n, (qi + 1) * n), slice(ki * n, (ki + 1) * n), offset,
                          mask))
        return pairs

    def _attend(self, q, kv, step, state, ids):
        """Merge this block's visible pairs into the running (out, lse) of each query chunk."""
        for qs, ks, offset, mask in self._pairs(step, q.shape[2], ids):
            o, lse = att.attention_block(q[:, :, qs], self.expand(kv[0][:, :, ks]),
                                         self.expand(kv[1][:, :, ks]), offset, visible=mask,
                                         cast=self.autocast)
            b, h, tq, tk = q.shape[0], q.shape[1], qs.stop - qs.start, ks.stop - ks.start
            self.peak_scores = max(self.peak_scores, b * h * tq * tk)   # 'bhtd,bhsd->bhts'
            key = qs.start
            state[key] = (o, lse) if key not in state else att.merge_blocks(*state[key], o, lse)

    def forward(self, a, mb=0, record=True):
        xp = array_module(a)
        cast = self.autocast
        q, k, v = (cast.round(u) for u in self.split(a))  # (B, H, 2n, Dh): chunks r, 2c-1-r
        if q.shape[2] % 2:
            raise ValueError(f"RingAttention: a cp rank holds two equal chunks, got "
                             f"{q.shape[2]} tokens")
        kv, state, sends = xp.stack([k, v]), {}, []      # (2, B, H, 2n, Dh): what travels
        ids = docs.rows_of(self.documents, mb)           # packed: (B, T), else None
        for step in range(self.c):
            if step < self.c - 1:                        # the next block, while computing
                sends.append(self.cp.send_async(kv, self.next, tag=self.KV))
                coming = self.cp.receive_async(self.prev, tag=self.KV)
            self._attend(q, kv, step, state, ids)        # online softmax over the blocks
            if step < self.c - 1:
                kv = coming.result()
        for f in sends:
            f.result()
        out = xp.concatenate([state[key][0] for key in sorted(state)], axis=2)
        lse = xp.concatenate([state[key][1] for key in sorted(state)], axis=2)
        self.save(mb, record, (q, k, v, out, lse, ids))
        return att.merge_heads(out)                      # heads concatenated

    def _attend_backward(self, dout, q, kv, out, lse, step, dq, ids):
        """This rank's share of (dk, dv) for the visiting block; dq accumulated in place."""
        dkv = array_module(q).zeros(kv.shape, dtype=dq.dtype)   # sums in float32, not kv's
        for qs, ks, offset, mask in self._pairs(step, q.shape[2], ids):
            dq_part, dk_part, dv_part = att.attention_block_backward(
                dout[:, :, qs], q[:, :, qs], self.expand(kv[0][:, :, ks]),
                self.expand(kv[1][:, :, ks]), out[:, :, qs], lse[:, :, qs],
                offset, visible=mask, cast=self.autocast)   # undoes attention_block + merge
            dq[:, :, qs] += dq_part
            dkv[0][:, :, ks] += self.reduce(dk_part)     # (and expand)
            dkv[1][:, :, ks] += self.reduce(dv_part)
        return dkv

    def backward(self, dy, mb=0):
        q, k, v, out, lse, ids = self.pop(mb)
        xp = array_module(q)
        dout = att.merge_heads_backward(dy, self.n_heads)   # undoes merge_heads
        dq, kv, sends, arriving = xp.zeros(q.shape, lse.dtype), xp.stack([k, v]), [], None
        # (dq, dk, dv sum in the layer's dtype, lse's: q, k, v may be 16-bit, Narrow)
        for step in range(self.c):
            if step < self.c - 1:                        # (k, v) again, ahead of the compute
                sends.append(self.cp.send_async(kv, self.next, tag=self.KV_BACK))
                coming = self.cp.receive_async(self.prev, tag=self.KV_BACK)
            dkv = self._attend_backward(dout, q, kv, out, lse, step, dq, ids)
            if arriving is not None:                     # the shares of the ranks before
                dkv += arriving.result()
            # adjoint of the forward's (k, v) send: the block's (dk, dv) follows it; after
            # the last step (block r+1) it goes home to r+1
            sends.append(self.cp.send_async(dkv, self.next, tag=self.DKV))
            arriving = self.cp.receive_async(self.prev, tag=self.DKV)
            if step < self.c - 1:
                kv = coming.result()
        dk, dv = arriving.result()                       # this rank's own block, home
        for f in sends:
            f.result()
        return self.merge(dq, dk, dv)                    # undoes split


# -- composition -----------------------------------------------------------------------------------
def check_cp(model, layout) -> None:
    """The same ValueError on every rank, before any communication, for a cp layout this
    decoder cannot run: Ulysses splits the (tp-local) heads over cp."""
    c = layout.size("cp")
    if c > 1 and layout.option("cp_kind", "ring") == "ulysses":
        local = model.n_heads // layout.size("tp")
        if local % c:
            raise ValueError(f"layout {layout.text!r}: cp_kind=ulysses splits the "
                             f"{local} heads per tp rank over cp={c}; they do not divide")


def refuse_cp(layout) -> None:
    """ValueError (the same on every rank) for a cp layout of a model without a sequence."""
    if layout.size("cp") > 1:
        raise ValueError(f"layout {layout.text!r}: cp={layout.size('cp')} splits a sequence; "
                         f"only a decoder (a language model) has one")


def context_units(model, layout, cp) -> dict:
    """Keyword arguments for a decoder's units builder: the attention unit factory and the
    embedding's token positions (cp: the Comm of the cp group; nothing for cp=1)."""
    c = layout.size("cp")
    if c == 1:
        return {}
    cp.mesh.comm("cp")           # the cp communicator (a world Split), made where every rank is
    kind = RingAttention if layout.option("cp_kind", "ring") == "ring" else UlyssesAttention
    return {"attention": lambda n_heads: kind(n_heads, cp),
            "token_positions": TokenPositions(c, cp.mesh.coords["cp"], model.seq_len)}


# -- cost model (no MPI) ---------------------------------------------------------------------------
def ring_bytes(rows: int, t: int, d_local: int, c: int, itemsize: int) -> dict:
    """Bytes one rank sends per attention layer in a ring train_step on `rows` rows of `t`
    tokens (d_local = D / tp, a Llama's kv heads only: the model's kv_width): the (k, v) block is
    (2, rows, t/c, d_local); forward c-1 sends, backward c-1 (k, v) sends and c (dk, dv)."""
    block = 2 * rows * (t // c) * d_local * itemsize
    return {"forward": (c - 1) * block, "backward": (2 * c - 1) * block}


def memory(view, n_state) -> dict:
    """Nothing beyond the base: parameters are replicated on cp, whole on every rank."""
    return {}


def step_comm(view) -> dict:
    """Per block of this rank's stage, per train_step (all microbatches; T = seq_len, the plan
    assumes full-length sequences; d_local = D / tp): the ring's sends (`ring_bytes`), or
    Ulysses' all_to_alls, (c-1)/c of the moved array each: forward q|k|v (3 x tokens x d_local)
    to heads and the output (1 x) back, backward the output's gradient (1 x) to heads and
    dq|dk|dv (3 x) back. recompute=1 runs the forward ones again in the backward. The gradient
    average over cp is data_parallel's (cp is an averaging axis)."""
    c = view.size("cp")
    if c == 1:
        return {}
    check_cp_length(view.model.seq_len, c)
    stage = decoder_stage(view)
    d_local = view.model.d_model // view.size("tp")
    if view.layout.option("cp_kind", "ring") == "ring":
        ring = ring_bytes(view.rows, view.model.seq_len, view.model.kv_width(view.size("tp")),
                          c, view.itemsize)
        per_block = stage.forwards * ring["forward"] + ring["backward"]
        return {"train_step": {"send": stage.blocks * per_block}}
    moved = (c - 1) / c * stage.tokens * d_local * view.itemsize
    per_block = 4 * stage.forwards * moved + 4 * moved
    return {"train_step": {"all_to_all": stage.blocks * per_block}}

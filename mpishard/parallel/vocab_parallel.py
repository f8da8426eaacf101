"""Vocab-parallel embedding, head and cross-entropy (Megatron), for a GPT under tp.

With t = tp ranks and v = ceil(V / t), tp rank r holds rows r*v:(r+1)*v of `embed/tokens`
(V, D) and columns r*v:(r+1)*v of `head/weights` (D, V) (a tied head: the same embed/tokens
rows, transposed). No rank ever holds the full (B, T, V) logits in training:

    embedding   partial = rows of the ids in [r v, (r+1) v), zeros for the others   (B, T, D)
                h = all-reduce(sum) over tp (partial) + positions[:T]
                  (sequence_parallel: reduce-scatter(sum) along T instead, + this rank's
                   positions; each rank keeps (B, T/t, D))
    head        logits_local = x W[:, r v:(r+1) v]   'bd,dv->bv'     (B, T, v)
    loss        m   = all-reduce(max) of the local row max            (B, T)
                se  = all-reduce(sum) of sum_v exp(logits_local - m)  (B, T)
                tgt = all-reduce(sum) of the target logit - m (0 where the target is
                      another rank's)                                 (B, T)
                loss = mean(log se - tgt);  dL/dlogits_local = (softmax_local - onehot_local)
                / (B T), computed from the reduced m and se with no further communication,
                in place in the one logits-sized array exp(logits_local - m) was written to

Vocabulary padding. A V that t does not divide (GPT-2's 50,257) is padded to t v inside the
placements (`VOCAB_TP_SHARDS`: padded Shard steps, placement.py): the last ranks' blocks end in
zero rows of embed/tokens and zero columns of head/weights, which shard_array fills in on load
and gather_array / checkpoints trim, so model.vocab_size, gather_params, gather_grads and
checkpoints stay V. No id reaches a padded row, so its embedding gradient is zero; the loss
masks the padded logits to -inf (exp 0: they change neither m, se nor any other gradient, and
their own is 0), so the padded head columns get zero gradient too; zero gradients and zero
parameters stay zero under SGD and AdamW (decay of 0 is 0, m = v = 0 gives no step). The
multiple is t itself, not Megatron's 128 t: the rows pad for divisibility only (numpy/cupy
matmuls gain nothing from a 128-wide block here), and it keeps test models tiny (V = 97 at
tp = 4 pads 3 rows, not 415).

`VocabParallelOutput` is the seam to the engine: `loss(loss)` swaps the user's CrossEntropy
for the vocab-parallel one over this rank's tp Comm (other losses are refused), and
`gather(y)` all-gathers the vocab shards, less the padding, so `gather_batch(predict(x))` is
(B, T, V) on every rank. `ReplicatedOutput` is the same seam when the output is whole on every
rank.
"""
from __future__ import annotations

import copy

from ..nn import functional as nn
from ..nn.layers import Layer
from ..nn.losses import CrossEntropy, Loss
from ..nn.transformer import add_position_grads, leading_positions, position_rows, unit_positions
from .placement import Shard

# the vocabulary's tp split, padded to a multiple of tp (the module docstring); any
# transformer plan's table (decoder.plan_decoder_params) takes these for these names
VOCAB_TP_SHARDS = {"embed/tokens": (Shard("tp", 0, pad=True),),
                   "head/weights": (Shard("tp", 1, pad=True),)}


def vocab_width(vocab: int, n: int) -> int:
    """v: columns of the logits (rows of embed/tokens) per tp rank, padding included."""
    return -(-vocab // n)


class VocabParallelEmbedding(Layer):
    """ids (B, T) -> h (B, T, D), or (B, T/t, D) with `sequence_parallel`: vocab-parallel
    token rows + replicated positions. tp: the Comm of this rank's tp group; token_positions:
    as nn.transformer.Embedding's (context parallelism: the global positions of its tokens);
    packed rows (`documents`): positions within each document, as Embedding's (with
    sequence_parallel, rows lo .. lo + n - 1 of them: this rank's tokens).

    The ids need no gradient: backward returns None."""

    documents = None           # the rank's nn.documents.Documents (documents.attach)

    def __init__(self, access, tp, sequence_parallel=False, tokens="embed/tokens",
                 positions="embed/positions", token_positions=leading_positions):
        super().__init__()
        self.access, self.tp, self.sp = access, tp, bool(sequence_parallel)
        self.token_positions = token_positions
        self.tokens, self.positions = tokens, positions
        self.param_names = (tokens, positions)

    def __repr__(self):
        return f"VocabParallelEmbedding(sp={int(self.sp)})"

    def _local_ids(self, ids, rows: int):
        """(ids - r v clipped into this rank's rows, mask (B, T, 1) of the ids it holds)."""
        xp = nn.array_module(ids)
        local = ids - self.tp.rank() * rows
        inside = (local >= 0) & (local < rows)
        return xp.where(inside, local, 0), inside[..., None]

    def forward(self, ids, mb=0, record=True):
        t, n = ids.shape[1], self.tp.size()
        if self.sp and t % n:
            raise ValueError(f"sequence_parallel: T={t} tokens do not divide by tp={n}")
        table, pos = self.access.get(self.tokens, mb), self.access.get(self.positions, mb)
        local, inside = self._local_ids(ids, table.shape[0])
        partial = nn.embedding_forward(table, local) * inside      # (B, T, D), 0 elsewhere
        if self.sp:                      # reduce-scatter forward / all-gather backward
            h = self.tp.reduce_scatter(partial, op="sum", axis=1)   # (B, T/t, D)
            lo = self.tp.rank() * h.shape[1]
        else:                            # all-reduce(sum) forward / identity backward
            h, lo = self.tp.all_reduce(partial, op="sum"), 0
        where = unit_positions(self, t, mb)
        h = h + position_rows(pos, where, lo, h.shape[1])          # + positions
        self.access.release(self.tokens, mb)
        self.access.release(self.positions, mb)
        self.save(mb, record, (local, inside, table.shape[0], pos.shape[0], lo, t, where))
        return h

    def backward(self, dy, mb=0):
        local, inside, rows, n_positions, lo, t, where = self.pop(mb)
        xp = nn.array_module(dy)
        dpos = xp.zeros((n_positions, dy.shape[-1]), dtype=dy.dtype)
        part = dy
        if self.sp:              # this rank's tokens lo .. lo + n - 1 of the t; the rest add 0
            part = xp.zeros(dy.shape[:1] + (t,) + dy.shape[2:], dtype=dy.dtype)
            part[:, lo:lo + dy.shape[1]] = dy
        add_position_grads(dpos, where, part)                      # undoes + positions
        if self.sp:
            dy = self.tp.all_gather(dy, axis=1)                    # undoes the reduce-scatter
        # the all-reduce's adjoint is the identity: dy is dL/dpartial on every rank
        self.access.add_grad(self.tokens, nn.embedding_backward(dy * inside, local, rows))
        self.access.add_grad(self.positions, dpos)
        return None


class VocabParallelCrossEntropy(Loss):
    """CrossEntropy on vocab-sharded logits (B, T, v) with global integer targets (B, T):
    the token-mean loss and its gradient, reducing max, sum-exp and target logit over tp.
    A target equal to `full.ignore_index` counts nowhere, as in nn.losses.CrossEntropy, and
    `over(n)` divides by n instead of the counted targets (the global-token mean).

    vocab: the full V; sequence_parallel: T must divide by tp (checked with the targets);
    full: the user's CrossEntropy (its ignore_index and denominator)."""

    name = "cross_entropy"

    def __init__(self, tp, vocab: int, sequence_parallel=False, full=None):
        self.tp, self.vocab, self.sp = tp, vocab, bool(sequence_parallel)
        self.full = full if full is not None else CrossEntropy()
        self.seen_shapes: list = []      # logits shapes this loss was called on (tests)

    def counted(self, t) -> int:
        return self.full.counted(t)

    def over(self, denominator: float) -> "VocabParallelCrossEntropy":
        out = copy.copy(self)
        out.full = self.full.over(denominator)
        return out

    def check(self, y, t):
        """Targets against the full (B, T, V) output shape (a stand-in is enough)."""
        self.full.check(y, t)
        n = self.tp.size()
        if self.sp and t.ndim == 2 and t.shape[1] % n:
            raise ValueError(f"sequence_parallel: T={t.shape[1]} tokens do not divide by "
                             f"tp={n}")

    def __call__(self, y, t):
        """(global token-mean loss, dL/dy_local); y: this rank's (B, T, v) vocab shard, the
        padded columns (global index >= V) masked to -inf. One logits-sized array beside y:
        exp(y - m) turned into the gradient in place."""
        value, g, se, idx, inside, keep, n = self._forward(y, t)
        xp = nn.array_module(y)
        g /= se[..., None]                                          # softmax, local columns
        flat = g.reshape(-1, g.shape[-1])                           # (B T, v), a view
        flat[xp.arange(flat.shape[0]), idx.reshape(-1)] -= inside.reshape(-1)  # - onehot
        g /= n                                                      # d mean / d logits
        if keep is not None:
            g[~keep] = 0                                            # 0 on ignored targets
        return value, g

    def value(self, y, t) -> float:
        """The global token-mean loss alone: the forward of __call__, no gradient arrays
        (evaluation)."""
        return self._forward(y, t)[0]

    def _forward(self, y, t):
        """(loss, exp(y - m) in a new array, se, the target's local column, whether it is
        local, the counted targets' mask or None when all count, the divisor)."""
        n, v = self.tp.size(), y.shape[-1]
        if v != vocab_width(self.vocab, n) or y.ndim != 3:
            raise ValueError(f"vocab-parallel cross_entropy expects (B, T, "
                             f"{vocab_width(self.vocab, n)}) logits on each of tp={n} ranks, "
                             f"got {tuple(y.shape)}")
        self.seen_shapes.append(tuple(y.shape))
        xp = nn.array_module(y)
        real = self.vocab - self.tp.rank() * v                      # this rank's real columns
        z = xp.where(xp.arange(v) < real, y, -xp.inf) if real < v else y.copy()  # exp(-inf)
        m = self.tp.all_reduce(z.max(axis=-1), op="max")            # global row max (B, T)
        z -= m[..., None]                                           # z = y - m
        local = t - self.tp.rank() * v                              # an ignored target (-100)
        inside = (local >= 0) & (local < v)                         # is no rank's column
        idx = xp.where(inside, local, 0)[..., None]
        tgt_local = xp.where(inside, xp.take_along_axis(z, idx, axis=-1)[..., 0], 0.0)
        e = xp.exp(z, out=z)                                        # in place: exp(y - m)
        se = self.tp.all_reduce(e.sum(axis=-1), op="sum")           # global sum-exp (B, T)
        tgt = self.tp.all_reduce(tgt_local, op="sum")               # target logit - m
        keep = t != self.full.ignore_index
        divisor = self.full.divisor(t)
        if bool(keep.all()):
            keep = None
            value = float((xp.log(se) - tgt).sum() / divisor)       # -log softmax[t], mean
        else:                                     # an ignored row adds 0, whatever its logits
            value = float(xp.where(keep, xp.log(se) - tgt, 0).sum() / divisor)
        return value, e, se, idx, inside, keep, divisor


class VocabParallelOutput:
    """The engine's loss and gather_batch for vocab-sharded outputs (module docstring)."""

    def __init__(self, tp, vocab: int, sequence_parallel=False):
        self.tp, self.vocab, self.sp = tp, vocab, bool(sequence_parallel)

    def loss(self, loss):
        """The vocab-parallel form of `loss` (ValueError for anything but cross-entropy:
        the same on every rank, before any communication)."""
        if isinstance(loss, VocabParallelCrossEntropy):
            return loss
        if not isinstance(loss, CrossEntropy):
            raise ValueError(f"a GPT under tp={self.tp.size()} trains with cross_entropy only "
                             f"(its logits are split over the vocabulary), got {loss.name}")
        return VocabParallelCrossEntropy(self.tp, self.vocab, self.sp, full=loss)

    def gather(self, y):
        """(B, T, v) vocab shards -> (B, T, V): all-gather along the last axis, the padded
        columns dropped (adjoint: a reduce-scatter; used only for outputs, which need no
        gradient)."""
        return None if y is None else self.tp.all_gather(y, axis=-1)[..., :self.vocab]


class ReplicatedOutput:
    """Outputs whole on every rank: the loss and gather_batch unchanged."""

    def loss(self, loss):
        return loss

    def gather(self, y):
        return y


# -- cost model (no MPI): bytes per train_step, read by decoder_tensor_parallel.step_comm -------
def embedding_comm(view, tokens: int) -> dict:
    """The vocab-parallel embedding of `tokens` tokens (all microbatches) over tp = t ranks:
    the forward all_reduce(sum) of the partial (B, T, D), 2(t-1)/t of it; with
    sequence_parallel the forward reduce-scatter along T and the backward all-gather of dy,
    (t-1)/t of it each."""
    t, act = view.size("tp"), tokens * view.model.d_model * view.itemsize
    if view.layout.option("sequence_parallel", 0):
        return {"reduce_scatter": (t - 1) / t * act, "all_gather": (t - 1) / t * act}
    return {"all_reduce": view.all_reduce_bytes("tp", act)}


def loss_comm(view, tokens: int) -> dict:
    """VocabParallelCrossEntropy on `tokens` tokens: three all_reduces of (B, T) over tp (the
    row max, the sum of exponentials, the target logit). The predict-time gather of the
    vocab shards is not part of a train_step."""
    return {"all_reduce": 3 * view.all_reduce_bytes("tp", tokens * view.itemsize)}

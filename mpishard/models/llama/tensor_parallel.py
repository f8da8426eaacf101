"""A Llama under `tp` (Megatron) and `tp=N,sequence_parallel=1`: placements and units.

With t = tp ranks, H query heads, K kv heads and g = H / K, tp rank r computes query heads
r H/t .. (r+1) H/t - 1 and holds

    embed/tokens       (V, D)      rows r V/t ...           Shard('tp', 0)  vocab-parallel
    attn/q/weights     (D, H Dh)   its query heads' columns Shard('tp', 1)  column
    attn/k, v/weights  (D, K Dh)   K % t == 0: kv heads r K/t ... (exactly those its query
                                   heads use)               Shard('tp', 1)  column
                                   otherwise replicated: every kv head, of which its query
                                   head i uses (r H/t + i) // g
    attn/proj/weights  (H Dh, D)   rows of its heads        Shard('tp', 0)  row
    mlp/gate, up       (D, F)      columns r F/t ...        Shard('tp', 1)  column
    mlp/down/weights   (F, D)      rows r F/t ...           Shard('tp', 0)  row
    head/weights       (D, V)      columns r V/t ...        Shard('tp', 1)  vocab-parallel
    RMSNorm scales     replicated

Replicated kv weights are used by every tp rank for its own query heads only: the forward is
a broadcast of the weight to the tp ranks and its adjoint the sum of their gradients, one
all_reduce(sum) over tp per gradient (sequence_parallel.SequenceParallelGrads does exactly
that for the spec's tp_replicated_params; with sequence_parallel the RMSNorm scales join
them, as the GPT's LayerNorms do). The dL/dx of the shared input is summed over tp by f
(CopyToTP's backward, or GatherFromSP's reduce-scatter) like every column layer's.

Units per block: Residual[RMSNorm, f, FusedLinear(q, k, v column), Rotary, GroupedQueryAttention,
proj row + g], Residual[RMSNorm, f, FusedLinear(gate, up column), SwiGLU, down row + g], with the
decoders' f/g (parallel/decoder_tensor_parallel.tp_linear). The embedding, head and loss are
vocab-parallel.
"""
from __future__ import annotations

from ...nn import functional as nn
from ...nn.transformer import TiedHead, leading_positions
from ...parallel.decoder_tensor_parallel import sequence_split_params, tp_linear
from ...parallel.placement import Shard
from ...parallel.sequence_parallel import GatherFromSP, SequenceParallelGrads, split_grads_comm
from ...parallel.tensor_parallel import ColumnParallelLinear, CopyToTP
from ...parallel.vocab_parallel import VocabParallelEmbedding
from .attention import KVHeads
from .units import llama_units

COLUMN, ROW = (Shard("tp", 1),), (Shard("tp", 0),)
TP_SHARDS = {"embed/tokens": ROW, "attn/q/weights": COLUMN, "attn/proj/weights": ROW,
             "mlp/gate/weights": COLUMN, "mlp/up/weights": COLUMN, "mlp/down/weights": ROW,
             "head/weights": COLUMN}
KV_WEIGHTS = ("attn/k/weights", "attn/v/weights")


def kv_split(model, t: int) -> bool:
    """Whether the kv heads split over tp = t ranks (else each rank holds all of them)."""
    return model.n_kv_heads % t == 0


def tp_table(model, t: int) -> dict:
    """The Llama's {name suffix: tp steps of its placement} for tp = t ranks (the spec's
    `tp_table`, which a Llama-derived spec extends for its own parameters)."""
    return dict(TP_SHARDS, **{w: COLUMN for w in KV_WEIGHTS if kv_split(model, t)})


def tp_shards(table: dict):
    """name -> the tp steps of its placement from a suffix table (() = replicated on tp)."""
    def shards(name: str) -> tuple:
        return next((s for suffix, s in table.items() if name.endswith(suffix)), ())
    return shards


def replicated_kv_params(model, t: int) -> list:
    """The kv weights replicated on tp (their gradients are summed over tp): all of them when
    t does not divide the kv heads, else none."""
    if kv_split(model, t):
        return []
    return [n for n in model.param_shapes() if n.endswith(KV_WEIGHTS)]


def kv_width(model, t: int) -> int:
    """Columns of k (and of v) per tp rank (t ranks): its local kv heads x Dh (all K of them
    when t does not divide K). A cp ring sends this much of each
    (context_parallel.ring_bytes)."""
    return (model.n_kv_heads // t if kv_split(model, t) else model.n_kv_heads) * model.d_head


def local_heads(model, t: int, r: int) -> KVHeads:
    """The query heads of tp rank r and the kv head (local index) each one uses."""
    n_q = model.n_heads // t
    if kv_split(model, t):
        return KVHeads(n_q, model.n_kv_heads // t)
    group = model.n_heads // model.n_kv_heads
    return KVHeads(n_q, model.n_kv_heads, [(r * n_q + i) // group for i in range(n_q)])


class VocabParallelTokens(VocabParallelEmbedding):
    """ids (B, T) -> h (B, T, D) (or (B, T/t, D) with sequence_parallel): the vocab-parallel
    token rows of VocabParallelEmbedding, without position rows (a Llama's positions are
    rotary). Forward: partial rows, all_reduce(sum) over tp (reduce_scatter along T with
    sequence_parallel); adjoint: the identity (all_gather along T)."""

    def __init__(self, access, tp, sequence_parallel=False):
        super().__init__(access, tp, sequence_parallel)
        self.param_names = (self.tokens,)

    def __repr__(self):
        return f"VocabParallelTokens(sp={int(self.sp)})"

    def forward(self, ids, mb=0, record=True):
        t, n = ids.shape[1], self.tp.size()
        if self.sp and t % n:
            raise ValueError(f"sequence_parallel: T={t} tokens do not divide by tp={n}")
        table = self.access.get(self.tokens, mb)
        local, inside = self._local_ids(ids, table.shape[0])
        partial = nn.embedding_forward(table, local) * inside      # (B, T, D), 0 elsewhere
        self.access.release(self.tokens, mb)
        self.save(mb, record, (local, inside, table.shape[0]))
        if self.sp:
            return self.tp.reduce_scatter(partial, op="sum", axis=1)   # (B, T/t, D)
        return self.tp.all_reduce(partial, op="sum")

    def backward(self, dy, mb=0):
        local, inside, rows = self.pop(mb)
        if self.sp:
            dy = self.tp.all_gather(dy, axis=1)                    # undoes the reduce-scatter
        # the all-reduce's adjoint is the identity: dy is dL/dpartial on every rank
        self.access.add_grad(self.tokens, nn.embedding_backward(dy * inside, local, rows))
        return None


class LlamaTensorParallel:
    """Builds a stage's Llama units under tp (the `units` builder of decoder_chunks)."""

    def __init__(self, tp, sequence_parallel: bool):
        self.tp, self.sp = tp, bool(sequence_parallel)
        self.n = tp.size()

    def __call__(self, model, access, blocks, first: bool, last: bool, attention=None,
                 token_positions=leading_positions) -> list:
        """attention, token_positions: as llama_units' (context parallelism sets both)."""
        summed = model.tp_replicated_params(self.n) + \
            (sequence_split_params(model) if self.sp else [])
        if summed:                  # replicated on tp, each rank's use partial: sum the grads
            access = SequenceParallelGrads(access, self.tp, summed)
        f = GatherFromSP(self.tp) if self.sp else CopyToTP(self.tp)
        head = [f, TiedHead(access) if model.tied else
                ColumnParallelLinear(access, "head/weights")]
        return llama_units(model, access, blocks, first, last, attention, token_positions,
                           linear=tp_linear(self.tp, self.sp),
                           heads=local_heads(model, self.n, self.tp.rank()),
                           embedding=VocabParallelTokens(access, self.tp, self.sp),
                           head=head)


# -- cost model (no MPI): what a Llama adds to the decoders' tp pricing (costs.py) --------------
def step_comm(view) -> dict:
    """The all_reduce(sum) over tp of each replicated kv weight's gradient this rank holds,
    per microbatch (SequenceParallelGrads; everything else a Llama sends under tp is the
    decoders' f, g, vocab-parallel embedding and loss: decoder_tensor_parallel.step_comm)."""
    if view.size("tp") == 1:
        return {}
    return {"train_step": split_grads_comm(view, view.model.tp_replicated_params(
        view.size("tp")))}

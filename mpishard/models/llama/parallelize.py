"""A Llama (and a Mixtral) on the mesh: where its parameters live and which units this rank
runs.

Everything but the tp table is a decoder's (parallel/decoder.py): the blocks are the pipeline's
layers (stage balancing, `stages=`, interleaved and zero-bubble schedules), the embedding lives
with block 0 and rms_f + head with the last block (a tied Llama under pp: the tied copies,
parallel/tied.py), FSDP ZeRO-3 splits every parameter along dim 0, zero=1/2 and dp keep them
replicated, cp replicates them and the layout checks are check_decoder_layout's.

Tensor parallelism (tp, sequence_parallel) is tensor_parallel.py: each parameter's tp split
(the spec's `tp_table`) comes first in its placement, then fsdp's.

A Mixtral (n_experts set) adds expert parallelism inside the blocks: experts.py.

Context parallelism: cp's ring (context_parallel.RingAttention) in its grouped form, whose
(k, v) blocks travel around the ring with the kv heads only (H/K times fewer bytes than
repeated ones) and are repeated to the query heads per block, their gradients summed back
over each group (KVHeads.repeat_backward, the adjoint of the repeat) before they travel
home; Ulysses after RepeatKV (its all_to_all splits the query heads over cp).
"""
from __future__ import annotations

from ...nn.transformer import leading_positions
from ...parallel.compose import RankUnits, layer_stages
from ...parallel.context_parallel import RingAttention
from ...parallel.decoder import build_decoder, check_decoder_layout, plan_decoder_params
from ...parallel.vocab_parallel import ReplicatedOutput, VocabParallelOutput
from .attention import RepeatKV, merge_qkv, split_qkv
from .experts import attach_experts, plan_moe_llama_params
from .tensor_parallel import LlamaTensorParallel, tp_shards
from .units import llama_units


def plan_params(model, layout) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every Llama parameter (a decoder's plan
    with the spec's tp_table); ValueError (the same on every rank) for a layout it cannot
    run."""
    vstages = layer_stages(model, layout)
    shards = tp_shards(model.tp_table(layout.size("tp")))
    if model.n_experts is not None:                 # Mixtral: experts split over ep
        return plan_moe_llama_params(model, layout, vstages, shards)
    if layout.size("ep") > 1:
        raise ValueError(f"layout {layout.text!r}: ep={layout.size('ep')} splits experts; "
                         f"{model!r} has none (ms.Llama(..., n_experts=E))")
    check_decoder_layout(model, layout)
    return plan_decoder_params(model, layout, vstages, shards)


def build(model, layout, comm, access, stats: dict) -> RankUnits:
    """This rank's chunks, the output seam (tp: vocab-parallel) and, for a Mixtral, its
    experts' exchange over ep with the load-balancing loss hook (or None)."""
    units, output = llama_units_and_output(model, layout, comm)
    chunks, output = build_decoder(model, layout, comm, access, layer_stages(model, layout),
                                   units, output)
    aux = attach_experts(chunks, model, layout, comm, stats) if model.n_experts else None
    return RankUnits(chunks, output, aux)


def llama_units_and_output(model, layout, comm):
    """(units builder for decoder.decoder_chunks, the engine's output seam) for this layout;
    comm: the engine's Comm."""
    if layout.size("tp") == 1:
        return GroupedContext(llama_units), ReplicatedOutput()
    tp, sp = comm.group("tp"), bool(layout.option("sequence_parallel", 0))
    return (GroupedContext(LlamaTensorParallel(tp, sp)),
            VocabParallelOutput(tp, model.vocab_size, sp))


class GroupedRingAttention(RingAttention):
    """Ring attention on (B, T/c, (Hq + 2 Hkv) Dh) q | k | v (heads: a KVHeads): the (k, v)
    that travel are (2, B, Hkv, 2n, Dh); each block is repeated to the Hq query heads where
    it is used, and its gradient reduced back over the group before it travels on."""

    def __init__(self, heads, cp):
        super().__init__(heads.n_q, cp)
        self.heads = heads

    def __repr__(self):
        return f"GroupedRingAttention(q={self.heads.n_q}, kv={self.heads.n_kv}, cp={self.c})"

    def split(self, a):
        return split_qkv(a, self.heads.n_q, self.heads.n_kv)

    def merge(self, dq, dk, dv):
        return merge_qkv(dq, dk, dv)

    def expand(self, kv_part):
        return self.heads.repeat(kv_part)

    def reduce(self, dkv_part):
        return self.heads.repeat_backward(dkv_part)


class GroupedContext:
    """A Llama units builder (llama_units, LlamaTensorParallel) fed cp's attention factory
    (n_heads -> unit, context_parallel.context_units) as a block's (KVHeads -> units): the
    grouped ring, or RepeatKV then Ulysses."""

    def __init__(self, build):
        self.build = build

    def __call__(self, model, access, blocks, first: bool, last: bool, attention=None,
                 token_positions=leading_positions) -> list:
        grouped = None
        if attention is not None:
            def grouped(heads):
                unit = attention(heads.n_q)
                if isinstance(unit, RingAttention):
                    return [GroupedRingAttention(heads, unit.cp)]
                return [RepeatKV(heads), unit]
        return self.build(model, access, blocks, first, last, grouped, token_positions)

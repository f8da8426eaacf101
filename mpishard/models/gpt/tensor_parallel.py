"""A GPT under `tp` (Megatron) and `tp=N,sequence_parallel=1`: its splits and units.

With t = tp ranks, tp rank r computes heads r*H/t:(r+1)*H/t and holds (the contract's q|k|v
layout makes the qkv split blocked, placement.Shard(..., blocks=3); v = ceil(V/t), the
vocabulary padded to a multiple of t: parallel/vocab_parallel.py):

    embed/tokens      (V, D)   rows r*v...             Shard('tp', 0, pad)   vocab-parallel
    embed/positions   (S, D)   replicated
    attn/qkv/weights  (D, 3D)  [q_r | k_r | v_r]       Shard('tp', 1, blocks=3)  column
    attn/qkv/bias     (3D,)    [q_r | k_r | v_r]       Shard('tp', 0, blocks=3)
    attn/proj/weights (D, D)   rows of its heads       Shard('tp', 0)   row
    mlp/fc/weights    (D, F)   columns r*F/t...        Shard('tp', 1)   column (bias dim 0)
    mlp/proj/weights  (F, D)   rows r*F/t...           Shard('tp', 0)   row
    head/weights      (D, V)   columns r*v...          Shard('tp', 1, pad)   vocab-parallel
    LayerNorms, row biases     replicated

Units per block: Residual[LayerNorm, f, qkv column, CausalSelfAttention(H/t), proj row + g],
Residual[LayerNorm, f, fc column, GELU, proj row + g]; f/g and the checks every decoder shares
are parallel/decoder_tensor_parallel.py's. The embedding and the head are vocab-parallel.
"""
from __future__ import annotations

from ...nn.transformer import CausalSelfAttention, TiedHead, leading_positions
from ...parallel.decoder_tensor_parallel import sequence_split_params, tp_linear
from ...parallel.placement import Shard
from ...parallel.sequence_parallel import GatherFromSP, SequenceParallelGrads
from ...parallel.tensor_parallel import ColumnParallelLinear, CopyToTP
from ...parallel.vocab_parallel import (VOCAB_TP_SHARDS, ReplicatedOutput, VocabParallelEmbedding,
                                        VocabParallelOutput)
from .units import Block, FinalNormHead, gpt_units

# parameter name suffix -> its split on the tp axis (anything else is replicated on tp)
TP_SHARDS = {
    **VOCAB_TP_SHARDS,
    "attn/qkv/weights": (Shard("tp", 1, blocks=3),),
    "attn/qkv/bias": (Shard("tp", 0, blocks=3),),
    "attn/proj/weights": (Shard("tp", 0),),
    "mlp/fc/weights": (Shard("tp", 1),),
    "mlp/fc/bias": (Shard("tp", 0),),
    "mlp/proj/weights": (Shard("tp", 0),),
}


def gpt_tp_shards(name: str) -> tuple:
    """The tp steps of parameter `name`'s placement (() = replicated on tp)."""
    for suffix, shards in TP_SHARDS.items():
        if name.endswith(suffix):
            return shards
    return ()


class GPTTensorParallel:
    """Builds a stage's GPT units under tp (the `units` builder of decoder.decoder_chunks)."""

    def __init__(self, tp, sequence_parallel: bool):
        self.tp, self.sp = tp, bool(sequence_parallel)
        self.n = tp.size()

    def __call__(self, model, access, blocks, first: bool, last: bool,
                 attention=CausalSelfAttention, token_positions=leading_positions) -> list:
        """attention, token_positions: as gpt_units' (context parallelism sets both)."""
        if self.sp:                  # used on this rank's sequence part only: partial grads
            access = SequenceParallelGrads(access, self.tp, sequence_split_params(model))
        linear = tp_linear(self.tp, self.sp)
        units = [VocabParallelEmbedding(access, self.tp, self.sp,
                                        token_positions=token_positions)] if first else []
        units += [Block(access, i, model.n_heads // self.n, linear=linear, attention=attention)
                  for i in blocks]
        if last:
            f = GatherFromSP(self.tp) if self.sp else CopyToTP(self.tp)
            head = TiedHead(access) if model.tied else \
                ColumnParallelLinear(access, "head/weights")
            units.append(FinalNormHead(access, model.tied, head=[f, head]))
        return units


def gpt_units_and_output(model, layout, comm):
    """(units builder for decoder_chunks, the engine's output seam) for this layout; comm: the
    engine's Comm."""
    if layout.size("tp") == 1:
        return gpt_units, ReplicatedOutput()
    tp, sp = comm.group("tp"), bool(layout.option("sequence_parallel", 0))
    return GPTTensorParallel(tp, sp), VocabParallelOutput(tp, model.vocab_size, sp)

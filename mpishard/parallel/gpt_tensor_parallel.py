"""A GPT under `tp` (Megatron) and `tp=N,sequence_parallel=1`: placements and units.

With t = tp ranks, tp rank r computes heads r*H/t:(r+1)*H/t and holds (the contract's q|k|v
layout makes the qkv split blocked, placement.Shard(..., blocks=3); v = ceil(V/t), the
vocabulary padded to a multiple of t: vocab_parallel.py):

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
Residual[LayerNorm, f, fc column, GELU, proj row + g]; f/g are CopyToTP / ReduceFromTP, or
with sequence_parallel GatherFromSP / ScatterToSP (sequence_parallel.py). The embedding and
the head are vocab-parallel (vocab_parallel.py); the logits stay (B, T, V/t) and the engine's
loss becomes VocabParallelCrossEntropy through VocabParallelOutput.
"""
from __future__ import annotations

from collections import Counter

from ..nn.transformer import (Block, CausalSelfAttention, FinalNormHead, TiedHead, gpt_units,
                              leading_positions)
from .model_costs import gpt_stage, is_gpt, local_tokens, tp_sublayers
from .placement import Shard
from .sequence_parallel import (GatherFromSP, SequenceParallelGrads, SequenceParallelRowLinear,
                                operator_comm, split_grads_comm)
from .tensor_parallel import ColumnParallelLinear, CopyToTP, RowParallelLinear
from .vocab_parallel import (VOCAB_TP_SHARDS, ReplicatedOutput, VocabParallelEmbedding,
                             VocabParallelOutput, embedding_comm, loss_comm)

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


def check_gpt_tp(model, layout) -> None:
    """tp must divide the heads and d_ff (the same ValueError on every rank, before any
    communication); the vocabulary is padded instead (vocab_parallel.py)."""
    tp = layout.size("tp")
    if tp == 1:
        return
    for what, n in (("n_heads", model.n_heads), ("d_ff", model.d_ff)):
        if n % tp:
            raise ValueError(f"layout {layout.text!r}: tp={tp} does not divide the "
                             f"{type(model).__name__}'s {what}={n} (Megatron splits it over "
                             f"the tp ranks)")


def sequence_split_params(model) -> list:
    """Parameters whose gradient is a partial sum per tp rank under sequence_parallel: the
    LayerNorms' and the positions (the row biases' gradients come from the gathered dy)."""
    return [n for n in model.param_shapes()
            if n.endswith(("/scale", "/shift")) or n == "embed/positions"]


def tp_linear(tp, sequence_parallel: bool):
    """The `linear` factory of Block: column layers behind f, row layers with g inside."""
    def linear(access, w_name, b_name, role) -> list:
        if role == "column":
            f = GatherFromSP(tp) if sequence_parallel else CopyToTP(tp)
            return [f, ColumnParallelLinear(access, w_name, b_name)]
        if sequence_parallel:
            return [SequenceParallelRowLinear(tp, access, w_name, b_name)]
        return [RowParallelLinear(tp, access, w_name, b_name)]
    return linear


class GPTTensorParallel:
    """Builds a stage's GPT units under tp (the `units` builder of gpt.gpt_chunks)."""

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
    """(units builder for gpt_chunks, the engine's output seam) for this layout; comm: the
    engine's Comm."""
    if layout.size("tp") == 1:
        return gpt_units, ReplicatedOutput()
    tp, sp = comm.group("tp"), bool(layout.option("sequence_parallel", 0))
    return GPTTensorParallel(tp, sp), VocabParallelOutput(tp, model.vocab_size, sp)


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def memory(view, n_state) -> dict:
    """Nothing beyond the base: the placements already split the Megatron and vocab blocks."""
    return {}


def step_comm(view) -> dict:
    """A GPT rank's tp traffic per train_step, over its stage's units, with act = its tokens
    (all microbatches, T = seq_len / cp each) x D x itemsize, one (B, T, D) activation:

    - f before each column layer (qkv, fc; and the head): CopyToTP's backward all_reduce of
      dL/dx; g after each row layer (attn proj, mlp proj): ReduceFromTP's forward all_reduce,
      once more per block under recompute=1 (the forward runs again in the backward);
    - sequence_parallel: f = GatherFromSP, g = ScatterToSP, an all-gather and a
      reduce-scatter each (both forward ones again under recompute=1), plus the all_reduce of
      the LayerNorm and position gradients (sequence_parallel.split_grads_comm);
    - the vocab-parallel embedding (first stage) and loss (last stage): vocab_parallel.py.

    (The MLP's tp is tensor_parallel.step_comm.)"""
    t = view.size("tp")
    if t == 1 or not is_gpt(view.model):
        return {}
    stage, units = gpt_stage(view), tp_sublayers(view.model)    # a Mixtral's MLP: not on tp
    act = stage.tokens * view.model.d_model * view.itemsize
    sent = Counter()
    if view.layout.option("sequence_parallel", 0):
        check_sequence_split(view.model, view.layout)
        # per block 2 f + 2 g (1 + 1 in a Mixtral), each an all-gather and a reduce-scatter
        # (f's forward and g's forward again under recompute=1); the head's f once
        calls = units * stage.blocks * (stage.forwards + 1) + stage.last
        sent.update(operator_comm(view, act, gathers=calls, scatters=calls))
        sent.update(split_grads_comm(view, sequence_split_params(view.model)))
    else:
        calls = units * stage.blocks + stage.last + units * stage.blocks * stage.forwards
        sent.update(all_reduce=calls * view.all_reduce_bytes("tp", act))
    if stage.first:
        sent.update(embedding_comm(view, stage.tokens))
    if stage.last:
        sent.update(loss_comm(view, stage.tokens))
    return {"train_step": dict(sent)}


def check_sequence_split(model, layout) -> None:
    """ValueError unless sequence_parallel can split a rank's seq_len / cp tokens over tp."""
    t, tokens = layout.size("tp"), local_tokens(model, layout)
    if tokens % t:
        raise ValueError(f"layout {layout.text!r}: sequence_parallel splits the {tokens} tokens "
                         f"of a rank (seq_len {model.seq_len} / cp) over tp={t}; they do not "
                         f"divide")

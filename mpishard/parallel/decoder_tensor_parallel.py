"""A decoder under `tp` (Megatron) and `tp=N,sequence_parallel=1`: what every decoder shares.

With t = tp ranks, tp rank r computes heads r*H/t:(r+1)*H/t, the column projections' columns
and the row projections' rows of its part of d_ff; the vocabulary is padded to a multiple of t
and split (vocab_parallel.py). Each model's table of splits and its units builder sit in its
folder (models/<name>/tensor_parallel.py); here are the pieces they share:

    check_heads_tp          tp must divide the heads and d_ff
    tp_linear               the projections' factory: f + column layer, row layer + g
    sequence_split_params   the norms' (and positions') gradients, partial under sequence_parallel

f/g are CopyToTP / ReduceFromTP, or with sequence_parallel GatherFromSP / ScatterToSP
(sequence_parallel.py). The embedding and the head are vocab-parallel (vocab_parallel.py); the
logits stay (B, T, V/t) and the engine's loss becomes VocabParallelCrossEntropy through
VocabParallelOutput.
"""
from __future__ import annotations

from collections import Counter

from .unit_costs import decoder_stage, local_tokens
from .sequence_parallel import (GatherFromSP, SequenceParallelRowLinear, operator_comm,
                                split_grads_comm)
from .tensor_parallel import ColumnParallelLinear, CopyToTP, RowParallelLinear
from .vocab_parallel import embedding_comm, loss_comm


def check_heads_tp(model, layout) -> None:
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
    """The `linear` factory of a decoder block: column layers behind f, row layers with g
    inside."""
    def linear(access, w_name, b_name, role) -> list:
        if role == "column":
            f = GatherFromSP(tp) if sequence_parallel else CopyToTP(tp)
            return [f, ColumnParallelLinear(access, w_name, b_name)]
        if sequence_parallel:
            return [SequenceParallelRowLinear(tp, access, w_name, b_name)]
        return [RowParallelLinear(tp, access, w_name, b_name)]
    return linear


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def memory(view, n_state) -> dict:
    """Nothing beyond the base: the placements already split the Megatron and vocab blocks."""
    return {}


def step_comm(view, sublayers: int = 2) -> dict:
    """A decoder rank's tp traffic per train_step, over its stage's units, with act = its
    tokens (all microbatches, T = seq_len / cp each) x D x itemsize, one (B, T, D) activation,
    and `sublayers` split blocks per block (the attention and the MLP, or the attention alone
    where the MLP is not on tp):

    - f before each column layer (qkv, fc; and the head): CopyToTP's backward all_reduce of
      dL/dx; g after each row layer (attn proj, mlp proj): ReduceFromTP's forward all_reduce,
      once more per block under recompute=1 (the forward runs again in the backward);
    - sequence_parallel: f = GatherFromSP, g = ScatterToSP, an all-gather and a
      reduce-scatter each (both forward ones again under recompute=1), plus the all_reduce of
      the LayerNorm and position gradients (sequence_parallel.split_grads_comm);
    - the vocab-parallel embedding (first stage) and loss (last stage): vocab_parallel.py.

    (The MLP's tp is tensor_parallel.step_comm.)"""
    t = view.size("tp")
    if t == 1:
        return {}
    stage, units = decoder_stage(view), sublayers
    act = stage.tokens * view.model.d_model * view.itemsize
    sent = Counter()
    if view.layout.option("sequence_parallel", 0):
        check_sequence_split(view.model, view.layout)
        # per block 2 f + 2 g (1 + 1 with the attention alone), each an all-gather and a
        # reduce-scatter (f's forward and g's forward again under recompute=1); the head's f
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


def step_calls(view, sublayers: int = 2) -> Counter:
    """The calls behind step_comm's bytes, per microbatch: f and g one all_reduce each (g
    again per recomputed forward), the vocab-parallel embedding one, the vocab-parallel loss
    three; under sequence_parallel f and g an all_gather and a reduce_scatter each, and one
    all_reduce per norm or position gradient held."""
    t, m = view.size("tp"), view.microbatches
    if t == 1:
        return Counter()
    stage, units = decoder_stage(view), sublayers
    out = Counter(all_reduce=3 * m * stage.last)                      # the vocab-parallel loss
    if view.layout.option("sequence_parallel", 0):
        sp = units * stage.blocks * (stage.forwards + 1) + stage.last + stage.first
        split = sum(1 for n in sequence_split_params(view.model) if n in view.params)
        out.update(all_gather=m * sp, reduce_scatter=m * sp, all_reduce=m * split)
    else:
        out.update(all_reduce=m * (units * stage.blocks * (1 + stage.forwards) + stage.last
                                   + stage.first))
    return out


def check_sequence_split(model, layout) -> None:
    """ValueError unless sequence_parallel can split a rank's seq_len / cp tokens over tp."""
    t, tokens = layout.size("tp"), local_tokens(model, layout)
    if tokens % t:
        raise ValueError(f"layout {layout.text!r}: sequence_parallel splits the {tokens} tokens "
                         f"of a rank (seq_len {model.seq_len} / cp) over tp={t}; they do not "
                         f"divide")

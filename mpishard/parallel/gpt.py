"""A GPT on the mesh: where its parameters live and which units this rank runs (no MPI).

Pipeline: the blocks are the pipeline's layers (stages.assign_stages balances them by
parameter count, or `stages=` gives the counts); the embedding lives with block 0 on virtual
stage 0 and ln_f + head with the last block on the last virtual stage. FSDP (zero=3) splits
every parameter along dim 0 like an MLP's; zero=1/2 and dp keep them replicated.

Tensor parallelism (tp, sequence_parallel) is gpt_tensor_parallel.py: each parameter's tp
split comes first in its placement, then fsdp's; `units` builds the tp units.

Context parallelism (cp, ring or Ulysses) is context_parallel.py: the attention unit and the
embedding's token positions (`context`), parameters replicated on cp.

A tied GPT (tied=True) under pp holds embed/tokens on the first stage and a copy on the
last (its placement's tied_stages), for TiedHead; tied.py sums their gradients (Megatron).

Not yet: ep raises a ValueError.
"""
from __future__ import annotations

from ..nn.transformer import gpt_units
from . import placement as pl
from .context_parallel import check_cp
from .gpt_tensor_parallel import check_gpt_tp, gpt_tp_shards
from .tied import tied_stages
from .vocab_parallel import VOCAB_TP_SHARDS

UNSUPPORTED_AXES = ("ep",)


def check_gpt_layout(model, layout) -> None:
    """Raise the same ValueError on every rank for a layout this GPT (or Llama: the messages
    name the model's class) cannot run yet."""
    for axis in UNSUPPORTED_AXES:
        if layout.sizes.get(axis, 1) > 1:
            raise ValueError(f"layout {layout.text!r}: {axis}={layout.sizes[axis]} is not yet "
                             f"supported for {type(model).__name__} models (dp, fsdp, tp and "
                             f"pp are)")
    check_gpt_tp(model, layout)
    check_cp(model, layout)


def check_decode(layout) -> None:
    """ValueError unless this layout's GPT units decode with a KV cache (nn/kv_cache.py): not
    under cp (ring/Ulysses attention cut the sequence) nor sequence_parallel (one new token
    cannot be split along T over tp)."""
    if layout.size("cp") > 1:
        raise ValueError(f"layout {layout.text!r}: no KV cache under cp={layout.size('cp')} "
                         f"(its attention is split along the sequence)")
    if layout.size("tp") > 1 and layout.option("sequence_parallel", 0):
        raise ValueError(f"layout {layout.text!r}: no KV cache with sequence_parallel (one new "
                         f"token cannot be split along the sequence over tp)")


def gpt_param_stages(model, vstages: list) -> dict:
    """name -> virtual stage: embed/* with block 0, block i at vstages[i], ln_f and head with
    the last block."""
    where = {name: vstages[0] for name in model.embed_param_shapes()}
    for spec in model.layers():
        where.update({name: vstages[spec.index] for name in spec.param_shapes})
    where.update({name: vstages[-1] for name in model.head_param_shapes()})
    return where


def plan_gpt_params(model, layout, vstages: list, tp_shards=gpt_tp_shards) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every GPT parameter (see plan_params).
    tp_shards: name -> its tp steps (another transformer spec passes its own table); a tied
    model's embed/tokens also lives on the head's stage (tied.py)."""
    check_gpt_layout(model, layout)
    return plan_transformer_params(model, layout, vstages, tp_shards)


def plan_transformer_params(model, layout, vstages: list, tp_shards) -> dict:
    """The plan of any spec with the GPT's spec API (embed/*, block specs, head), checks done:
    tp steps (the vocabulary's padded split for embed/tokens and head/weights, whatever the
    table says: vocab_parallel.py), then fsdp's (zero=3), on the stage of gpt_param_stages
    (tied copies added)."""
    pp = layout.size("pp")
    zero3 = layout.size("fsdp") > 1 and layout.option("zero", 3) == 3
    fsdp = (pl.Shard("fsdp", 0, pad=True),) if zero3 else ()
    tp = layout.size("tp") > 1
    stages = gpt_param_stages(model, vstages)
    head = vstages[-1] % pp
    return {name: pl.ParamInfo(name, tuple(shape), pl.Placement(
                (VOCAB_TP_SHARDS.get(name) or tp_shards(name) if tp else ()) + fsdp,
                stage=stages[name] % pp,
                tied_stages=tied_stages(model, name, stages[name] % pp, head)))
            for name, shape in model.param_shapes().items()}


def gpt_chunks(model, vstages: list, pp: int, stage: int, access, units=gpt_units,
               context=None) -> list:
    """The units of pipeline stage `stage`, one list per virtual stage it holds (units: the
    builder, gpt_units or a tp one from gpt_tensor_parallel; context: its attention and
    token_positions keywords under cp, context_parallel.context_units)."""
    last = vstages[-1]
    chunks = []
    for k in range(stage, last + 1, pp):
        blocks = [i for i, s in enumerate(vstages) if s == k]
        chunks.append(units(model, access, blocks, first=k == 0, last=k == last,
                            **(context or {})))
    return chunks

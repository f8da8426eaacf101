"""A decoder on the mesh: the plan and the pipeline chunks every decoder spec shares (no MPI).

A decoder spec (a models/<name> spec with embed/*, block specs and a head: GPT, Llama, ...)
answers embed_param_shapes(), layers() (its blocks), head_param_shapes(), n_heads, d_ff,
seq_len and tied; its folder gives the tp table (name -> tp steps) and the units builder.

Pipeline: the blocks are the pipeline's layers (stages.assign_stages balances them by
parameter count, or `stages=` gives the counts); the embedding lives with block 0 on virtual
stage 0 and the final norm + head with the last block on the last virtual stage. FSDP
(zero=3) splits every parameter along dim 0 like an MLP's; zero=1/2 and dp keep them
replicated.

Tensor parallelism: each parameter's tp split (the model's table; the vocabulary's padded
split for embed/tokens and head/weights: vocab_parallel.py) comes first in its placement,
then fsdp's. Context parallelism (cp) is context_parallel.py (ring), ulysses.py and
sequence_split.py: the attention unit and the embedding's token positions, parameters
replicated on cp.

A tied decoder (tied=True) under pp holds embed/tokens on the first stage and a copy on the
last (its placement's tied_stages), for the tied head; tied.py sums their gradients (Megatron).
"""
from __future__ import annotations

from . import placement as pl
from .context_parallel import check_cp, context_units, sequence_output
from .decoder_tensor_parallel import check_heads_tp
from .tied import tied_stages
from .vocab_parallel import VOCAB_TP_SHARDS

UNSUPPORTED_AXES = ("ep",)


def check_decoder_layout(model, layout) -> None:
    """Raise the same ValueError on every rank for a layout this dense decoder cannot run yet
    (the messages name the model's class)."""
    for axis in UNSUPPORTED_AXES:
        if layout.sizes.get(axis, 1) > 1:
            raise ValueError(f"layout {layout.text!r}: {axis}={layout.sizes[axis]} is not yet "
                             f"supported for {type(model).__name__} models (dp, fsdp, tp and "
                             f"pp are)")
    check_heads_tp(model, layout)
    check_cp(model, layout)


def check_decode(layout) -> None:
    """ValueError unless this layout's decoder units decode with a KV cache (nn/kv_cache.py):
    not under cp (ring/Ulysses attention cut the sequence) nor sequence_parallel (one new
    token cannot be split along T over tp)."""
    if layout.size("cp") > 1:
        raise ValueError(f"layout {layout.text!r}: no KV cache under cp={layout.size('cp')} "
                         f"(its attention is split along the sequence)")
    if layout.size("tp") > 1 and layout.option("sequence_parallel", 0):
        raise ValueError(f"layout {layout.text!r}: no KV cache with sequence_parallel (one new "
                         f"token cannot be split along the sequence over tp)")


def decoder_param_stages(model, vstages: list) -> dict:
    """name -> virtual stage: embed/* with block 0, block i at vstages[i], the final norm and
    head with the last block."""
    where = {name: vstages[0] for name in model.embed_param_shapes()}
    for spec in model.layers():
        where.update({name: vstages[spec.index] for name in spec.param_shapes})
    where.update({name: vstages[-1] for name in model.head_param_shapes()})
    return where


def plan_decoder_params(model, layout, vstages: list, tp_shards) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every parameter of a decoder spec, checks
    done: tp steps (the vocabulary's padded split for embed/tokens and head/weights, whatever
    the table says: vocab_parallel.py; tp_shards: name -> its tp steps), then fsdp's (zero=3),
    on the stage of decoder_param_stages (tied copies added)."""
    pp = layout.size("pp")
    zero3 = layout.size("fsdp") > 1 and layout.option("zero", 3) == 3
    fsdp = (pl.Shard("fsdp", 0, pad=True),) if zero3 else ()
    tp = layout.size("tp") > 1
    stages = decoder_param_stages(model, vstages)
    head = vstages[-1] % pp
    return {name: pl.ParamInfo(name, tuple(shape), pl.Placement(
                (VOCAB_TP_SHARDS.get(name) or tp_shards(name) if tp else ()) + fsdp,
                stage=stages[name] % pp,
                tied_stages=tied_stages(model.tied, name, stages[name] % pp, head)))
            for name, shape in model.param_shapes().items()}


def decoder_chunks(model, vstages: list, pp: int, stage: int, access, units,
                   context=None) -> list:
    """The units of pipeline stage `stage`, one list per virtual stage it holds (units: the
    model's builder (model, access, blocks, first, last, **context); context: its attention
    and token_positions keywords under cp, context_parallel.context_units)."""
    last = vstages[-1]
    chunks = []
    for k in range(stage, last + 1, pp):
        blocks = [i for i, s in enumerate(vstages) if s == k]
        chunks.append(units(model, access, blocks, first=k == 0, last=k == last,
                            **(context or {})))
    return chunks


def build_decoder(model, layout, comm, access, vstages: list, units, output):
    """(this rank's chunks, the output seam) of a decoder: `units` and `output` are the
    model's units builder and output seam for this layout (tp: vocab-parallel logits, loss and
    gather_batch); cp puts the sequence's chunks back in order and brings its attention and
    token positions."""
    output = sequence_output(output, layout, comm.group("cp"))
    chunks = decoder_chunks(model, vstages, layout.size("pp"), comm.mesh.coords["pp"], access,
                            units, context_units(model, layout, comm.group("cp")))
    return chunks, output

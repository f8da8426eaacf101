"""An MLP on the mesh: where its parameters live and which units this rank runs.

tp pairs the layers Megatron-style (tensor_parallel.tp_role: column, row, column, ...): a
column layer behind CopyToTP, a row layer with its all-reduce inside; pp cuts between layers
(stages.assign_stages); fsdp with zero=3 splits every parameter along dim 0 (padded), zero=1/2
keep them replicated and shard only gradients and optimizer state (fsdp.gradient_layout).
An MLP has no sequence (no cp) and no experts (no ep).
"""
from __future__ import annotations

from ...nn.activation_layer import Activation
from ...nn.layers import Layer, Linear
from ...parallel import placement as pl
from ...parallel.compose import RankUnits, layer_stages
from ...parallel.context_parallel import refuse_cp
from ...parallel.tensor_parallel import (ColumnParallelLinear, CopyToTP, RowParallelLinear,
                                         check_tp, tp_role, tp_shards)
from ...parallel.vocab_parallel import ReplicatedOutput


def refuse_ep(model, layout) -> None:
    """ValueError for an ep layout: expert parallelism needs a model with experts."""
    ep = layout.size("ep")
    if ep > 1:
        raise ValueError(f"layout ep={ep} needs an ms.MoE model, got {model!r}; expert "
                         f"parallelism splits the experts of a mixture-of-experts layer")


def plan_params(model, layout) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every MLP parameter; ValueError (the same
    on every rank) for a layout it cannot run."""
    refuse_cp(layout)
    refuse_ep(model, layout)
    tp, pp, fsdp = layout.size("tp"), layout.size("pp"), layout.size("fsdp")
    layers = model.layers()
    if tp > 1:
        check_tp(layers, tp)
    vstages = layer_stages(model, layout)
    plan = {}
    for spec in layers:
        role = tp_role(spec.index, len(layers)) if tp > 1 else "replicated"
        for pname, shape in spec.param_shapes.items():
            kind = pname.rsplit("/", 1)[1]
            shards = tp_shards(role, kind) if tp > 1 else ()
            if fsdp > 1 and layout.option("zero", 3) == 3:
                # ZeRO-3 shards the parameter itself; ZeRO-1/2 keep it replicated on fsdp and
                # shard only gradients/optimizer state (fsdp.gradient_layout)
                shards = shards + (pl.Shard("fsdp", 0, pad=True),)
            plan[pname] = pl.ParamInfo(pname, tuple(shape),
                                       pl.Placement(shards, stage=vstages[spec.index] % pp))
    return plan


def build(model, layout, comm, access, stats: dict) -> RankUnits:
    """This rank's chunks of layers; the output is replicated, no auxiliary loss."""
    return RankUnits(stage_layers(model, layout, comm.mesh.coords["pp"], access,
                                  comm.group("tp")), ReplicatedOutput())


def stage_layers(model, layout, stage: int, access, tp) -> list:
    """The layers of pipeline stage `stage`: one list per virtual stage it holds (pp=1: one
    list). tp: the Comm of this rank's tp group."""
    pp = layout.size("pp")
    vstages = layer_stages(model, layout)
    chunks = [[] for _ in range(max(vstages) // pp + 1 if pp > 1 else 1)]
    layers = model.layers()
    for spec in layers:
        k = vstages[spec.index]
        if k % pp == stage:
            chunks[k // pp].extend(linear_layers(spec, len(layers), layout.size("tp"),
                                                 access, tp))
    return chunks


def linear_layers(spec, n_layers: int, tp_size: int, access, tp) -> list:
    """One MLP layer as units: [CopyToTP] Linear-kind [Activation]."""
    w = f"{spec.prefix}/weights"
    b = f"{spec.prefix}/bias" if spec.bias else None
    need_dx = spec.index > 0       # the model input needs no gradient
    out: list[Layer] = []
    role = tp_role(spec.index, n_layers) if tp_size > 1 else "replicated"
    if role == "column":
        if need_dx:
            out.append(CopyToTP(tp))                   # f: identity fwd / all-reduce bwd
        out.append(ColumnParallelLinear(access, w, b, need_dx))
    elif role == "row":
        out.append(RowParallelLinear(tp, access, w, b, need_dx))   # g inside: ReduceFromTP
    else:
        out.append(Linear(access, w, b, need_dx))
    if spec.activation != "identity":
        out.append(Activation(spec.activation))
    return out

"""compose: from (model, layout) to the engine's parts, one strategy at a time.

An engine is a pipeline of stages of layers (`pp=1` is a pipeline of one stage). `compose`
builds this rank's part of it in the order the strategies stack:

1. plan (no MPI): each parameter's Placement: its tp split (tensor_parallel.tp_shards), its pp
   stage (stages.assign_stages) and its fsdp split (padded, dim 0); expert ownership for
   an ms.MoE (expert_parallel.plan_moe_params), a Mixtral's experts split over ep
   (moe_transformer.py). `inspect` and checkpoints use the same plan.
2. store: this rank's parameter and gradient blocks (ZeRO-1/2 shard gradients on fsdp even
   where parameters are replicated: fsdp.gradient_layout).
3. gradient sync: bucketed all_reduce(avg) over the data axes a gradient is replicated on
   (data_parallel.GradientSync); fsdp averages its own axis inside its access policy; a tied
   embedding's copies on the first and last pp stage sum their gradients (tied.py).
4. access policy: local blocks, or FSDP's gather-before-use / reduce-scatter-after.
5. layers of this rank's stage(s): tp pairs as CopyToTP + column Linear, row Linear +
   ReduceFromTP; plain Linear otherwise; the MoE layer under ep; a GPT's Embedding, Blocks
   and FinalNormHead (gpt.py: plan and units).
6. runner: Sequential for pp=1, the pipeline executor over the pp group otherwise.

Collaborators get the smallest object they need: a group's Comm, the store, a callback or a
flag computed here; none of them sees the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..comm.mesh import DATA_AXES
from ..nn.activations import TapeMeter, meter_tapes
from ..nn.layers import Activation, Layer, Linear, LocalAccess, Sequential
from ..nn.recompute import recompute_chunks
from . import placement as pl
from .context_parallel import context_units, sequence_output
from .data_parallel import DEFAULT_BUCKET_MB, GradientSync
from .expert_parallel import build_moe_chunks, plan_moe_params
from .fsdp import FSDPAccess, gradient_layout
from .gpt import gpt_chunks, plan_gpt_params
from .gpt_tensor_parallel import gpt_units_and_output
from .llama import llama_units_and_output, plan_llama_params
from .moe_transformer import AuxLossPipeline, AuxLossRunner, attach_experts
from .pipeline import PipelineRunner
from .precision import Precision
from .stages import assign_stages
from .store import ParamStore
from .tensor_parallel import (ColumnParallelLinear, CopyToTP, RowParallelLinear, check_tp,
                              tp_role, tp_shards)
from .tied import tie_gradients
from .vocab_parallel import ReplicatedOutput


# -- planning (no MPI) -------------------------------------------------------------------------
def layer_stages(model, layout) -> list:
    """Virtual-stage index of each layer (pp * virtual_stages of them; rank stage k % pp)."""
    if layout.size("pp") == 1:
        return [0] * model.n_layers
    return assign_stages(model, layout)


def uses_moe(model, layout) -> bool:
    """Expert-parallel composition: an ms.MoE model, or a layout with an ep axis (which
    expert_parallel refuses for anything but a MoE)."""
    return getattr(model, "kind", "mlp") == "moe" or layout.size("ep") > 1


# a transformer spec's kind -> (its plan, its (units builder, output seam)); gpt.gpt_chunks
# builds either one's pipeline chunks
TRANSFORMERS = {"gpt": (plan_gpt_params, gpt_units_and_output),
                "llama": (plan_llama_params, llama_units_and_output)}


def is_gpt(model) -> bool:
    """A transformer spec (ms.GPT or ms.Llama): token ids in, (B, T, V) logits out."""
    return getattr(model, "kind", "mlp") in TRANSFORMERS


def plan_params(model, layout) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every parameter of `model` under `layout`
    (a comm.mesh.Layout: strings are parsed once, where they enter, by parse_layout).

    Raises ValueError (identically on every rank, before any communication) when the layout
    does not fit the model.
    """
    if is_gpt(model):
        return TRANSFORMERS[model.kind][0](model, layout, layer_stages(model, layout))
    if layout.size("cp") > 1:
        raise ValueError(f"layout {layout.text!r}: cp={layout.size('cp')} splits a sequence; "
                         f"only ms.GPT and ms.Llama models have one")
    if uses_moe(model, layout):
        return plan_moe_params(model, layout)
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


# -- the parts ---------------------------------------------------------------------------------
@dataclass
class EngineParts:
    """What compose builds for one rank; the engine holds these and nothing else."""

    plan: dict                       # name -> ParamInfo
    store: ParamStore                # local parameter and gradient blocks
    grad_sync: GradientSync          # data-parallel gradient averaging
    access: object                   # LocalAccess or FSDPAccess
    chunks: list                     # this rank's layers, one list per virtual stage
    runner: object                   # Sequential or PipelineRunner
    stats: dict = field(default_factory=dict)   # measurements of the last step
    meter: object = None             # nn.activations.TapeMeter: bytes on the activation tapes
    output: object = field(default_factory=ReplicatedOutput)   # the loss and gather_batch


def compose(model, layout, comm, dtype, precision=None) -> EngineParts:
    """This rank's parts of the engine for `model` under `layout` (the engine's parsed Layout;
    comm: the engine's Comm; precision: a precision.Precision, default all `dtype`).

    Raises ValueError on every rank, before any communication, when the layout does not fit.
    """
    mesh = comm.mesh
    plan = plan_params(model, layout)                               # 1. tp, pp, fsdp splits
    placements = {n: info.placement for n, info in plan.items()}
    grad_placements, exempt = dict(placements), {}
    fsdp = layout.size("fsdp") > 1
    if fsdp:
        grad_placements, exempt = gradient_layout(placements)
    precision = precision or Precision(dtype)
    store = ParamStore(plan, grad_placements, layout, mesh.coords, comm.xp,   # 2.
                       precision.param, grad_dtype=dtype)
    sync_comm = precision.wrap_comm(comm)         # 16-bit gradient/fsdp traffic, fp32 sums
    moe, pp = uses_moe(model, layout), layout.size("pp")
    # overlap needs each gradient final after one add_grad: not so under fsdp, ep or pp, nor
    # for a tied GPT (embed/tokens gets the embedding's and the head's gradient)
    overlap_possible = not (fsdp or moe or pp > 1 or getattr(model, "tied", False))
    grad_sync = GradientSync(store, sync_comm, exempt, overlap_possible,  # 3. data axes
                             bucket_mb=layout.option("bucket_mb", DEFAULT_BUCKET_MB))
    grad_sync = tie_gradients(grad_sync, plan, comm.group("pp"), mesh.coords["pp"])  # tied
    access = (FSDPAccess(store, sync_comm.group("fsdp"), grad_sync.on_grad_ready) if fsdp
              else LocalAccess(store, grad_sync.on_grad_ready))     # 4. fsdp or local
    access = precision.wrap_access(access)      # 16-bit parameters: fp32 math (precision.py)
    stats: dict = {}
    output, aux = ReplicatedOutput(), None
    if is_gpt(model):                 # tp: vocab-parallel logits, loss and gather_batch
        units, output = TRANSFORMERS[model.kind][1](model, layout, comm)
        output = sequence_output(output, layout, comm.group("cp"))   # cp: chunks in order
        chunks = gpt_chunks(model, layer_stages(model, layout), pp, mesh.coords["pp"], access,
                            units, context_units(model, layout, comm.group("cp")))
        if getattr(model, "n_experts", None):                       # Mixtral: ep exchange
            aux = attach_experts(chunks, model, layout, comm, stats)
    elif moe:                                                       # 5. layers (ep, tp)
        chunks = build_moe_chunks(model, access, comm, stats)
    else:
        chunks = stage_layers(model, layout, mesh.coords["pp"], access, comm.group("tp"))
    chunks = recompute_chunks(model, chunks, layout.option("recompute"), layout.text)
    if getattr(access, "prefetcher", None) is not None:             # fsdp prefetch=1
        access.prefetcher.install(chunks)
    meter = TapeMeter()                 # activation bytes on the layers' tapes (memory_report)
    meter_tapes(chunks, meter)
    if pp > 1:                                                      # 6. pp
        # Group communicators are made by a world-wide Split on first use; inside a pipeline
        # ranks reach their first tp/pp call at different times, so make them all here,
        # where every rank is at the same line.
        for axis in layout.active_axes:
            mesh.comm(axis)
        mesh.comm(DATA_AXES)
        runner = PipelineRunner(chunks, layout, comm.group("pp"), stats)
        if aux is not None:                   # Mixtral's load-balancing loss (gpipe only)
            runner = AuxLossPipeline(runner, aux)
    else:
        runner = Sequential(chunks[0])
        if aux is not None:                   # Mixtral's load-balancing loss
            runner = AuxLossRunner(runner, aux)
    return EngineParts(plan, store, grad_sync, access, chunks, runner, stats, meter, output)


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

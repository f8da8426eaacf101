"""compose: from (model, layout) to the engine's parts, one strategy at a time.

An engine is a pipeline of stages of layers (`pp=1` is a pipeline of one stage). `compose`
builds this rank's part of it in the order the strategies stack:

1. plan (no MPI): each parameter's Placement, from the model's plan (model.plan_params,
   models/<name>/parallelize.py): its tp split, its pp stage (stages.assign_stages), its fsdp
   split (padded, dim 0), expert ownership or an ep split. `inspect` and checkpoints use the
   same plan.
2. store: this rank's parameter and gradient blocks (ZeRO-1/2 shard gradients on fsdp even
   where parameters are replicated: fsdp.gradient_layout).
3. gradient sync: bucketed all_reduce(avg) over the data axes a gradient is replicated on
   (data_parallel.GradientSync); fsdp averages its own axis inside its access policy; a tied
   embedding's copies on the first and last pp stage sum their gradients (tied.py).
4. access policy: local blocks, or FSDP's gather-before-use / reduce-scatter-after.
5. layers of this rank's stage(s), from the model's builder (model.build): its units with
   the strategies' (tp pairs as CopyToTP + column Linear, row Linear + ReduceFromTP; the MoE
   layer under ep; cp's attention), the output seam (vocab-parallel logits under tp) and an
   auxiliary-loss hook or None; recompute wraps what the units mark.
6. runner: Sequential for pp=1, the pipeline executor over the pp group otherwise.

Collaborators get the smallest object they need: a group's Comm, the store, a callback or a
flag computed here; none of them sees the engine.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from typing import NamedTuple

from ..comm.mesh import DATA_AXES
from ..nn.activations import TapeMeter, meter_tapes
from ..nn.documents import Documents
from ..nn.documents import attach as attach_documents
from ..nn.layers import LocalAccess, Sequential, attach_autocast
from ..nn.recompute import recompute_chunks
from .aux_loss import AuxLossPipeline, AuxLossRunner
from .data_parallel import DEFAULT_BUCKET_MB, GradientSync
from .fsdp import FSDPAccess, gradient_layout
from .pipeline import PipelineRunner
from .precision import Precision
from .stages import assign_stages
from .store import ParamStore
from .tied import tie_gradients
from .vocab_parallel import ReplicatedOutput


# -- planning (no MPI) -------------------------------------------------------------------------
def layer_stages(model, layout) -> list:
    """Virtual-stage index of each layer (pp * virtual_stages of them; rank stage k % pp)."""
    if layout.size("pp") == 1:
        return [0] * model.n_layers
    return assign_stages(model, layout)


def plan_params(model, layout) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every parameter of `model` under `layout`
    (a comm.mesh.Layout: strings are parsed once, where they enter, by parse_layout): the
    model's own plan (models/<name>/parallelize.py).

    Raises ValueError (identically on every rank, before any communication) when the layout
    does not fit the model.
    """
    return model.plan_params(layout)


class RankUnits(NamedTuple):
    """What a model's builder (model.build) gives compose for this rank."""

    chunks: list                     # its units, one list per virtual stage
    output: object                   # the loss and gather_batch seam (vocab_parallel.py)
    aux: object = None               # an auxiliary loss hook (aux_loss.py), or None


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
    documents: object = field(default_factory=Documents)   # packed rows (nn/documents.py)


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
    pp = layout.size("pp")
    # overlap needs each gradient final after one add_grad: not so under fsdp or pp, nor where
    # the model says so (experts exchanged over ep, a tied head: model.grads_overlap)
    overlap_possible = not (fsdp or pp > 1) and model.grads_overlap(layout)
    grad_sync = GradientSync(store, sync_comm, exempt, overlap_possible,  # 3. data axes
                             bucket_mb=layout.option("bucket_mb", DEFAULT_BUCKET_MB))
    grad_sync = tie_gradients(grad_sync, plan, comm.group("pp"), mesh.coords["pp"])  # tied
    access = (FSDPAccess(store, sync_comm.group("fsdp"), grad_sync.on_grad_ready) if fsdp
              else LocalAccess(store, grad_sync.on_grad_ready))     # 4. fsdp or local
    access = precision.wrap_access(access)      # 16-bit parameters: fp32 math (precision.py)
    stats: dict = {}
    chunks, output, aux = model.build(layout, comm, access, stats)   # 5. layers
    chunks = recompute_chunks(model, chunks, layout.option("recompute"), layout.text)
    attach_autocast(chunks, precision.autocast(comm.xp))   # compute_dtype / tf32 (precision.py)
    if getattr(access, "prefetcher", None) is not None:             # fsdp prefetch=1
        access.prefetcher.install(chunks)
    meter = TapeMeter()                 # activation bytes on the layers' tapes (memory_report)
    meter_tapes(chunks, meter)
    documents = Documents(layout.size("cp"))   # packed rows' document ids, for the units
    attach_documents(chunks, documents)
    # NCCL's communicators (comm/nccl.py) are made collectively per group, here where every
    # rank is at the same line: on first use a later pipeline stage would join only once a
    # message came that needs them
    comm.make_device_comms([*layout.active_axes, DATA_AXES])
    if pp > 1:                                                      # 6. pp
        # Group communicators are made by a world-wide Split on first use; inside a pipeline
        # ranks reach their first tp/pp call at different times, so make them all here,
        # where every rank is at the same line.
        for axis in layout.active_axes:
            mesh.comm(axis)
        mesh.comm(DATA_AXES)
        runner = PipelineRunner(chunks, layout, comm.group("pp"), stats)
        if aux is not None:                   # the model's auxiliary loss (gpipe only)
            runner = AuxLossPipeline(runner, aux)
    else:
        runner = Sequential(chunks[0])
        if aux is not None:                   # the model's auxiliary loss
            runner = AuxLossRunner(runner, aux)
    return EngineParts(plan, store, grad_sync, access, chunks, runner, stats, meter, output,
                       documents)

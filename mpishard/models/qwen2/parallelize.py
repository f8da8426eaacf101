"""A Qwen2 on the mesh: the Llama's plan and units (llama/parallelize.py), plus the q, k and v
biases.

Placement: a bias is split like its weight's output columns, by whole heads: under tp the
Llama's table splits attn/q/weights (D, H Dh) along dim 1, so attn/q/bias (H Dh,) splits
along dim 0 on tp (the rank's query heads' entries); attn/k, v/bias follow their weights,
split when tp divides the kv heads, else replicated. Then fsdp's split (zero=3) along dim 0,
as for every parameter; pp puts them on their block's stage, cp replicates them.

Units: the Llama's for this layout (tp, sequence_parallel, cp's ring or Ulysses, pp), each
block's q | k | v FusedLinear swapped for a BiasedFusedLinear (units.py) on the same access
policy. Replicated kv biases are used by every tp rank for its own query heads only, like the
replicated kv weights: their gradients are summed over tp (SequenceParallelGrads), the adjoint
of the broadcast.
"""
from __future__ import annotations

from dataclasses import replace

from ...nn.layers import Composite
from ...parallel.compose import RankUnits
from ...parallel.sequence_parallel import SequenceParallelGrads
from ..llama import parallelize as llama
from ..llama.tensor_parallel import replicated_kv_params
from ..llama.units import FusedLinear
from .units import BIASED, BiasedFusedLinear


def bias_names(model) -> list:
    """Every q, k and v bias of the model, in parameter order."""
    return [n for n in model.param_shapes() if n.endswith(tuple(f"{p}/bias" for p in BIASED))]


def weight_of(bias: str) -> str:
    """The weight whose output columns bias `bias` adds to: .../attn/q/bias -> .../q/weights."""
    return bias[:-len("bias")] + "weights"


def plan_params(model, layout) -> dict:
    """The Llama's plan, each bias split on tp like its weight's columns (dim 1 -> dim 0), then
    as planned (fsdp)."""
    plan = llama.plan_params(model, layout)
    for name in bias_names(model):
        tp = tuple(replace(s, dim=0) for s in plan[weight_of(name)].placement.shards
                   if s.axis == "tp")
        info = plan[name]
        info.placement = replace(info.placement, shards=tp + info.placement.shards)
    return plan


def replicated_params(model, tp: int) -> list:
    """Parameters replicated on tp = `tp` ranks of which each uses a part: the Llama's kv
    weights, and with them their biases."""
    weights = set(replicated_kv_params(model, tp))
    return sorted(weights) + [b for b in bias_names(model) if weight_of(b) in weights]


def build(model, layout, comm, access, stats: dict) -> RankUnits:
    """The Llama's units for this layout, their q | k | v projections biased."""
    units = llama.build(model, layout, comm, access, stats)
    biases = [b for b in replicated_params(model, layout.size("tp")) if b.endswith("/bias")]
    tp = comm.group("tp")
    for chunk in units.chunks:
        chunk[:] = [add_biases(u, tp, biases) for u in chunk]
    return units


def add_biases(unit, tp, summed):
    """`unit` with every q | k | v FusedLinear in it (a block's, inside its Composites) made a
    BiasedFusedLinear on that unit's access policy; the gradients of `summed` (replicated kv
    biases) summed over `tp`."""
    if isinstance(unit, FusedLinear) and unit.param_names[0].endswith("attn/q/weights"):
        access = SequenceParallelGrads(unit.access, tp, summed) if summed else unit.access
        return BiasedFusedLinear(access, unit.param_names,
                                 [n[:-len("weights")] + "bias" for n in unit.param_names])
    if isinstance(unit, Composite):
        unit.units = [add_biases(u, tp, summed) for u in unit.units]
        unit.param_names = tuple(n for u in unit.units for n in u.param_names)
    return unit

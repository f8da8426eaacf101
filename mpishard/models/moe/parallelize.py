"""An ms.MoE on the mesh: expert ownership and the one MoE layer this rank runs.

With P = ep ranks and E experts, ep rank q owns experts q E/P ... (q+1) E/P - 1 (placement
`owner={'ep': q}`); the router is replicated. Tokens are split over the data axes (dp x ep);
the layer's dispatch and combine are parallel/expert_parallel.py's. tp, pp, fsdp and cp are
refused.
"""
from __future__ import annotations

from ...parallel import placement as pl
from ...parallel.compose import RankUnits
from ...parallel.context_parallel import refuse_cp
from ...parallel.expert_parallel import MoELayer
from ...parallel.vocab_parallel import ReplicatedOutput


def plan_params(model, layout) -> dict:
    """name -> ParamInfo for an ms.MoE model: router replicated, expert e owned by ep rank
    e // (E/ep). Raises the same ValueError on every rank when the layout does not fit."""
    refuse_cp(layout)
    ep = layout.size("ep")
    for axis in ("tp", "pp", "fsdp"):
        if layout.size(axis) > 1:
            raise ValueError(f"layout {layout.text!r}: {axis}={layout.size(axis)} is not "
                             f"supported with an ms.MoE model; use single, dp, ep or dp x ep")
    if model.n_experts % ep:
        raise ValueError(f"layout ep={ep} does not divide n_experts={model.n_experts}: each ep "
                         f"rank must hold the same number of experts")
    n_data = layout.data_parallel_size
    if model.groups is not None and model.groups % n_data:
        raise ValueError(f"MoE groups={model.groups} is not a multiple of the {n_data} "
                         f"data-parallel ranks of layout {layout.text!r}")
    per_rank = model.n_experts // ep
    plan = {}
    for name, shape in model.param_shapes().items():
        owner = {}
        if name.startswith("expert_") and ep > 1:
            owner = {"ep": int(name.split("/")[0][len("expert_"):]) // per_rank}
        plan[name] = pl.ParamInfo(name, tuple(shape), pl.Placement((), stage=0, owner=owner))
    return plan


def build(model, layout, comm, access, stats: dict) -> RankUnits:
    """The engine's layers: one chunk holding the MoE layer (the model input needs no dx);
    the output is replicated, no auxiliary loss."""
    return RankUnits([[MoELayer(model, access, comm, stats, need_dx=False)]],
                     ReplicatedOutput())

"""ms.MoE's cost model (no MPI): what the plan cannot price.

Its router and experts are Linear units: their uses are the generic table's
(parallel/unit_costs.py). The ep exchange's bytes follow the routing (how many rows each
expert is sent), so they have no closed form: the expert-parallel part raises ValueError
(expert_parallel.step_comm) and `engine.comm_bytes` measures them; the step-time model refuses
the model alike.
"""
from __future__ import annotations

from ...parallel import expert_parallel
from ...parallel.unit_costs import CostPart


class ExpertExchange(CostPart):
    """The ep exchange around the experts: no closed form (module docstring)."""

    axes = ("ep",)

    def memory(self, view, n_state) -> dict:
        return expert_parallel.memory(view, n_state)

    def step_comm(self, view) -> dict:
        return expert_parallel.step_comm(view)


def refuse_step_time(model) -> None:
    """ValueError: the step-time model prices MLPs and decoders."""
    raise ValueError(f"the step-time model covers MLPs and decoders; got {model!r}")

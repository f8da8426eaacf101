"""ms.MoE's cost model (no MPI): its activations, and what the plan cannot price.

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


INT_ELEMENTS = 8                 # the routing's int64 arrays, in bytes per element of itemsize 1
SAVED_PER_HIDDEN = {"relu": 2, "gelu": 2, "sigmoid": 1, "tanh": 1, "identity": 1}


def kept_assignments(model, view, rows: int) -> int:
    """The most (token, choice) assignments `rows` routed rows of a rank keep: every one of
    the k per row without capacity, else at most E x capacity in each of its capacity groups
    (ms.MoE's groups over the data-parallel ranks)."""
    every = rows * model.top_k
    if model.capacity_factor is None:
        return every
    groups = model.groups // view.layout.data_parallel_size if model.groups else 1
    return min(every, groups * model.n_experts * model.capacity(rows // groups))


def activation_elements(model, view, recompute: str) -> dict:
    """What the MoE layer keeps for backward (costs/peak_memory.py), per microbatch of r rows
    (peak_memory multiplies 'saved' by r: here the bound for the rank's rows, per row): the
    input D, router probabilities E, gates k, the combined slots k D, the choices and the
    exchange's two orders 3 k int64; for each kept assignment (A of them: kept_assignments,
    under ep the expected as many received) its dispatched row D and the hidden H once or twice
    (the activation's input and output; once where one array is both); per microbatch the
    experts' bounds and the exchange's counts, E + 3 int64. Its output (D per row) is the
    loss's input."""
    ints = INT_ELEMENTS / view.itemsize
    rows = max(1, view.rows // view.microbatches)
    d, e, k = model.d_model, model.n_experts, model.top_k
    per_assignment = d + SAVED_PER_HIDDEN[model.activation] * model.d_hidden
    saved = d + e + k + k * d + 3 * k * ints + \
        kept_assignments(model, view, rows) * per_assignment / rows
    return {"saved": saved, "per_microbatch": (e + 3) * ints, "workspace": 0, "logits": d,
            "head_weights": 0, "vocab_parallel": False,
            "input_bytes": d * view.itemsize + 8}

"""The MoE spec: a mixture-of-experts layer's sizes, capacity rule and parameter names.

No weights live here; `init(seed)` returns the full checkpoint (float64 numpy arrays), the same
on every rank.
"""
from __future__ import annotations

import numpy as np

from ...nn.functional import check_activation
from ...nn.params import ParamSpec
from ..mlp.spec import MLP
from . import parallelize
from . import costs
from ...parallel.unit_costs import unit_grad_order, unit_uses

__all__ = ["MoE"]


class MoE(ParamSpec):
    """A mixture-of-experts layer spec: d_model -> d_model, `n_experts` expert MLPs.

    A router `router/weights` (d_model, n_experts) scores each token; softmax gives the
    probabilities p; each token goes to its `top_k` most probable experts, and the output is

        y = sum over the chosen experts e of  p_e * expert_e(x)

    The gates are the softmax probabilities themselves, NOT renormalised over the top-k (the
    Switch Transformer choice: with top_k=1 renormalising would make every gate 1 and leave
    the router without a gradient). Expert e is an MLP d_model -> d_hidden -> d_model,
    `act(x W0 + b0) W1 + b1`, with parameters `expert_{e}/layer_{0,1}/weights` (d_in, d_out)
    and `.../bias`, so the checkpoint is the same on every layout.

    Capacity (GShard's groups): the global batch is cut into `groups` equal, contiguous token
    groups (None: one group per data-parallel rank of the layout, i.e. each rank's local
    batch; on `single` that is the whole batch). Within a group of s tokens each expert takes
    at most

        capacity = ceil(capacity_factor * s * top_k / n_experts)

    (token, choice) assignments, first come first served in the order: all first choices by
    token position, then all second choices by position, ... An assignment over capacity is
    dropped: that expert contributes zero to the token (a token whose every choice is
    dropped outputs zeros). capacity_factor=None never drops. A data-parallel layout with D
    ranks and `groups=D` therefore drops exactly what `single` with `groups=D` drops.
    """

    kind = "moe"

    def __init__(self, d_model, d_hidden, n_experts, top_k=1, capacity_factor=1.25,
                 activation="relu", bias=True, groups=None):
        self.d_model, self.d_hidden = int(d_model), int(d_hidden)
        self.n_experts, self.top_k = int(n_experts), int(top_k)
        if min(self.d_model, self.d_hidden, self.n_experts) < 1:
            raise ValueError(f"MoE sizes must be positive, got d_model={d_model}, "
                             f"d_hidden={d_hidden}, n_experts={n_experts}")
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"MoE top_k={top_k} must lie in [1, n_experts={n_experts}]")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ValueError(f"MoE capacity_factor must be > 0 or None, got {capacity_factor}")
        if groups is not None and int(groups) < 1:
            raise ValueError(f"MoE groups must be >= 1 or None, got {groups}")
        self.capacity_factor = None if capacity_factor is None else float(capacity_factor)
        self.activation = check_activation(activation)
        self.bias = bool(bias)
        self.groups = None if groups is None else int(groups)

    @property
    def d_in(self) -> int:
        return self.d_model

    @property
    def d_out(self) -> int:
        return self.d_model

    def capacity(self, group_tokens: int) -> int:
        """Assignments each expert accepts from a group of `group_tokens` tokens."""
        if self.capacity_factor is None:
            return group_tokens * self.top_k
        return int(np.ceil(self.capacity_factor * group_tokens * self.top_k / self.n_experts))

    def expert_param_shapes(self, e: int) -> dict:
        dims = [self.d_model, self.d_hidden, self.d_model]
        shapes = {}
        for i in range(2):
            shapes[f"expert_{e}/layer_{i}/weights"] = (dims[i], dims[i + 1])
            if self.bias:
                shapes[f"expert_{e}/layer_{i}/bias"] = (dims[i + 1],)
        return shapes

    def param_shapes(self) -> dict:
        shapes = {"router/weights": (self.d_model, self.n_experts)}
        for e in range(self.n_experts):
            shapes.update(self.expert_param_shapes(e))
        return shapes

    check_input = MLP.check_input         # (batch, d_model) rows, like an MLP
    output_shape = MLP.output_shape

    def init(self, seed: int = 0) -> dict:
        """Full checkpoint, float64, the same on every rank for the same seed: every weight
        and bias uniform in +-1/sqrt(fan_in), like torch.nn.Linear."""
        rng = np.random.default_rng(seed)
        params = {}
        for name, shape in self.param_shapes().items():
            fan_in = self.d_hidden if "/layer_1/" in name else self.d_model
            bound = 1.0 / np.sqrt(fan_in)
            params[name] = rng.uniform(-bound, bound, shape)
        return params

    # -- data and command line (interface.py): rows like an MLP's; no --model spelling builds it
    takes_tokens = generates = False
    default_loss = MLP.default_loss
    flag_defaults, flag_types = None, {}

    def flag_args(self):
        return None

    def log_name(self) -> str:
        return repr(self)

    # -- parallel plan (interface.py): parallelize.py ------------------------------------------
    def plan_params(self, layout) -> dict:
        return parallelize.plan_params(self, layout)

    def build(self, layout, comm, access, stats: dict):
        return parallelize.build(self, layout, comm, access, stats)

    def grads_overlap(self, layout) -> bool:
        """Never: an expert's gradient sums the tokens of the whole ep group."""
        return False

    def supports_recompute(self) -> bool:
        return False

    # -- cost model (interface.py): costs.py; the plan prices no ms.MoE exchange ---------------
    calibration_key = "mlp"

    def param_uses(self, layout, name: str, held=None) -> tuple:
        return unit_uses(name)

    def grad_order(self, names) -> list:
        return unit_grad_order(names)

    def boundary_width(self, layout, layer) -> int:
        raise ValueError("an ms.MoE model is one layer: a pipeline cannot cut it (pp is refused)")

    def check_costs(self, layout) -> None:
        """Nothing beyond plan_params' checks."""

    def cost_parts(self) -> dict:
        return {"tp": (), "ep": (costs.ExpertExchange(),)}

    def step_gemms(self, view) -> list:
        costs.refuse_step_time(self)

    def step_elementwise(self, view, op, fixed: dict) -> float:
        costs.refuse_step_time(self)

    def step_flops(self, batch: int) -> int:
        costs.refuse_step_time(self)

    def planned_experts(self):
        return self.n_experts          # tried, and refused: its exchange has no cost model

    def activation_elements(self, view, recompute: str) -> dict:
        return costs.activation_elements(self, view, recompute)

    # -- Hugging Face (interface.py): no transformers model is a lone MoE layer
    @classmethod
    def hf_maps(cls) -> tuple:
        return ()

    def hf_map(self):
        return None

    def __repr__(self) -> str:
        return (f"MoE(d_model={self.d_model}, d_hidden={self.d_hidden}, "
                f"n_experts={self.n_experts}, top_k={self.top_k}, "
                f"capacity_factor={self.capacity_factor}, activation={self.activation!r}, "
                f"bias={self.bias}, groups={self.groups})")

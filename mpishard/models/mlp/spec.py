"""The MLP spec: what the layers are and what the parameters are called. No weights live here.

`MLP(dims=[784, 512, 256, 10], activation="relu", bias=True)` has len(dims) - 1 linear layers;
layer i computes act(x @ W_i + b_i) with W_i of shape (dims[i], dims[i+1]), named
`layer_{i}/weights` and `layer_{i}/bias`. The last layer has no activation unless
`final_activation=` is given ("sigmoid" for a BCE model).

`init(seed)` returns the full checkpoint (float64 numpy arrays), identical on every rank, drawn
like torch.nn.Linear's default: W and b uniform in +-1/sqrt(fan_in).

Every spec tells the engine what it takes and gives: `check_input(x, dtype)` (the array
to feed, or ValueError) and `output_shape(lead_shape)` (the output for a batch whose inputs or
targets start with `lead_shape`), so the engine has no per-model branch.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...nn.functional import check_activation
from ...nn.params import ParamSpec
from . import parallelize
from . import costs
from ...parallel.unit_costs import unit_grad_order

__all__ = ["LinearSpec", "MLP"]


@dataclass(frozen=True)
class LinearSpec:
    index: int
    d_in: int
    d_out: int
    activation: str      # applied after the linear; "identity" for none
    bias: bool

    @property
    def prefix(self) -> str:
        return f"layer_{self.index}"

    @property
    def param_shapes(self) -> dict:
        shapes = {f"{self.prefix}/weights": (self.d_in, self.d_out)}
        if self.bias:
            shapes[f"{self.prefix}/bias"] = (self.d_out,)
        return shapes


class MLP(ParamSpec):
    """A multi-layer perceptron spec."""

    kind = "mlp"

    def __init__(self, dims, activation="relu", bias=True, final_activation=None):
        if any(isinstance(d, bool) or int(d) != d for d in dims):
            raise ValueError(f"MLP dims must be integers, got {list(dims)}")
        dims = [int(d) for d in dims]
        if len(dims) < 2:
            raise ValueError(f"MLP needs at least 2 dims (input and output), got {dims}")
        if any(d < 1 for d in dims):
            raise ValueError(f"MLP dims must be positive, got {dims}")
        self.dims = dims
        self.activation = check_activation(activation)
        self.final_activation = check_activation(final_activation or "identity")
        self.bias = bool(bias)

    @property
    def n_layers(self) -> int:
        return len(self.dims) - 1

    @property
    def d_in(self) -> int:
        return self.dims[0]

    @property
    def d_out(self) -> int:
        return self.dims[-1]

    def layers(self) -> list:
        out = []
        for i in range(self.n_layers):
            act = self.final_activation if i == self.n_layers - 1 else self.activation
            out.append(LinearSpec(i, self.dims[i], self.dims[i + 1], act, self.bias))
        return out

    def param_shapes(self) -> dict:
        shapes = {}
        for spec in self.layers():
            shapes.update(spec.param_shapes)
        return shapes

    def init(self, seed: int = 0) -> dict:
        """Full checkpoint, float64, the same on every rank for the same seed."""
        rng = np.random.default_rng(seed)
        params = {}
        for spec in self.layers():
            bound = 1.0 / np.sqrt(spec.d_in)
            params[f"{spec.prefix}/weights"] = rng.uniform(-bound, bound, (spec.d_in, spec.d_out))
            if spec.bias:
                params[f"{spec.prefix}/bias"] = rng.uniform(-bound, bound, (spec.d_out,))
        return params

    def check_input(self, x, dtype):
        """The array to feed for input `x` (on the device): (batch, d_in) in the engine's
        float `dtype` (an integer or bool input would otherwise compute, and pipeline-send,
        as such); ValueError on a wrongly shaped input."""
        if x.ndim != 2 or x.shape[1] != self.d_in:
            raise ValueError(f"input has shape {tuple(x.shape)}, expected (batch, {self.d_in}) "
                             f"for {self!r}")
        return x if x.dtype == dtype else x.astype(dtype)

    def output_shape(self, lead_shape) -> tuple:
        """Shape of the output for a batch whose inputs (or targets) have leading dims
        `lead_shape`: (rows, d_out)."""
        return (lead_shape[0], self.d_out)

    # -- data and command line (interface.py): `--model D_IN,...,D_OUT` builds an MLP ---------
    takes_tokens = False
    generates = False
    default_loss = "mse"
    flag_defaults = None
    flag_types: dict = {}

    def flag_args(self):
        """{"model": "D_IN,...,D_OUT", "activation": ...}; None without bias (no flag drops it)."""
        if not self.bias:
            return None
        return {"model": ",".join(map(str, self.dims)), "activation": self.activation}

    def log_name(self) -> str:
        """The dims joined by arrows: 64->128->10."""
        return "->".join(map(str, self.dims))

    # -- parallel plan (interface.py): parallelize.py ------------------------------------------
    def plan_params(self, layout) -> dict:
        return parallelize.plan_params(self, layout)

    def build(self, layout, comm, access, stats: dict):
        return parallelize.build(self, layout, comm, access, stats)

    def grads_overlap(self, layout) -> bool:
        return True

    def supports_recompute(self) -> bool:
        return False

    # -- cost model (interface.py): costs.py ---------------------------------------------------
    calibration_key = "mlp"

    def param_uses(self, layout, name: str, held=None) -> tuple:
        return costs.param_uses(self, layout, name, held)

    def grad_order(self, names) -> list:
        return unit_grad_order(names)

    def boundary_width(self, layout, layer) -> int:
        return costs.boundary_width(self, layout, layer)

    def check_costs(self, layout) -> None:
        """Nothing beyond plan_params' checks."""

    def cost_parts(self) -> dict:
        return {"tp": (costs.MLPTensorParallel(),), "ep": ()}

    def step_gemms(self, view) -> list:
        return costs.gemms(self, view)

    def step_elementwise(self, view, op, fixed: dict) -> float:
        return costs.elementwise(self, view, op, fixed)

    def step_flops(self, batch: int) -> int:
        return costs.model_flops(self.dims, batch)

    def activation_elements(self, view, recompute: str) -> dict:
        return costs.activation_elements(self, view, recompute)

    def planned_experts(self):
        return None

    # -- Hugging Face (interface.py): no transformers model is a plain MLP
    @classmethod
    def hf_maps(cls) -> tuple:
        return ()

    def hf_map(self):
        return None

    def __repr__(self) -> str:
        return (f"MLP(dims={self.dims}, activation={self.activation!r}, bias={self.bias}, "
                f"final_activation={self.final_activation!r})")

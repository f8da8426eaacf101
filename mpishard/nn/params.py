"""Parameter bookkeeping shared by the model specs (models.py, gpt.py): a spec says
`param_shapes()`, `ParamSpec` derives the rest."""
from __future__ import annotations

import numpy as np


def check_param_shapes(shapes: dict, params: dict) -> None:
    """Raise ValueError naming a key of `shapes` missing from `params`, an entry of the wrong
    shape, or a key `shapes` does not have."""
    missing = [k for k in shapes if k not in params]
    if missing:
        raise ValueError(f"checkpoint is missing {missing}; expected keys {list(shapes)}")
    for k, shape in shapes.items():
        got = tuple(np.shape(params[k]))
        if got != tuple(shape):
            raise ValueError(f"checkpoint entry {k!r} has shape {got}, expected {shape}")
    extra = [k for k in params if k not in shapes]
    if extra:
        raise ValueError(f"checkpoint has unexpected keys {extra} for this model")


class ParamSpec:
    """Base of the model specs: names, count and checkpoint check from `param_shapes()`."""

    def param_shapes(self) -> dict:
        raise NotImplementedError

    def param_names(self) -> list:
        return list(self.param_shapes())

    def num_params(self) -> int:
        return int(sum(np.prod(s) for s in self.param_shapes().values()))

    def check_params(self, params: dict) -> None:
        """Raise ValueError naming a missing or wrongly shaped key."""
        check_param_shapes(self.param_shapes(), params)

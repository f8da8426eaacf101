"""What generic code may ask a model spec: the one interface every architecture implements.

Generic code (nn/, parallel/, the cost models, engine.py, train/, checkpoint/, hf/, cli/) never
asks which model it holds: no `isinstance` on a spec class, no predicate on its kind. It calls
the methods below, and may read the numbers they expose (an expert count, a head count).
A new architecture is a folder `models/<name>/` whose spec implements this protocol, plus one
line in the registry (models/__init__.py).

The protocol is structural (typing.Protocol): a spec implements it by having the methods; it
does not inherit from it. Each method's docstring says what the generic code does with it.
"""
from __future__ import annotations

from typing import Protocol


class ModelSpec(Protocol):
    """A model spec: sizes and parameter names, no weights."""

    # -- identity and shapes (nn/params.ParamSpec gives names, counts and the checkpoint check)
    kind: str
    """The registry key (`--model KIND:...`, checkpoints' `kind`): "mlp", "gpt", ..."""

    def param_shapes(self) -> dict:
        """name -> full shape, in the checkpoint's order."""

    def init(self, seed: int = 0) -> dict:
        """The full checkpoint (float64 numpy arrays), identical on every rank for a seed."""

    def check_input(self, x, dtype):
        """The array to feed for input `x`, or ValueError (the engine, before any collective)."""

    def output_shape(self, lead_shape) -> tuple:
        """The output's shape for a batch whose inputs or targets start with `lead_shape`."""

    def layers(self) -> list:
        """The units a pipeline cuts between (stages.assign_stages balances their parameters)."""

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


class HFMap(Protocol):
    """One transformers architecture's config fields and name map (models/<name>/hf*.py, built
    from hfmap/'s helpers). hf/ loads, loads into an engine and saves through it alone, so
    the directions cannot disagree."""

    ARCHITECTURE: str
    """config.json's `architectures` entry: "GPT2LMHeadModel", "LlamaForCausalLM", ..."""
    MODEL_TYPE: str
    """config.json's `model_type`, read when a config has no `architectures`."""
    SIZE_FIELDS: tuple
    """The fields to_config writes (the math); save copies the source config's others."""
    DEFAULTS: dict
    """The transformers config class's default of each field read: what an absent one means."""

    def spec_args(self, cfg: dict) -> dict:
        """The spec's constructor keywords a config.json describes (ValueError naming a field)."""

    def to_config(self, model) -> dict:
        """The config.json fields of `model` (SIZE_FIELDS' values)."""

    def fresh_config(self) -> dict:
        """The other fields of a spec built in code (no dropout, no token ids)."""

    def name_map(self, model, keys=None) -> dict:
        """{our name: (file key, transposed) or an hfmap.views entry}; `keys` (a file's, or None
        to save) picks among the layouts files hold."""

    def ignored(self, key: str, model) -> bool:
        """File keys that are no parameter (buffers, a tied head's copy)."""

    def tiny_config(self) -> dict:
        """A tiny config of this architecture: tests/hf/test_architectures.py builds a random
        transformers model from it and checks load, save and layouts against it."""


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

    # -- Hugging Face (hf/ reads and writes directories through these; see HFMap above)
    @classmethod
    def hf_maps(cls) -> tuple:
        """The Hugging Face name maps (HFMap) this spec class reads, one per transformers
        architecture (ms.Llama: LlamaForCausalLM and MixtralForCausalLM); () when the
        architecture has no Hugging Face form. A subclass names its own (never inherits)."""

    @classmethod
    def from_hf_config(cls, cfg: dict, hf_map):
        """The spec config.json `cfg` describes, read by `hf_map` (one of hf_maps(); specs
        without a Hugging Face form need none): ValueError naming a field mpishard lacks."""

    def hf_map(self):
        """The name map this spec saves with (one of hf_maps()), or None when it has no
        Hugging Face form (hf.save refuses it)."""

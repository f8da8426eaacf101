"""Reading a config.json as transformers reads it, and strictly.

Every architecture's name map (models/gpt/hf.py, models/llama/hf.py, ...) keeps `DEFAULTS`, the
defaults of its own transformers config class (GPT2Config, LlamaConfig, MixtralConfig) for each
field it reads: `field` takes a field from the file, else that default, so a config.json that
omits a field gives the model transformers builds from it (a Mixtral without rope_theta rotates
with 1e6, not Llama's 10000). tests/hf/test_hf_defaults.py checks DEFAULTS against the installed
transformers. The fields that change the math are checked with `only`: a value other than the
ones mpishard computes raises ValueError naming the field, its value and what is supported,
never a silent approximation.
"""
from __future__ import annotations


def field(cfg: dict, defaults: dict, *names):
    """The first of `names` (aliases of one field) that `cfg` holds (not null), else
    defaults[names[0]]: the default of the architecture's transformers config class."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    return defaults[names[0]]


def only(cfg: dict, arch: str, name: str, allowed, default=None) -> None:
    """ValueError unless cfg[name] (default when absent) is one of `allowed`."""
    value = cfg.get(name, default)
    if not any(value == a and type(value) is type(a) or (value is a) for a in allowed):
        raise ValueError(f"{arch} config.json field {name}={value!r} is not supported by "
                         f"mpishard (supported: {', '.join(repr(a) for a in allowed)})")


def ints(value, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"config.json field {what} must be an integer, got {value!r}")
    return value

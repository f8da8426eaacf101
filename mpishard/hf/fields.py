"""Reading a config.json strictly: a field mpishard does not implement is an error naming it.

Every architecture module (gpt2.py, llama.py) reads its sizes with `need` and checks the fields
that change the math with `only`: a value other than the ones mpishard computes raises
ValueError naming the field, its value and what is supported, never a silent approximation.
"""
from __future__ import annotations


def need(cfg: dict, arch: str, *names):
    """The first of `names` present in `cfg` (aliases of one field), else ValueError."""
    for name in names:
        if cfg.get(name) is not None:
            return cfg[name]
    raise ValueError(f"{arch} config.json has no {names[0]!r}")


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

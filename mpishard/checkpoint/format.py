"""What the checkpoint writer (writer.py), reader (reader.py) and restorer (restorer.py) share.

The format constants, `CheckpointError`, the JSON of a model spec (`model_spec` /
`model_from_spec`, `spec_text` for messages), `check_json` (is `extra` JSON? without
building its text), the file hash, the real (unpadded) slices of a block, and `run_captured`,
which turns an exception into the message that `comm.objects.agree` hands to every rank.
The on-disk layout itself is described in the package docstring (checkpoint/__init__.py).
"""
from __future__ import annotations

import hashlib
import inspect
import json

from ..nn import models

FORMAT, VERSION, INDEX = "mpishard-checkpoint", 1, "index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit (raised on every rank)."""


def run_captured(fn, *args):
    """fn(*args) -> (result, None) or (None, 'message'): the message is what `agree` raises on
    every rank (a CheckpointError's own text, else prefixed with the exception's type)."""
    try:
        return fn(*args), None
    except Exception as e:          # reported to every rank by agree
        return None, f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)


def sha256_file(path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def json_default(o):
    """`json.dump(default=)`: numpy scalars and small arrays as lists, anything else refused."""
    if hasattr(o, "tolist"):          # numpy scalars and small arrays in `extra`
        return o.tolist()
    raise TypeError(f"extra/hyperparameter value of type {type(o).__name__} is not JSON")


class _Discard:
    def write(self, text) -> None: ...


def check_json(obj) -> None:
    """Raise what `json.dumps(obj, default=json_default)` would (TypeError for a value that is
    not JSON, ValueError for a circular reference) without building the text: the encoder's
    pieces are written to nowhere as they come. A Trainer's `extra` holds its histories (three
    floats a step); `json.dumps` of it (CPython 3.11's C encoder keeps one small string per
    number until the end) on every rank at every save left freed memory in CPython's
    small-object arenas that malloc_trim cannot return, so resident memory grew at each save
    as the histories grew (issue 14; benchmarks/soak.py)."""
    json.dump(obj, _Discard(), default=json_default)


def real_slices(region) -> tuple:
    """Slices of a (possibly padded) local block that hold region [(start, stop), ...]'s real
    entries."""
    return tuple(slice(0, b - a) for a, b in region)


def model_spec(model) -> dict:
    """A JSON description of a model spec (class + its simple attributes)."""
    spec = {"class": type(model).__name__, "kind": getattr(model, "kind", "mlp")}
    for k, v in sorted(vars(model).items()):
        if not k.startswith("_") and (v is None or isinstance(v, (int, float, str, bool, list,
                                                                  tuple))):
            spec[k] = list(v) if isinstance(v, tuple) else v
    return json.loads(json.dumps(spec, default=json_default))


def model_from_spec(spec: dict):
    """Rebuild the model spec saved in an index (a model class of nn.models: MLP, MoE, ...)
    or None if it cannot."""
    cls = getattr(models, spec.get("class", ""), None)
    if not (isinstance(cls, type) and hasattr(cls, "init")):
        return None
    params = inspect.signature(cls).parameters
    try:
        return cls(**{k: v for k, v in spec.items() if k in params})
    except (TypeError, ValueError):
        return None


def spec_text(spec) -> str:
    """A model spec as a constructor call, for messages: 'MLP(dims=[8, 16, 4], ...)'."""
    args = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k not in ("class", "kind"))
    return f"{spec.get('class', '?')}({args})"

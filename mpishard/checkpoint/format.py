"""What the checkpoint writer (checkpoint.py) and reader (checkpoint_reader.py) share.

The format constants, `CheckpointError`, the JSON of a model spec (`model_spec` /
`model_from_spec`, `_spec_text` for messages), the file hash, and the "same error on every
rank" pair `_run` / `_agree`. The on-disk layout itself is described in checkpoint.py.
"""
from __future__ import annotations

import hashlib
import inspect
import json

FORMAT, VERSION, INDEX = "mpishard-checkpoint", 1, "index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit (raised on every rank)."""


def _agree(comm, error) -> None:
    """Collective: if any rank has an error (a string), every rank raises the first one.

    Not the engine's `agree`: this raises CheckpointError, and `load(path, comm=)` has a
    communicator but no engine."""
    msgs = comm.allgather(None if error is None else str(error))   # small control data
    first = next((m for m in msgs if m is not None), None)
    if first is not None:
        raise CheckpointError(first)


def _run(fn, *args):
    """fn(*args) -> (result, None) or (None, 'message') for _agree."""
    try:
        return fn(*args), None
    except Exception as e:          # reported to every rank by _agree
        return None, f"{type(e).__name__}: {e}" if not isinstance(e, CheckpointError) else str(e)


def _sha256(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _json_default(o):
    if hasattr(o, "tolist"):          # numpy scalars and small arrays in `extra`
        return o.tolist()
    raise TypeError(f"extra/hyperparameter value of type {type(o).__name__} is not JSON")


def model_spec(model) -> dict:
    """A JSON description of a model spec (class + its simple attributes)."""
    spec = {"class": type(model).__name__, "kind": getattr(model, "kind", "mlp")}
    for k, v in sorted(vars(model).items()):
        if not k.startswith("_") and (v is None or isinstance(v, (int, float, str, bool, list,
                                                                  tuple))):
            spec[k] = list(v) if isinstance(v, tuple) else v
    return json.loads(json.dumps(spec, default=_json_default))


def model_from_spec(spec: dict):
    """Rebuild the model spec saved in an index (MLP, MoE) or None if it cannot."""
    import mpishard as ms

    cls = getattr(ms, spec.get("class", ""), None)
    if cls is None:
        return None
    params = inspect.signature(cls).parameters
    try:
        return cls(**{k: v for k, v in spec.items() if k in params})
    except (TypeError, ValueError):
        return None


def _spec_text(spec) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k not in ("class", "kind"))
    return f"{spec.get('class', '?')}({args})"

"""What the checkpoint writer (writer.py), reader (reader.py) and restorer (restorer.py) share.

The format constants, `CheckpointError`, the JSON of a model spec (`model_spec` /
`model_from_spec`, `spec_text` for messages), `check_json` (is `extra` JSON? without
building its text), the file hash, the real (unpadded) slices of a block, `run_captured`,
which turns an exception into the message that `comm.objects.agree` hands to every rank, and
the assets: files a checkpoint carries beside its blocks (a tokenizer's files, the arrays
that standardise a data set's inputs), written by rank 0 before the index and listed in its
`files` with their sha256 like every block (`asset_bytes`, `read_asset`).
The on-disk layout itself is described in the package docstring (checkpoint/__init__.py).
"""
from __future__ import annotations

import hashlib
import inspect
import io
import json
import re

import numpy as np

from .. import models
from ..train.untrusted import file_in

FORMAT, VERSION, INDEX = "mpishard-checkpoint", 1, "index.json"
# an asset is a plain file name (no folder, not hidden); blocks are param.* / optim.* (writer)
ASSET_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
BLOCK_PREFIXES = ("param.", "optim.")


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
    as the histories grew (benchmarks/soak.py measures it)."""
    json.dump(obj, _Discard(), default=json_default)


def real_slices(region) -> tuple:
    """Slices of a (possibly padded) local block that hold region [(start, stop), ...]'s real
    entries."""
    return tuple(slice(0, b - a) for a, b in region)


def model_spec(model) -> dict:
    """A JSON description of a model spec (class + its simple attributes)."""
    spec = {"class": type(model).__name__, "kind": model.kind}
    for k, v in sorted(vars(model).items()):
        if not k.startswith("_") and (v is None or isinstance(v, (int, float, str, bool, list,
                                                                  tuple))):
            spec[k] = list(v) if isinstance(v, tuple) else v
    return json.loads(json.dumps(spec, default=json_default))


def model_from_spec(spec: dict):
    """Rebuild the model spec saved in an index (its "class": a spec class of the registry,
    models.ARCHITECTURES) or None if it cannot."""
    name = spec.get("class")
    cls = {c.__name__: c for c in models.ARCHITECTURES.values()}.get(name) \
        if isinstance(name, str) else None
    if cls is None:
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


def check_asset_name(name) -> str:
    """`name` if it is a plain file name an asset may take (no folder, not hidden, not the
    index or a block's name), else CheckpointError naming it."""
    if not (isinstance(name, str) and ASSET_NAME.match(name)) or name == INDEX or \
            name.startswith(BLOCK_PREFIXES) or name.endswith(".tmp"):
        raise CheckpointError(f"checkpoint asset name {name!r} is not a plain file name "
                              f"(letters, digits, '_', '.', '-'; not {INDEX}, param.*, "
                              f"optim.* or *.tmp)")
    return name


def asset_bytes(value) -> bytes:
    """The file contents of an asset: bytes as they are, an array as .npy (no pickle)."""
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    arr = np.asarray(value)
    if arr.dtype.hasobject:
        raise CheckpointError(f"an asset array holds Python objects ({arr.dtype}); only "
                              f"numbers are stored (no pickle)")
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def read_asset(ckpt, name) -> bytes:
    """The bytes of asset `name` of an open checkpoint (reader.Checkpoint: `path`, `index`),
    checked against the sha256 its index records; CheckpointError when it has none or the
    file differs."""
    check_asset_name(name)
    info = ckpt.index.get("files", {}).get(name)
    if not isinstance(info, dict):
        raise CheckpointError(f"checkpoint {ckpt.path} carries no file {name}")
    try:
        with open(file_in(ckpt.path, name, f"{INDEX}: asset", CheckpointError), "rb") as f:
            data = f.read()
    except OSError as e:
        raise CheckpointError(f"checkpoint {ckpt.path}: cannot read {name}: {e}") from None
    got = hashlib.sha256(data).hexdigest()
    if got != info.get("sha256"):
        raise CheckpointError(f"checkpoint {ckpt.path}: {name} is corrupt (sha256 "
                              f"{got[:16]}..., the index says {str(info.get('sha256'))[:16]}...)")
    return data


def read_asset_array(ckpt, name) -> np.ndarray:
    """Asset `name` (an .npy written by asset_bytes) as an array, read without pickle."""
    try:
        return np.load(io.BytesIO(read_asset(ckpt, name)), allow_pickle=False)
    except ValueError as e:
        raise CheckpointError(f"checkpoint {ckpt.path}: {name} is not an .npy array: {e}"
                              ) from None

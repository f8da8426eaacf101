"""Reading a checkpoint: its index, lazily memory-mapped arrays, sha256 verification.

    ckpt = ms.checkpoint.load("ckpt")          # local; Checkpoint: name -> LazyArray
    engine.load_checkpoint(ckpt)               # each rank reads only the blocks it slices
    ckpt.step, ckpt.extra, ckpt.model()        # what was saved with it
    print(ms.checkpoint.describe("ckpt"))      # what `python -m mpishard inspect` prints

The on-disk format (a directory of .npy blocks plus `index.json`) is described in the
package docstring, and the crash-consistent save in writer.py, which writes what this module
reads. Each array is a `LazyArray` (lazy.py), which reads only the region sliced. Before the
first read from a file its sha256 is checked against the index (`verify=False` skips that);
every file's presence and size is checked when the checkpoint is opened. What writer and
reader share (constants, CheckpointError, the model-spec JSON) is in format.py.
"""
from __future__ import annotations

import json
import math
import os
import tokenize
from collections.abc import Mapping

import numpy as np

from ..comm.collectives import Comm
from ..comm.objects import agree
from ..train.untrusted import file_in, numeric_dtype, whole_number, whole_numbers
from .format import (FORMAT, INDEX, VERSION, CheckpointError, model_from_spec, model_spec,
                     run_captured, sha256_file, spec_text)
from .lazy import LazyArray
from .storage import latest

_OPEN_ATTEMPTS = 5          # opening retries while a concurrent save swaps the directory


# -- load -------------------------------------------------------------------------------------
def _resolve(path) -> str:
    """The directory holding the complete checkpoint `path` (`path.old` mid-swap), or the
    newest complete step folder of a retention directory (storage.py)."""
    path = os.path.abspath(os.fspath(path))
    for p in (path, path + ".old"):
        if os.path.isfile(os.path.join(p, INDEX)):
            return p
    newest = latest(path)
    if newest is not None:
        return newest
    raise CheckpointError(f"{path} is not a checkpoint: no {INDEX} (missing, or an "
                          "incomplete save that never finished)")


def _stamp(directory):
    """Identity of a directory's index file (None when absent): changes when a save swaps."""
    try:
        st = os.stat(os.path.join(directory, INDEX))
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_mtime_ns, st.st_size


def read_index(path) -> dict:
    """The parsed index.json of checkpoint `path` (checked for format and version)."""
    d = _resolve(path)
    try:
        with open(os.path.join(d, INDEX), encoding="utf-8") as f:
            index = json.load(f)
    except (OSError, ValueError) as e:        # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(f"{d}/{INDEX} cannot be read: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{d}/{INDEX} is not an mpishard checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{d}/{INDEX} has format version {index.get('version')}, this "
                              f"mpishard reads version {VERSION}")
    return index


class Checkpoint(Mapping):
    """Read-only mapping name -> LazyArray of the parameters of a checkpoint on disk.

    Attributes: `step`, `extra`, `layout`, `world_size`, `model_spec`, `index`, `path`;
    `model()` rebuilds the spec, `optimizer_state(name)` the state of one parameter,
    `verify()` checks every file's sha256."""

    def __init__(self, path, verify: bool = True):
        self.verify_on_open = bool(verify)
        for attempt in range(_OPEN_ATTEMPTS):
            # A save to `path` may swap directories while this opens it: the index and the
            # files checked must come from one directory, so retry when its index changed.
            self._open, self._verified, self._shapes, self._dtypes = {}, set(), {}, {}
            self._paths = {}
            stamp = None
            try:
                self.path = _resolve(path)
                stamp = _stamp(self.path)
                self.index = read_index(self.path)
                self._check_files()
            except CheckpointError:
                if attempt + 1 < _OPEN_ATTEMPTS and (stamp is None or
                                                     _stamp(self.path) != stamp):
                    continue
                raise
            if _stamp(self.path) == stamp:
                break
        else:
            raise CheckpointError(f"{os.path.abspath(os.fspath(path))} kept changing while "
                                  f"being opened ({_OPEN_ATTEMPTS} tries)")
        ix = self.index
        self.step, self.extra = int(ix.get("step", 0)), ix.get("extra")
        self.layout, self.world_size = ix.get("layout"), ix.get("world_size")
        self.model_spec = ix.get("model", {})
        self._arrays = {n: LazyArray(self, n, e) for n, e in ix["tensors"].items()}

    @property
    def _optimizer(self) -> dict:
        return self.index.get("optimizer") or {}

    def _entries(self):
        yield from self.index["tensors"].items()
        for name, st in (self._optimizer.get("state") or {}).items():
            for key, e in st["tensors"].items():
                yield f"{name} ({key})", e

    def _check_files(self) -> None:
        """Every file the index names exists with its recorded size; chunks lie inside their
        array, with its dtype, and cover it. A malformed index raises CheckpointError."""
        try:
            self._check_files_unsafe()
        except CheckpointError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as e:
            raise CheckpointError(f"checkpoint {self.path}: malformed {INDEX} "
                                  f"({type(e).__name__}: {e})") from None

    def _ints(self, values, what: str) -> tuple:
        """`values` (a list of JSON numbers from the index) as a tuple of ints >= 0;
        CheckpointError unless every one is such an integer (2.0 or true is not: they would
        index differently)."""
        return whole_numbers(values, f"checkpoint {self.path}: {what}", CheckpointError)

    def _check_files_unsafe(self) -> None:
        """The index is untrusted input: every name it gives is a plain file name inside the
        directory (untrusted.file_in) before any file is looked at, every shape, offset and
        size a whole number, every dtype numeric, and each block's .npy header describes
        exactly the bytes of its file, so what a LazyArray allocates is bounded by the bytes
        on disk."""
        int(self.index.get("step", 0))
        if not isinstance(self.index.get("model", {}), dict):
            raise TypeError("model is not a table")
        for name, st in (self._optimizer.get("state") or {}).items():   # tables, where read
            scalars = st.get("scalars", {}) if isinstance(st, dict) else None
            if not (isinstance(scalars, dict) and isinstance(st["tensors"], dict) and all(
                    isinstance(v, (int, float, str, type(None))) for v in scalars.values())):
                raise TypeError(f"optimizer state of {name!r} is not a table of scalars and "
                                f"tensors")
        files = self.index.get("files", {})
        if not isinstance(files, dict):
            raise TypeError("files is not a table")
        where = f"checkpoint {self.path}: {INDEX}:"
        entries = list(self._entries())
        for name, e in entries:
            for c in e["chunks"]:
                file_in(self.path, c["file"], f"{where} chunk {name!r} file", CheckpointError)
        self._paths = {f: file_in(self.path, f, f"{where} files entry", CheckpointError)
                       for f in files}
        for fname, info in files.items():
            full = self._paths[fname]
            if not os.path.isfile(full):
                raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is missing")
            size = os.path.getsize(full)
            if not isinstance(info["sha256"], str):
                raise TypeError(f"sha256 of {fname} is not a string")
            if size != whole_number(info["bytes"], f"{where} bytes of {fname!r}",
                                    CheckpointError):
                raise CheckpointError(f"checkpoint {self.path}: shard file {fname} has {size} "
                                      f"bytes, the index says {info['bytes']} (truncated?)")
        for name, e in entries:
            vol, shape = 0, self._ints(e["shape"], f"{name}'s shape")
            dtype = numeric_dtype(e["dtype"], f"{where} {name!r} dtype")
            for c in e["chunks"]:
                if c["file"] not in files:
                    raise CheckpointError(f"checkpoint {self.path}: {name} names unknown file "
                                          f"{c['file']}")
                block = self.file_shape(c["file"])
                offset = self._ints(c["offset"], f"the offset of {name}'s chunk {c['file']}")
                if (len(block) != len(shape) or len(offset) != len(shape)
                        or any(o + b > n for o, b, n in zip(offset, block, shape))):
                    raise CheckpointError(f"checkpoint {self.path}: chunk {c['file']} of shape "
                                          f"{block} at offset {offset} does not fit {name} of "
                                          f"shape {shape}")
                if self._dtypes[c["file"]] != dtype:
                    raise CheckpointError(f"checkpoint {self.path}: chunk {c['file']} holds "
                                          f"{self._dtypes[c['file']]}, {name} is {dtype}")
                vol += math.prod(block)
            if vol != math.prod(shape):
                raise CheckpointError(f"checkpoint {self.path}: the chunks of {name} hold {vol} "
                                      f"elements, its shape {shape} needs {math.prod(shape)}")

    def file_shape(self, fname) -> tuple:
        """Shape of a block from its .npy header (no data read); CheckpointError unless the
        header's shape and dtype account for exactly the file's bytes after it."""
        if fname not in self._shapes:
            with open(self._paths[fname], "rb") as f:
                try:
                    fmt = np.lib.format
                    read = (fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0)
                            else fmt.read_array_header_2_0)
                    shape, _, dtype = read(f)
                    dtype = numeric_dtype(dtype, f"the dtype of {fname}")
                except (ValueError, SyntaxError, tokenize.TokenError, TypeError,
                        MemoryError) as e:  # a damaged header (numpy parses it as a literal)
                    raise CheckpointError(f"checkpoint {self.path}: {fname} is not a valid "
                                          f".npy file: {e}") from None
                data = os.fstat(f.fileno()).st_size - f.tell()
            shape = tuple(shape)
            if any(n < 0 for n in shape) or math.prod(shape) * dtype.itemsize != data:
                raise CheckpointError(f"checkpoint {self.path}: {fname}'s header says {shape} "
                                      f"{dtype} ({math.prod(shape) * dtype.itemsize} bytes), "
                                      f"the file holds {data} bytes of data")
            self._shapes[fname], self._dtypes[fname] = shape, dtype
        return self._shapes[fname]

    def verify_file(self, fname) -> None:
        if fname in self._verified:
            return
        want = self.index["files"][fname]["sha256"]
        got = sha256_file(self._paths[fname])
        if got != want:
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is corrupt "
                                  f"(sha256 {got[:16]}..., the index says {want[:16]}...)")
        self._verified.add(fname)

    def verify(self, files=None, comm=None) -> None:
        """Check the sha256 of `files` (default all). With `comm` (an engine or its Comm):
        collective, each rank hashes a share and every rank raises the same error; the wait
        is bounded by the engine's timeout."""
        files = sorted(self.index["files"]) if files is None else sorted(set(files))
        if comm is None:
            for f in files:
                self.verify_file(f)
            return
        comm = engine_comm(comm)
        mine = files[comm.rank()::comm.size()]
        err = run_captured(lambda: [self.verify_file(f) for f in mine])[1]
        agree(comm, err, CheckpointError, "checkpoint verify")

    def open_file(self, fname):
        if fname not in self._open:
            try:
                if self.verify_on_open:
                    self.verify_file(fname)
                self._open[fname] = np.load(self._paths[fname], mmap_mode="r",
                                            allow_pickle=False)
            except FileNotFoundError:
                raise CheckpointError(f"checkpoint {self.path}: shard file {fname} vanished "
                                      "after the checkpoint was opened (replaced by a newer "
                                      "save?); load it again") from None
        return self._open[fname]

    def __getitem__(self, name):
        return self._arrays[name]

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self):
        return len(self._arrays)

    def model(self):
        return model_from_spec(self.model_spec)

    @property
    def optimizer_type(self):
        return self._optimizer.get("type")

    @property
    def optimizer_hyperparameters(self) -> dict:
        return self._optimizer.get("hyperparameters") or {}

    def optimizer_state(self, name) -> dict:
        """{key: LazyArray, scalar: value} for parameter `name` ({} if none was saved)."""
        st = (self._optimizer.get("state") or {}).get(name)
        if not st:
            return {}
        out = dict(st.get("scalars", {}))
        out.update({k: LazyArray(self, f"{name} ({k})", e) for k, e in st["tensors"].items()})
        return out

    def check_model(self, model) -> None:
        if model_spec(model) != self.model_spec:
            raise CheckpointError(f"checkpoint {self.path} holds a different model: "
                                  f"{spec_text(self.model_spec)}, not {model!r}")

    def __repr__(self):
        return (f"Checkpoint({self.path!r}, step={self.step}, layout={self.layout!r}, "
                f"{len(self)} tensors)")


def engine_comm(comm) -> Comm:
    """The Comm of `comm`, an engine or an engine's Comm: its timeout bounds the waits."""
    found = comm if isinstance(comm, Comm) else getattr(comm, "comm", None)
    if not isinstance(found, Comm):
        raise TypeError(f"comm= takes an mpishard engine or its Comm (whose timeout bounds "
                        f"the wait), got {type(comm).__name__}")
    return found


def load(path, verify: bool = True, model=None, comm=None) -> Checkpoint:
    """Open a checkpoint: a read-only mapping name -> LazyArray reading only what is sliced,
    so `engine.load_checkpoint(load(path))` reshards to any layout and world size.

    verify=True checks each file's sha256 before its first read. `model=` raises if the
    checkpoint holds another model. `comm=` (the engine, or its Comm) makes it collective:
    every file verified up front, the same CheckpointError on every rank, each wait bounded
    by the engine's timeout."""
    if comm is None:
        return _open(path, verify, model)
    comm = engine_comm(comm)
    ckpt, err = run_captured(_open, path, verify, model)
    agree(comm, err, CheckpointError, "checkpoint load")
    ckpt.verify(comm=comm)
    return ckpt


def _open(path, verify, model) -> Checkpoint:
    ckpt = Checkpoint(path, verify=verify)
    if model is not None:
        ckpt.check_model(model)
    return ckpt


def describe(path) -> str:
    """What `python -m mpishard inspect CKPT` prints."""
    ckpt = load(path, verify=False)
    ix = ckpt.index
    lines = [f"checkpoint {ckpt.path}",
             f"  model      {spec_text(ckpt.model_spec)}",
             f"  layout     {ckpt.layout} ({ckpt.world_size} ranks)",
             f"  step       {ckpt.step}",
             f"  optimizer  {ckpt.optimizer_type or '-'} {ckpt.optimizer_hyperparameters or ''}",
             f"  files      {len(ix['files'])}, "
             f"{sum(f['bytes'] for f in ix['files'].values())} bytes"]
    opt_state = ckpt._optimizer.get("state") or {}
    if opt_state:
        keys = sorted({k for st in opt_state.values() for k in st["tensors"]})
        steps = sorted({st.get("scalars", {}).get("step") for st in opt_state.values()}
                       - {None}, key=str)
        lines.append(f"  opt state  {', '.join(keys)} for {len(opt_state)} tensors, "
                     f"step {', '.join(map(str, steps)) or '-'}")
    if ckpt.extra:
        lines.append(f"  extra      {json.dumps(ckpt.extra)[:200]}")
    width = max(len(n) for n in ckpt) if len(ckpt) else 4
    lines.append(f"  {'name':<{width}}  {'shape':<14} {'dtype':<8} chunks")
    for name, a in ckpt.items():
        lines.append(f"  {name:<{width}}  {str(a.shape):<14} {str(a.dtype):<8} "
                     f"{len(a._chunks)}")
    return "\n".join(lines)


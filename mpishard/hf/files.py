"""A Hugging Face model directory on disk: config.json and its safetensors, read lazily.

    d = HFDir("gpt2")                     # config.json parsed; nothing else read yet
    with d.tensors() as t:                # {file key: SafeTensor}, every file opened once
        t["transformer.wte.weight"][0:10, :]     # reads these 10 rows only

The weights are one `model.safetensors`, or several files named by the `weight_map` of
`model.safetensors.index.json` (what `save_pretrained(max_shard_size=...)` writes). They are
opened with the safetensors library's numpy API (`safe_open(..., framework="np")`, then
`get_slice`), which maps the file and copies only the region sliced: never pickle, never
torch.load. bfloat16 tensors come back as ml_dtypes.bfloat16 arrays.

A `SafeTensor` is a lazily read array in OUR orientation: `transposed=True` presents a
PyTorch nn.Linear weight (out, in) as (in, out), so `t[a:b, c:d]` reads the file's
`[c:d, a:b]` and returns its transpose. It has `.shape`, `.dtype` and indexing by ints, slices
(any step: the span is read, then stepped) and Ellipsis, read by hfmap.views.region_of as
a checkpoint's LazyArray reads them, which is what placement.shard_array asks of an array; it
adds the bytes it read to `counter["bytes"]` so a test can check what a rank read. `widened()`
reads bfloat16 as float32 (exact), for engines whose array module has no bfloat16 (cupy).
"""
from __future__ import annotations

import json
import os
from contextlib import contextmanager

import ml_dtypes
import numpy as np

from ..hfmap.views import region_of
from ..train.untrusted import file_in

CONFIG = "config.json"
SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"
# safetensors' dtype names -> numpy's (the floats a model is stored in, and integer buffers)
DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "U8": np.uint8, "BOOL": np.bool_}


def _read_json(path, what: str) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the {what} {path}: {e}") from None
    if not isinstance(data, dict):
        raise ValueError(f"the {what} {path} is not a JSON object")
    return data


class HFDir:
    """A Hugging Face directory: `config` (the parsed config.json) and `files` (the
    safetensors files, in order) with `weight_map` (file key -> file name)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        if not os.path.isdir(self.path):
            raise ValueError(f"{self.path} is not a directory (a Hugging Face model directory "
                             f"holds {CONFIG} and {SINGLE})")
        self.config = _read_json(os.path.join(self.path, CONFIG), "model config")
        index = os.path.join(self.path, INDEX)
        if os.path.isfile(index):
            wm = _read_json(index, "safetensors index").get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise ValueError(f"{index} has no weight_map of key -> file name")
            self.weight_map = dict(wm)
        elif os.path.isfile(os.path.join(self.path, SINGLE)):
            self.weight_map = None          # filled from the file's header on first open
        else:
            raise ValueError(f"{self.path} has neither {SINGLE} nor {INDEX} (only safetensors "
                             f"weights are read: no pickle, no pytorch_model.bin)")
        self.files = sorted(set(self.weight_map.values())) if self.weight_map else [SINGLE]
        where = {f: k for k, f in sorted((self.weight_map or {}).items(), reverse=True)}
        for name in self.files:
            what = (f"{INDEX}: weight_map {where[name]!r} file" if self.weight_map
                    else "the weights file")
            if not os.path.isfile(file_in(self.path, name, what)):
                raise ValueError(f"{self.path}: safetensors file {name!r} is missing")

    @contextmanager
    def tensors(self, counter=None):
        """{file key: SafeTensor (file orientation)} over every file, open for the block."""
        from safetensors import safe_open

        counter = {"bytes": 0} if counter is None else counter
        handles, out = [], {}
        try:
            for name in self.files:
                h = _open(safe_open, file_in(self.path, name, "safetensors file"))
                handles.append(h.__enter__())
                for key in h.keys():
                    if self.weight_map is None or self.weight_map.get(key) == name:
                        out[key] = SafeTensor(h, key, counter)
            missing = sorted(set(self.weight_map or ()) - set(out))
            if missing:
                raise ValueError(f"{self.path}: the index names tensors its files lack: "
                                 f"{missing[:5]}")
            yield out
        finally:
            for h in handles:
                h.__exit__(None, None, None)


def _open(safe_open, path):
    """safe_open(path) for numpy; ValueError naming the file when its header is damaged or
    does not match the file (the library checks the JSON, the dtypes, and that the tensors'
    offsets tile the data exactly: no tensor reaches past the end of the file)."""
    try:
        return safe_open(path, framework="np")
    except OSError:
        raise
    except Exception as e:                # safetensors_rust.SafetensorError is no ValueError
        raise ValueError(f"{path} is not a valid safetensors file: {e}") from None


class SafeTensor:
    """One tensor of an open safetensors file, read only where sliced (see the module doc)."""

    def __init__(self, handle, key, counter, transposed=False, widen=False):
        self._handle, self.key, self.counter = handle, key, counter
        self.widen = bool(widen)
        self._slice = handle.get_slice(key)
        shape = tuple(int(n) for n in self._slice.get_shape())
        self.file_shape = shape
        self.transposed = bool(transposed)
        if self.transposed and len(shape) != 2:
            raise ValueError(f"{key} has shape {shape}, expected a 2-d weight")
        self.shape = shape[::-1] if self.transposed else shape

    def T(self) -> "SafeTensor":
        """The same tensor seen transposed (an nn.Linear weight in our (in, out) order)."""
        return SafeTensor(self._handle, self.key, self.counter, not self.transposed, self.widen)

    def widened(self) -> "SafeTensor":
        """The same tensor read as float32 when the file holds bfloat16 (exact): what an
        engine on cupy can take, which has no bfloat16 dtype. Other dtypes as they are."""
        return SafeTensor(self._handle, self.key, self.counter, self.transposed,
                          self._slice.get_dtype() == "BF16")

    ndim = property(lambda self: len(self.shape))

    @property
    def dtype(self) -> np.dtype:
        """The header's dtype as numpy's (ml_dtypes.bfloat16 for BF16); nothing is read."""
        name = self._slice.get_dtype()
        if name not in DTYPES:
            raise ValueError(f"{self.key} has dtype {name}, which mpishard does not read")
        return np.dtype(np.float32 if self.widen else DTYPES[name])

    def __repr__(self):
        return f"SafeTensor({self.key!r}, shape={self.shape}{', transposed' * self.transposed})"

    def __getitem__(self, key):
        region, post = region_of(key, self.shape, self.key)
        spans = tuple(slice(a, b) for a, b in region)
        if self.transposed:
            spans = spans[::-1]
        a = self._slice[spans] if self.ndim else self._handle.get_tensor(self.key)
        self.counter["bytes"] += int(a.nbytes)
        if self.widen:
            a = a.astype(np.float32)
        return (a.T if self.transposed else a)[post]

    def __array__(self, dtype=None, copy=None):
        a = np.ascontiguousarray(self[...])
        return a if dtype is None else a.astype(dtype)

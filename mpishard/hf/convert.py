"""Hugging Face directories in and out: `read_model`, `load`, `load_into`, `save`.

    model = ms.hf.read_model("gpt2")            # the spec alone (no tensor data read)
    model, params = ms.hf.load("gpt2")          # plus every tensor, under our names, numpy
    engine = ms.make_engine(model, "tp=2,pp=2")
    ms.hf.load_into(engine, "gpt2")             # collective: each rank reads only its slices
    ms.hf.save("out", model, engine.gather_params())     # config.json + model.safetensors
    ms.hf.save("out", model, params, tokenizer=files, max_shard_size="2GB")   # + tokenizer

The architectures are the registry's (models.ARCHITECTURES): each spec class names the
Hugging Face name maps it reads (`hf_maps()`, models/interface.py's HFMap: models/gpt/hf.py,
models/llama/hf.py, models/llama/hf_mixtral.py), a config.json picks one by its
`architectures` (else `model_type`), and a spec saves with `model.hf_map()`. Each keeps ONE
name map, {our name: (file key, transposed) or an entry assembled from several file tensors
(hfmap.views' Stacked, Fused: a Mixtral's experts)}; everything here goes through it, so
load, load_into and save cannot disagree.
A file key the map does not name (and the architecture does not ignore) is an error, as is a
missing one: a converter that skips a tensor produces garbage silently.

`load_into` hands the engine a mapping of lazily read tensors (files.SafeTensor), exactly as
`engine.load_checkpoint(ms.checkpoint.load(ckpt))` hands it LazyArrays: the engine's store
slices each parameter by its placement (any layout, vocabulary padding included) and only those
slices are read from the file, through safetensors' get_slice; bfloat16 is handed over as
float32 (exact), since cupy has no bfloat16 dtype.

The source's dtype and config are remembered on the spec (`model._hf_source`), so `save` writes
what was read (a save -> load round trip is bit-exact) and keeps the fields mpishard does not
model (token ids, dropout, task parameters); a spec built in code saves float32.

`save` writes a directory transformers takes whole: the weights in one model.safetensors, or
past `max_shard_size` bytes (default 5GB; "500MB", "10KB" or a number) in shards
`model-00001-of-0000N.safetensors` named by `model.safetensors.index.json`, cut as
huggingface_hub's split_state_dict_into_shards does (tensors in order, a new shard when the
next would pass the size, a tensor larger than it alone); the tokenizer's files when given
(tokenizer.json and its companions, with a tokenizer_config.json when it has none); and
`generation_config.json` with the bos/eos/pad ids as transformers' GenerationConfig
.from_model_config writes them. Weight files of an earlier save there are replaced.
"""
from __future__ import annotations

import json
import os
import re

import ml_dtypes
import numpy as np

from .. import models
from ..checkpoint.format import model_spec, run_captured, spec_text
from ..comm.objects import agree
from .files import CONFIG, INDEX, SINGLE, HFDir
from .tokenizer import TOKENIZER_CONFIG, special_ids, tokenizer_config

DTYPE_NAMES = {"float64": np.float64, "float32": np.float32, "float16": np.float16,
               "bfloat16": ml_dtypes.bfloat16}
# never copied from the source config: they describe the file, not the model
FILE_FIELDS = ("architectures", "model_type", "dtype", "torch_dtype", "transformers_version",
               "_name_or_path")
GENERATION_CONFIG = "generation_config.json"
TOKEN_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
MAX_SHARD_SIZE = "5GB"
SIZE_UNITS = {"TB": 10**12, "GB": 10**9, "MB": 10**6, "KB": 10**3}
SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def _registered() -> dict:
    """{transformers architecture: (spec class, its HFMap)} over the registry's specs."""
    out = {}
    for cls in models.ARCHITECTURES.values():
        for m in cls.hf_maps():
            assert m.ARCHITECTURE not in out, f"two specs read {m.ARCHITECTURE}"
            out[m.ARCHITECTURE] = (cls, m)
    return out


READERS = _registered()
ARCHITECTURES = {name: m for name, (_, m) in READERS.items()}   # name -> its HFMap


def architecture(cfg: dict) -> tuple:
    """(spec class, HFMap) of a config.json: from `architectures`, else `model_type`."""
    names = cfg.get("architectures")
    if names is not None:
        known = [n for n in (names if isinstance(names, list) else [names])
                 if n in ARCHITECTURES]
        if len(known) != 1:
            raise ValueError(f"config.json architectures={names!r}: mpishard reads "
                             f"{' and '.join(ARCHITECTURES)}")
        return READERS[known[0]]
    by_type = {m.MODEL_TYPE: (cls, m) for cls, m in READERS.values()}
    if cfg.get("model_type") not in by_type:
        raise ValueError(f"config.json model_type={cfg.get('model_type')!r} (no architectures "
                         f"field): mpishard reads {', '.join(by_type)}")
    return by_type[cfg["model_type"]]


def from_config(cfg: dict):
    """The spec a config.json describes (ValueError naming an architecture or a field mpishard
    does not implement)."""
    cls, arch = architecture(cfg)
    return cls.from_hf_config(cfg, arch)


def _spec(d: HFDir):
    cls, arch = architecture(d.config)
    return arch, cls.from_hf_config(d.config, arch)


def read_model(path):
    """The spec (ms.GPT, ms.Llama, ...) of Hugging Face directory `path` (config.json and the
    safetensors headers read, for the dtype `save` keeps; no tensor data)."""
    d = HFDir(path)
    arch, model = _spec(d)
    with d.tensors() as files:
        tensors = _tensors(arch, model, files, d.path)
    _remember(model, d.config, tensors)
    return model


def _tensors(arch, model, files: dict, where) -> dict:
    """{our name: SafeTensor in our orientation}; ValueError for a missing or unknown key."""
    names = arch.name_map(model, files)
    used = [k for entry in names.values() for k in _keys(entry)]
    missing = sorted(k for k in used if k not in files)
    if missing:
        raise ValueError(f"{where}: {arch.ARCHITECTURE} tensors missing for {model!r}: "
                         f"{missing[:6]}")
    unknown = sorted(k for k in files if k not in set(used) and not arch.ignored(k, model))
    if unknown:
        raise ValueError(f"{where}: tensors mpishard's {arch.ARCHITECTURE} does not have "
                         f"(not loaded silently): {unknown[:6]}")
    out = {ours: _view(entry, files) for ours, entry in names.items()}
    model.check_params(out)           # shapes against the config's sizes
    return out


def _keys(entry) -> list:
    """The file keys a name-map entry reads: (key, transposed), or an entry assembled from
    several tensors (hfmap.views' Stacked, Fused: .keys, .view(files), .write(array))."""
    return [entry[0]] if isinstance(entry, tuple) else entry.keys


def _view(entry, files):
    """Our tensor of a name-map entry, read lazily from `files`."""
    if isinstance(entry, tuple):
        key, transposed = entry
        return files[key].T() if transposed else files[key]
    return entry.view(files)


def _file_tensors(entry, a) -> dict:
    """{file key: array} that `save` writes for our array `a` of a name-map entry."""
    if isinstance(entry, tuple):
        return {entry[0]: a.T if entry[1] else a}
    return entry.write(a)


def _remember(model, cfg: dict, tensors: dict) -> None:
    """Keep the source config and its floating dtype on the spec, for `save`."""
    kinds = {np.dtype(t.dtype) for t in tensors.values()}
    if len(kinds) != 1:
        raise ValueError(f"the tensors have several dtypes {sorted(map(str, kinds))}; "
                         f"mpishard loads one")
    model._hf_source = {"config": dict(cfg), "dtype": kinds.pop()}


def source(model):
    """JSON of what `model` was read from: {"config": config.json, "dtype": name}, or None
    for a spec built in code (what `import` keeps in a checkpoint's extra for `export`)."""
    src = getattr(model, "_hf_source", None)
    if src is None:
        return None
    return {"config": src["config"], "dtype": _dtype_name(np.dtype(src["dtype"]))}


def set_source(model, src) -> None:
    """Give `model` the source `source()` returned, so that `save` writes it back alike."""
    if not (isinstance(src, dict) and isinstance(src.get("config"), dict)):
        raise ValueError(f"a Hugging Face source is {{'config': {{...}}, 'dtype': name}}, "
                         f"got {src!r}")
    model._hf_source = {"config": dict(src["config"]), "dtype": _dtype(None, src["dtype"])}


def _dtype_name(dt) -> str:
    return next(k for k, v in DTYPE_NAMES.items() if np.dtype(v) == dt)


def load(path):
    """(spec, {our name: numpy array in the file's dtype}) of Hugging Face directory `path`."""
    d = HFDir(path)
    arch, model = _spec(d)
    with d.tensors() as files:
        tensors = _tensors(arch, model, files, d.path)
        _remember(model, d.config, tensors)
        params = {n: np.asarray(t) for n, t in tensors.items()}
    return model, params


def load_into(engine, path) -> int:
    """Collective: fill `engine` from directory `path`, each rank reading only the slices its
    placements hold; returns the bytes this rank read. The engine's model must be the one the
    directory holds (build it with `read_model(path)`); every rank raises the same ValueError
    otherwise, or for a bad directory (config, tensor names, shapes, dtypes: headers only),
    before any tensor is read."""
    counter = {"bytes": 0}

    def check():
        d = HFDir(path)
        arch, model = _spec(d)
        if model_spec(model) != model_spec(engine.model):
            raise ValueError(f"{d.path} holds {spec_text(model_spec(model))}, the engine "
                             f"runs {engine.model!r}")
        with d.tensors() as files:
            _remember(model, d.config, _tensors(arch, model, files, d.path))
        return d, arch

    found, err = run_captured(check)
    agree(engine.comm, err, ValueError, "hf load_into")
    d, arch = found
    with d.tensors(counter) as files:
        tensors = _tensors(arch, engine.model, files, d.path)
        _remember(engine.model, d.config, tensors)
        engine.load_checkpoint({n: t.widened() for n, t in tensors.items()})
    return counter["bytes"]


def _dtype(model, dtype) -> np.dtype:
    if dtype is None:
        source = getattr(model, "_hf_source", None)
        return np.dtype(source["dtype"] if source else np.float32)
    if isinstance(dtype, str):
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dtype!r}")
        return np.dtype(DTYPE_NAMES[dtype])
    dt = np.dtype(dtype)
    if dt not in [np.dtype(v) for v in DTYPE_NAMES.values()]:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_NAMES)}, got {dt}")
    return dt


def _host(a) -> np.ndarray:
    """A numpy copy of `a` (numpy, a cupy array, or a lazily read array)."""
    return a.get() if hasattr(a, "get") and not isinstance(a, np.ndarray) else np.asarray(a)


def shard_size(size) -> int:
    """Bytes of a max shard size: a positive int, or a string like '5GB', '500MB', '10KB'
    (decimal units, as huggingface_hub's parse_size_to_int reads them). ValueError else."""
    if isinstance(size, str) and size.strip()[-2:].upper() in SIZE_UNITS:
        try:
            n = int(float(size.strip()[:-2]) * SIZE_UNITS[size.strip()[-2:].upper()])
        except ValueError:
            n = 0
    elif isinstance(size, str) and size.strip().isdigit():
        n = int(size.strip())
    else:
        n = size if isinstance(size, int) and not isinstance(size, bool) else 0
    if n <= 0:
        raise ValueError(f"max shard size must be a positive number of bytes or a size like "
                         f"'5GB', '500MB', '10KB', got {size!r}")
    return n


def split_shards(tensors: dict, max_bytes: int) -> list:
    """The tensors' keys cut into shards of at most `max_bytes` (huggingface_hub's rule)."""
    shards, current, size = [], [], 0
    for key, a in tensors.items():
        if a.nbytes > max_bytes:
            shards.append([key])
            continue
        if current and size + a.nbytes > max_bytes:
            shards.append(current)
            current, size = [], 0
        current.append(key)
        size += a.nbytes
    return shards + [current] if current else shards


def _write(path, name, data: bytes) -> None:
    tmp = os.path.join(path, f".{name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, os.path.join(path, name))


def _json(obj) -> bytes:
    return (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode()


def _write_weights(path, tensors: dict, max_bytes: int) -> None:
    """model.safetensors, or shards and their index; then the weight files of an earlier save
    that are not part of this one are removed (the index last written is the one read)."""
    from safetensors.numpy import save_file

    shards = split_shards(tensors, max_bytes)
    names = [SINGLE] if len(shards) <= 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name, keys in zip(names, shards or [[]]):
        tmp = os.path.join(path, f".{name}.tmp")
        save_file({k: tensors[k] for k in keys}, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(path, name))
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(int(a.nbytes) for a in tensors.values()),
                              "total_parameters": sum(int(a.size) for a in tensors.values())},
                 "weight_map": {k: name for name, keys in zip(names, shards) for k in keys}}
        _write(path, INDEX, _json(index))
    stale = [f for f in os.listdir(path) if (f == INDEX and len(names) == 1)
             or ((f == SINGLE or SHARD.match(f)) and f not in names)]
    for f in sorted(stale, key=lambda f: f != INDEX):        # the index first
        os.remove(os.path.join(path, f))


def _savers() -> list:
    """The registered spec classes that have a Hugging Face form (for messages)."""
    return sorted({cls.__name__ for cls, _ in READERS.values()})


def save(path, model, params, dtype=None, tokenizer=None, max_shard_size=MAX_SHARD_SIZE,
         eos_id=None) -> str:
    """Write Hugging Face directory `path` that transformers' from_pretrained loads whole:
    config.json, the weights in `dtype` (the source file's when None and the model came from
    one, else float32; 'bfloat16' via ml_dtypes) in one file or shards of at most
    `max_shard_size`, generation_config.json, and `tokenizer` ({file name: bytes}: its
    tokenizer.json and companions) when given. The config's bos/eos/pad ids are the source's,
    else the tokenizer's (`eos_id`: the end-of-text id training used). Returns path."""
    max_bytes = shard_size(max_shard_size)
    arch = model.hf_map()
    if arch is None:
        raise ValueError(f"only {' and '.join(_savers())} models save as Hugging Face "
                         f"directories, got {model!r}")
    model.check_params(params)
    dt = _dtype(model, dtype)
    path = os.fspath(path)
    if tokenizer is not None and "tokenizer.json" not in tokenizer:
        raise ValueError(f"a tokenizer to save needs its tokenizer.json, got {sorted(tokenizer)}")
    source = getattr(model, "_hf_source", None)
    cfg = {k: v for k, v in (source["config"] if source else arch.fresh_config()).items()
           if k not in FILE_FIELDS and k not in arch.SIZE_FIELDS}
    cfg.update(arch.to_config(model))
    name = _dtype_name(dt)
    cfg.update({"architectures": [arch.ARCHITECTURE], "model_type": arch.MODEL_TYPE,
                "dtype": name, "torch_dtype": name})
    files = dict(tokenizer or {})
    if files:
        for k, v in special_ids(files, eos_id).items():
            if cfg.get(k) is None:
                cfg[k] = v
        if TOKENIZER_CONFIG not in files:
            files[TOKENIZER_CONFIG] = tokenizer_config(files, model.seq_len, cfg.get(
                "eos_token_id") if isinstance(cfg.get("eos_token_id"), int) else None)
    tensors = {}
    for ours, entry in arch.name_map(model).items():
        for key, a in _file_tensors(entry, _host(params[ours])).items():
            tensors[key] = np.ascontiguousarray(a.astype(dt, copy=False))
    os.makedirs(path, exist_ok=True)
    _write_weights(path, tensors, max_bytes)
    for fname, data in sorted(files.items()):
        _write(path, fname, data)
    generation = {k: cfg[k] for k in TOKEN_IDS if cfg.get(k) is not None}
    _write(path, GENERATION_CONFIG, _json({"_from_model_config": True, **generation}))
    _write(path, CONFIG, _json(cfg))
    return path

"""Checkpoints: sharded save, reshard-on-load, exact resume, safetensors interop. No pickle.

    ms.checkpoint.save("ckpt", engine, opt, step=100, extra={"epoch": 3})   # collective
    engine.load_checkpoint(ms.checkpoint.load("ckpt"))       # any layout, any world size
    step = ms.checkpoint.restore("ckpt", engine, opt)        # collective: params + optimizer
    ms.checkpoint.export_safetensors("ckpt", "model.safetensors")
    params = ms.checkpoint.import_safetensors("torch_mlp.safetensors", model)

On disk a checkpoint is a directory of `.npy` files (np.save, allow_pickle=False), one per
block, plus `index.json`:

    {"format": "mpishard-checkpoint", "version": 1, "model": {...spec...},
     "layout": "dp=2,tp=2", "world_size": 4, "step": 100, "extra": {...},
     "tensors":   {name: {"shape", "dtype", "chunks": [{"file", "offset"}, ...]}},
     "optimizer": {"type", "hyperparameters", "state": {name: {"scalars": {"step": 7},
                   "tensors": {key: {"shape", "dtype", "chunks"}}}}} or null,
     "files":     {file: {"sha256", "bytes"}}}

A chunk is the real (unpadded) region `offset[d] : offset[d] + shape[d]` of the full array.
Every block is written once: blocks held by several ranks (replicated on dp, on tp for a
bias, ...) are deduplicated by region, the lowest rank holding a region writes it.

Crash consistency (save over an existing checkpoint `P`):
  1. rank 0 creates the fresh sibling `P.tmp-<step>` (removing any stale one);
  2. every rank writes its blocks there, fsyncs them and sends (file, sha256) to rank 0;
  3. rank 0 writes `index.json.tmp`, fsyncs it, `os.replace`s it to `index.json` and fsyncs
     the directory: the index exists only once every block it names is durable;
  4. rank 0 swaps: `P -> P.old`, `P.tmp-<step> -> P`, fsync of the parent, removes `P.old`.
A crash in 1-3 leaves `P` untouched (the tmp directory has no index: not a checkpoint). A
crash between the two renames of 4 leaves the complete old checkpoint at `P.old`: `load`
reads it from there and the next `save` renames it back first. A crash after leaves `P`
complete and `P.old` as garbage the next save removes. At no moment is there no complete
checkpoint. `load` never opens a directory without `index.json`; it checks that every file
the index names exists with its recorded size up front, and a file's sha256 before the first
read from it (a rank reads and hashes only the files overlapping the slices it asks for).

Errors (corrupt/missing/truncated shard, missing index, another model) raise
`CheckpointError` (a ValueError). `save` and `restore` are collective and raise the same
error on every rank (no rank is left in a collective); `load` is local, and `load(path,
comm=comm)` verifies every file collectively up front.
"""
from __future__ import annotations

import hashlib
import inspect
import json
import os
import re
import shutil
from collections.abc import Mapping

import numpy as np

FORMAT, VERSION, INDEX = "mpishard-checkpoint", 1, "index.json"


class CheckpointError(ValueError):
    """A checkpoint that cannot be trusted or does not fit (raised on every rank)."""


# -- small helpers ----------------------------------------------------------------------------
def _agree(comm, error) -> None:
    """Collective: if any rank has an error (a string), every rank raises the first one."""
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


def _fsync_dir(path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _optimizer_hyper(opt) -> dict:
    if hasattr(opt, "hyperparameters"):
        hp = opt.hyperparameters
        hp = hp() if callable(hp) else hp
    else:
        hp = {k: v for k, v in vars(opt).items() if not k.startswith("_") and
              isinstance(v, (int, float, str, bool, tuple, list)) and k != "state"}
    return json.loads(json.dumps(hp, default=_json_default))


def _volume(region) -> int:
    return int(np.prod([b - a for a, b in region], dtype=np.int64))


def _file_name(kind, name, key, region) -> str:
    where = "_".join(f"{a}-{b}" for a, b in region) or "scalar"
    stem = ".".join(p for p in (kind, key, name.replace("/", ".")) if p)
    return f"{stem}__{where}.npy"


def _host(engine, a):
    return np.ascontiguousarray(engine.backend.to_host(a))


# -- save -------------------------------------------------------------------------------------
def _blocks(engine, optimizer):
    """This rank's candidate blocks: (kind, name, key, region, array, scalars) with the real
    (unpadded) part of the block; kind 'param' or 'optim' (key: the state's array name)."""
    out = []
    for name in engine.local_names:
        region = tuple(tuple(r) for r in engine.block_region(name, "param"))
        real = engine.params[name][tuple(slice(0, b - a) for a, b in region)]
        out.append(("param", name, "", region, real, {}))
    if optimizer is not None:
        for name, *_ in engine.optimizer_shards():
            state = optimizer.state.get(name)
            if not state:
                continue
            region = tuple(tuple(r) for r in engine.block_region(name, "optimizer"))
            cut = tuple(slice(0, b - a) for a, b in region)
            scalars = {k: (v.item() if hasattr(v, "item") else v) for k, v in state.items()
                       if np.ndim(v) == 0}
            for key, arr in sorted(state.items()):
                if np.ndim(arr) > 0:
                    out.append(("optim", name, key, region, arr[cut], scalars))
    return [b for b in out if _volume(b[3]) > 0]


def _assign_writers(all_descs, full_shapes) -> tuple:
    """Rank 0: the lowest rank holding a region writes it; check the regions cover each
    array exactly once. Returns (per-rank lists of block indices, the unique blocks)."""
    owner: dict = {}
    for rank, descs in enumerate(all_descs):
        for i, d in enumerate(descs):
            owner.setdefault((d[0], d[1], d[2], d[3]), (rank, i, d))
    covered: dict = {}
    for (kind, name, key, region), (_, _, d) in owner.items():
        covered[(kind, name, key)] = covered.get((kind, name, key), 0) + _volume(region)
    for (kind, name, key), vol in covered.items():
        full = int(np.prod(full_shapes[name], dtype=np.int64))
        if vol != full:
            raise CheckpointError(f"{kind} {name!r} {key}: the ranks' blocks cover {vol} of "
                                  f"{full} elements (optimizer state missing on some ranks?)")
    todo = [[] for _ in all_descs]
    for rank, i, _ in owner.values():
        todo[rank].append(i)
    return todo, owner


def _write_block(path, arr) -> None:
    """Write one block durably (tests monkeypatch this to crash half-way)."""
    with open(path, "wb") as f:
        np.save(f, arr, allow_pickle=False)
        f.flush()
        os.fsync(f.fileno())


def _prepare_dirs(path, tmp) -> None:
    """Rank 0, before anything is written: finish or roll back an interrupted swap, refuse to
    replace a directory that is not a checkpoint, start a fresh tmp directory."""
    old = path + ".old"
    has_index = os.path.exists(os.path.join(path, INDEX))
    if os.path.isdir(old) and os.path.exists(os.path.join(old, INDEX)) and not has_index:
        if os.path.isdir(path):
            raise CheckpointError(f"{path} has no {INDEX} and {old} holds the previous "
                                  "checkpoint; move one of them away")
        os.rename(old, path)                  # crash between the renames: roll back
        has_index = True
    elif os.path.isdir(old) and has_index:
        shutil.rmtree(old)                    # crash after the swap: finish it
    if os.path.exists(path) and not has_index and (not os.path.isdir(path) or os.listdir(path)):
        raise CheckpointError(f"{path} exists and is not a checkpoint (no {INDEX}); "
                              "refusing to replace it")
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise CheckpointError(f"directory {parent} does not exist")
    base = os.path.basename(path)
    for entry in os.listdir(parent):          # stale tmp dirs of crashed saves: garbage
        if entry.startswith(base + ".tmp-"):
            shutil.rmtree(os.path.join(parent, entry))
    os.mkdir(tmp)


def _write_index(path, tmp, index) -> None:
    """Rank 0, once every block is durable: index last, then the atomic swap."""
    name = os.path.join(tmp, INDEX)
    with open(name + ".tmp", "w") as f:
        json.dump(index, f, indent=1, default=_json_default)
        f.flush()
        os.fsync(f.fileno())
    os.replace(name + ".tmp", name)
    _fsync_dir(tmp)
    old = path + ".old"
    if os.path.exists(path):
        os.rename(path, old)
    os.rename(tmp, path)
    _fsync_dir(os.path.dirname(path))
    if os.path.exists(old):
        shutil.rmtree(old)


def save(path, engine, optimizer=None, step=0, extra=None) -> str:
    """Collective: write this engine's parameters (and optimizer state) to directory `path`.

    Each rank writes only the blocks it is the first holder of; rank 0 writes the index last
    and swaps the new directory in (see the module docstring). `extra` (rank 0's) is any
    JSON-able dict, e.g. the data position and RNG state. Returns the path."""
    comm = engine.comm
    rank = comm.Get_rank()
    path = os.path.abspath(os.fspath(path))
    tmp = f"{path}.tmp-{int(step)}"
    err = None
    try:
        if not getattr(engine, "loaded", True):
            raise ValueError("the engine holds no parameters yet: call load_checkpoint first")
        json.dumps(extra, default=_json_default)
        if optimizer is not None and not hasattr(optimizer, "state"):
            raise TypeError(f"optimizer {type(optimizer).__name__} has no .state")
        descs = _blocks(engine, optimizer)
    except Exception as e:
        err, descs = f"{type(e).__name__}: {e}", []
    _agree(comm, err)
    if rank == 0:
        _, err = _run(_prepare_dirs, path, tmp)
    _agree(comm, err)

    # 1. who writes what (control data: names and regions only)
    meta = [(k, n, key, reg, str(a.dtype), sc) for k, n, key, reg, a, sc in descs]
    gathered = comm.gather(meta, root=0)
    payload = owners = None
    if rank == 0:
        res, err = _run(_assign_writers, gathered, engine.full_shapes)
        todos, owners = res if err is None else ([[]] * len(gathered), {})
        payload = [(err, todo) for todo in todos]
    err, todo = comm.scatter(payload, root=0)
    if err is not None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise CheckpointError(err)

    # 2. write my blocks, durably, and hash them
    written = []
    try:
        for i in todo:
            kind, name, key, region, arr, _ = descs[i]
            fname = _file_name(kind, name, key, region)
            full = os.path.join(tmp, fname)
            _write_block(full, _host(engine, arr))
            written.append((i, fname, _sha256(full), os.path.getsize(full)))
        err = None
    except Exception as e:
        err = f"rank {rank}: {type(e).__name__}: {e}"
    results = comm.gather((err, written), root=0)

    # 3. rank 0: the index, last, then the swap
    if rank == 0:
        err = next((e for e, _ in results if e is not None), None)
        if err is None:
            index = _make_index(engine, optimizer, step, extra, gathered, results, owners)
            _, err = _run(_write_index, path, tmp, index)
        if err is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    _agree(comm, err if rank == 0 else None)
    return path


def _make_index(engine, optimizer, step, extra, gathered, results, owners) -> dict:
    files, where = {}, {}
    for rank, (_, written) in enumerate(results):
        for i, fname, sha, nbytes in written:
            if fname in files:
                raise CheckpointError(f"two blocks map to the file name {fname}")
            files[fname] = {"sha256": sha, "bytes": nbytes}
            where[(rank, i)] = fname
    tensors, opt_state = {}, {}
    for (kind, name, key, region), (rank, i, d) in sorted(owners.items()):
        chunk = {"file": where[(rank, i)], "offset": [a for a, _ in region]}
        entry = {"shape": list(engine.full_shapes[name]), "dtype": d[4], "chunks": []}
        if kind == "param":
            tensors.setdefault(name, entry)["chunks"].append(chunk)
        else:
            st = opt_state.setdefault(name, {"scalars": d[5], "tensors": {}})
            st["tensors"].setdefault(key, entry)["chunks"].append(chunk)
    optimizer_entry = None
    if optimizer is not None:
        optimizer_entry = {"type": type(optimizer).__name__,
                           "hyperparameters": _optimizer_hyper(optimizer), "state": opt_state}
    return {"format": FORMAT, "version": VERSION, "model": model_spec(engine.model),
            "layout": engine.layout.text, "world_size": engine.num_devices, "step": int(step),
            "extra": extra, "tensors": {n: tensors[n] for n in engine.full_shapes},
            "optimizer": optimizer_entry, "files": files}


# -- load -------------------------------------------------------------------------------------
def _resolve(path) -> str:
    """The directory holding the complete checkpoint `path` (`path.old` mid-swap)."""
    path = os.path.abspath(os.fspath(path))
    for p in (path, path + ".old"):
        if os.path.isfile(os.path.join(p, INDEX)):
            return p
    raise CheckpointError(f"{path} is not a checkpoint: no {INDEX} (missing, or an "
                          "incomplete save that never finished)")


def read_index(path) -> dict:
    """The parsed index.json of checkpoint `path` (checked for format and version)."""
    d = _resolve(path)
    try:
        with open(os.path.join(d, INDEX)) as f:
            index = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{d}/{INDEX} cannot be read: {e}") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise CheckpointError(f"{d}/{INDEX} is not an mpishard checkpoint index")
    if index.get("version") != VERSION:
        raise CheckpointError(f"{d}/{INDEX} has format version {index.get('version')}, this "
                              f"mpishard reads version {VERSION}")
    return index


class LazyArray:
    """A full array in a checkpoint, read only where sliced: `.shape`, `.dtype`, `a[slices]`
    and `np.asarray(a)`. Its chunks are memory-mapped .npy files."""

    def __init__(self, ckpt, name, entry):
        self._ckpt, self.name = ckpt, name
        self.shape = tuple(entry["shape"])
        self.dtype = np.dtype(entry["dtype"])
        self._chunks = entry["chunks"]

    ndim = property(lambda self: len(self.shape))
    size = property(lambda self: int(np.prod(self.shape, dtype=np.int64)))

    def __len__(self):
        return self.shape[0]

    def __repr__(self):
        return f"LazyArray({self.name!r}, shape={self.shape}, dtype={self.dtype})"

    def files_for(self, region) -> list:
        """Files of the chunks overlapping region [(start, stop), ...]."""
        out = []
        for c in self._chunks:
            shape = self._ckpt.file_shape(c["file"])
            if all(max(a, o) < min(b, o + n) for (a, b), o, n in zip(region, c["offset"], shape)):
                out.append(c["file"])
        return out

    def __getitem__(self, key):
        key = key if isinstance(key, tuple) else (key,)
        if any(k is Ellipsis for k in key):
            i = key.index(Ellipsis)
            key = key[:i] + (slice(None),) * (self.ndim - len(key) + 1) + key[i + 1:]
        key = key + (slice(None),) * (self.ndim - len(key))
        if len(key) != self.ndim:
            raise IndexError(f"{len(key)} indices for a {self.ndim}-d array {self.name!r}")
        region, post = [], []
        for k, n in zip(key, self.shape):
            if isinstance(k, slice):
                r = range(*k.indices(n))
                if r.step == 1 or len(r) == 0:
                    region.append((r.start, max(r.start, r.stop)) if len(r) else (0, 0))
                    post.append(slice(None))
                else:                 # read the span, then take every step-th entry
                    lo, hi = min(r[0], r[-1]), max(r[0], r[-1]) + 1
                    stop = r[-1] - lo + (1 if r.step > 0 else -1)
                    region.append((lo, hi))
                    post.append(slice(r[0] - lo, stop if stop >= 0 else None, r.step))
            else:
                i = int(k) + n if int(k) < 0 else int(k)
                if not 0 <= i < n:
                    raise IndexError(f"index {k} out of range for {n} in {self.name!r}")
                region.append((i, i + 1))
                post.append(0)
        out = np.empty([b - a for a, b in region], dtype=self.dtype)
        for c in self._chunks:                 # only chunks overlapping the region are opened
            src, dst = [], []
            for (a, b), o, n in zip(region, c["offset"], self._ckpt.file_shape(c["file"])):
                lo, hi = max(a, o), min(b, o + n)
                if lo >= hi:
                    break
                src.append(slice(lo - o, hi - o))
                dst.append(slice(lo - a, hi - a))
            else:
                out[tuple(dst)] = self._ckpt.open_file(c["file"])[tuple(src)]
        return out[tuple(post)]

    def __array__(self, dtype=None, copy=None):
        a = self[...]
        return a if dtype is None else a.astype(dtype)


class Checkpoint(Mapping):
    """Read-only mapping name -> LazyArray of the parameters of a checkpoint on disk.

    Attributes: `step`, `extra`, `layout`, `world_size`, `model_spec`, `index`, `path`;
    `model()` rebuilds the spec, `optimizer_state(name)` the state of one parameter,
    `verify()` checks every file's sha256."""

    def __init__(self, path, verify: bool = True):
        self.index = read_index(path)
        self.path = _resolve(path)
        self.verify_on_open = bool(verify)
        self._open: dict = {}
        self._verified: set = set()
        self._shapes: dict = {}
        ix = self.index
        self.step, self.extra = int(ix.get("step", 0)), ix.get("extra")
        self.layout, self.world_size = ix.get("layout"), ix.get("world_size")
        self.model_spec = ix.get("model", {})
        self._check_files()
        self._arrays = {n: LazyArray(self, n, e) for n, e in ix["tensors"].items()}

    def _entries(self):
        yield from self.index["tensors"].items()
        for name, st in ((self.index.get("optimizer") or {}).get("state") or {}).items():
            for key, e in st["tensors"].items():
                yield f"{name} ({key})", e

    def _check_files(self) -> None:
        """Every file the index names exists with its recorded size; chunks cover arrays."""
        files = self.index.get("files", {})
        for fname, info in files.items():
            full = os.path.join(self.path, fname)
            if not os.path.isfile(full):
                raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is missing")
            size = os.path.getsize(full)
            if size != info["bytes"]:
                raise CheckpointError(f"checkpoint {self.path}: shard file {fname} has {size} "
                                      f"bytes, the index says {info['bytes']} (truncated?)")
        for name, e in self._entries():
            vol = 0
            for c in e["chunks"]:
                if c["file"] not in files:
                    raise CheckpointError(f"checkpoint {self.path}: {name} names unknown file "
                                          f"{c['file']}")
                vol += int(np.prod(self.file_shape(c["file"]), dtype=np.int64))
            if vol != int(np.prod(e["shape"], dtype=np.int64)):
                raise CheckpointError(f"checkpoint {self.path}: the chunks of {name} hold {vol} "
                                      f"elements, its shape {tuple(e['shape'])} needs "
                                      f"{int(np.prod(e['shape']))}")

    def file_shape(self, fname) -> tuple:
        """Shape of a block from its .npy header (no data read)."""
        if fname not in self._shapes:
            with open(os.path.join(self.path, fname), "rb") as f:
                try:
                    fmt = np.lib.format
                    read = (fmt.read_array_header_1_0 if fmt.read_magic(f) == (1, 0)
                            else fmt.read_array_header_2_0)
                    shape, _, _ = read(f)
                except ValueError as e:
                    raise CheckpointError(f"checkpoint {self.path}: {fname} is not a valid "
                                          f".npy file: {e}") from None
            self._shapes[fname] = tuple(shape)
        return self._shapes[fname]

    def verify_file(self, fname) -> None:
        if fname in self._verified:
            return
        want = self.index["files"][fname]["sha256"]
        got = _sha256(os.path.join(self.path, fname))
        if got != want:
            raise CheckpointError(f"checkpoint {self.path}: shard file {fname} is corrupt "
                                  f"(sha256 {got[:16]}..., the index says {want[:16]}...)")
        self._verified.add(fname)

    def verify(self, files=None, comm=None) -> None:
        """Check the sha256 of `files` (default all). With `comm`: collective, each rank
        hashes a share and every rank raises the same error."""
        files = sorted(self.index["files"]) if files is None else sorted(set(files))
        if comm is None:
            for f in files:
                self.verify_file(f)
            return
        mine = files[comm.Get_rank()::comm.Get_size()]
        _agree(comm, _run(lambda: [self.verify_file(f) for f in mine])[1])

    def open_file(self, fname):
        if fname not in self._open:
            if self.verify_on_open:
                self.verify_file(fname)
            self._open[fname] = np.load(os.path.join(self.path, fname), mmap_mode="r",
                                        allow_pickle=False)
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
        return (self.index.get("optimizer") or {}).get("type")

    @property
    def optimizer_hyperparameters(self) -> dict:
        return (self.index.get("optimizer") or {}).get("hyperparameters") or {}

    def optimizer_state(self, name) -> dict:
        """{key: LazyArray, scalar: value} for parameter `name` ({} if none was saved)."""
        st = ((self.index.get("optimizer") or {}).get("state") or {}).get(name)
        if not st:
            return {}
        out = dict(st.get("scalars", {}))
        out.update({k: LazyArray(self, f"{name} ({k})", e) for k, e in st["tensors"].items()})
        return out

    def check_model(self, model) -> None:
        if model_spec(model) != self.model_spec:
            raise CheckpointError(f"checkpoint {self.path} holds a different model: "
                                  f"{_spec_text(self.model_spec)}, not {model!r}")

    def __repr__(self):
        return (f"Checkpoint({self.path!r}, step={self.step}, layout={self.layout!r}, "
                f"{len(self)} tensors)")


def _spec_text(spec) -> str:
    args = ", ".join(f"{k}={v!r}" for k, v in spec.items() if k not in ("class", "kind"))
    return f"{spec.get('class', '?')}({args})"


def load(path, verify: bool = True, model=None, comm=None) -> Checkpoint:
    """Open a checkpoint: a read-only mapping name -> LazyArray reading only what is sliced,
    so `engine.load_checkpoint(load(path))` reshards to any layout and world size.

    verify=True checks each file's sha256 before its first read. `model=` raises if the
    checkpoint holds another model; `comm=` verifies all files collectively up front."""
    ckpt = Checkpoint(path, verify=verify)
    if model is not None:
        ckpt.check_model(model)
    if comm is not None:
        ckpt.verify(comm=comm)
    return ckpt


def restore(path, engine, optimizer=None) -> int:
    """Collective exact resume: parameters, and the optimizer state sliced into this rank's
    optimizer blocks (any layout, any world size). Returns the step; `load(path).extra` has
    the rest. Raises the same CheckpointError on every rank, before touching the engine."""
    return _restore(path, engine, optimizer).step


def _restore(path, engine, optimizer) -> Checkpoint:
    comm = engine.comm
    ckpt, err = _run(load, path, True, engine.model)
    _agree(comm, err)
    shards = engine.optimizer_shards() if optimizer is not None else []
    opt_saved = optimizer is not None and ckpt.optimizer_type is not None

    def verify_needed():
        files = []
        for name in engine.local_names:
            files += ckpt[name].files_for(engine.block_region(name, "param"))
        if opt_saved:
            if ckpt.optimizer_type != type(optimizer).__name__:
                raise CheckpointError(f"checkpoint {ckpt.path} holds {ckpt.optimizer_type} "
                                      f"state, the optimizer is {type(optimizer).__name__}")
            for name, *_ in shards:
                for v in ckpt.optimizer_state(name).values():
                    if isinstance(v, LazyArray):
                        files += v.files_for(engine.block_region(name, "optimizer"))
        for f in sorted(set(files)):
            ckpt.verify_file(f)
    _agree(comm, _run(verify_needed)[1])

    def read_optimizer_state():
        """This rank's optimizer blocks as optimizer.state_dict() would return them."""
        state = {}
        for name, block, *_ in shards:
            saved = ckpt.optimizer_state(name)
            if not saved:
                continue
            region = engine.block_region(name, "optimizer")
            cut = tuple(slice(0, b - a) for a, b in region)
            state[name] = {}
            for key, v in saved.items():
                if isinstance(v, LazyArray):
                    a = np.zeros(block.shape, dtype=v.dtype)    # padding stays zero
                    a[cut] = v[tuple(slice(lo, hi) for lo, hi in region)]
                    v = a
                state[name][key] = v
        return {"type": ckpt.optimizer_type, "state": state,
                "hyperparameters": ckpt.optimizer_hyperparameters}
    sd, err = _run(read_optimizer_state) if opt_saved else (None, None)
    _agree(comm, err)

    engine.load_checkpoint(ckpt)
    if sd is not None:
        if hasattr(optimizer, "load_state_dict"):
            optimizer.load_state_dict(sd)
        else:
            optimizer.state = {n: {k: engine.xp.asarray(v) if np.ndim(v) else v
                                   for k, v in st.items()} for n, st in sd["state"].items()}
    return ckpt


# -- the training loop: a Trainer callback and resume ------------------------------------------
class Checkpointer:
    """Trainer callback: save to `path` every `every` optimizer steps and at the end (each save
    replaces the previous one atomically). The extra holds the TrainState (step, histories)
    and the data position, so `resume` continues the same loss curve."""

    def __init__(self, path, every: int = 0):
        if isinstance(every, bool) or not isinstance(every, (int, np.integer)) or every < 0:
            raise ValueError(f"checkpoint every must be an integer >= 0, got {every!r}")
        self.path, self.every, self.last_saved = os.fspath(path), int(every), None

    def save(self, trainer) -> None:
        b, st = trainer.batcher, trainer.state
        epoch, index = b.position(st.step)
        extra = {"trainer": st.to_dict(),
                 "data": {"dataset": trainer.data.name, "seed": b.seed, "batch": trainer.batch,
                          "accumulate": trainer.accumulate, "epoch": epoch,
                          "batch_index": index}}
        save(self.path, trainer.engine, trainer.optimizer, st.step, extra)
        self.last_saved = st.step
        trainer.log.info("saved checkpoint %s at step %d", self.path, st.step)

    def on_train_begin(self, trainer) -> None:
        pass

    def on_step_end(self, trainer) -> None:
        if self.every and trainer.state.step % self.every == 0:
            self.save(trainer)

    def on_evaluate(self, trainer, result) -> None:
        pass

    def on_train_end(self, trainer, metrics) -> None:
        if self.last_saved != trainer.state.step:
            self.save(trainer)


def resume(trainer, path) -> int:
    """Collective: restore parameters, optimizer state and `trainer.state` (step, histories;
    the data position follows from the step) from a Checkpointer's checkpoint. Returns the
    step. Warns when the data settings differ from the saved ones."""
    from .trainer import TrainState

    ckpt = _restore(path, trainer.engine, trainer.optimizer)
    extra = ckpt.extra or {}
    if "trainer" not in extra:
        raise CheckpointError(f"checkpoint {ckpt.path} was not written by a Trainer "
                              "(no trainer state in its extra)")
    trainer.state = TrainState.from_dict(extra["trainer"])
    data = extra.get("data", {})
    now = {"dataset": trainer.data.name, "seed": trainer.batcher.seed, "batch": trainer.batch,
           "accumulate": trainer.accumulate}
    changed = {k: (data.get(k), v) for k, v in now.items() if data.get(k) != v}
    if changed:
        trainer.log.warning("resuming with other data settings than the checkpoint's "
                            "(saved, now): %s; the data order will differ", changed)
    trainer.log.info("resumed from %s at step %d", ckpt.path, trainer.state.step)
    return trainer.state.step


def describe(path) -> str:
    """What `python -m mpishard inspect CKPT` prints."""
    ckpt = load(path, verify=False)
    ix = ckpt.index
    lines = [f"checkpoint {ckpt.path}",
             f"  model      {_spec_text(ckpt.model_spec)}",
             f"  layout     {ckpt.layout} ({ckpt.world_size} ranks)",
             f"  step       {ckpt.step}",
             f"  optimizer  {ckpt.optimizer_type or '-'} {ckpt.optimizer_hyperparameters or ''}",
             f"  files      {len(ix['files'])}, "
             f"{sum(f['bytes'] for f in ix['files'].values())} bytes"]
    opt_state = (ix.get("optimizer") or {}).get("state") or {}
    if opt_state:
        keys = sorted({k for st in opt_state.values() for k in st["tensors"]})
        steps = sorted({st["scalars"].get("step") for st in opt_state.values()} - {None})
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


# -- safetensors: one consolidated file, and PyTorch's nn.Sequential layout -------------------
#
# Name map between mpishard and a PyTorch `nn.Sequential` of `nn.Linear` (+ activations):
#
#     nn.Sequential(Linear(784, 512), ReLU(), Linear(512, 10))
#     '0.weight' (512, 784)  <->  'layer_0/weights' (784, 512)    transposed: torch is (out, in)
#     '0.bias'   (512,)      <->  'layer_0/bias'    (512,)
#     '2.weight' (10, 512)   <->  'layer_1/weights' (512, 10)
#
# The Linear modules, in the order of their numeric index, are layer_0, layer_1, ...; modules
# without a 2-D `weight` (activations) are skipped, so any numbering works on import. A common
# prefix ('net.0.weight', 'model.layers.0.weight') is allowed. On export with names="torch" the
# module index of layer i counts one module per Linear and one per activation other than
# identity before it (the nn.Sequential a user would write for the same MLP).

_TORCH_KEY = re.compile(r"^(?P<prefix>.*?)(?P<idx>\d+)\.(?P<kind>weight|bias)$")
_OURS_KEY = re.compile(r"^layer_\d+/(weights|bias)$")


def torch_name_map(tensors: Mapping) -> dict:
    """{torch key: mpishard name} for the Linear weights/biases among `tensors` (name->array)."""
    linear = {}
    for key, a in tensors.items():
        m = _TORCH_KEY.match(key)
        if m and m["kind"] == "weight" and np.ndim(a) == 2:
            linear[(m["prefix"], int(m["idx"]))] = key
    if len({p for p, _ in linear}) > 1:
        raise ValueError(f"safetensors keys have several prefixes {sorted({p for p, _ in linear})}")
    out = {}
    for i, (prefix, idx) in enumerate(sorted(linear)):
        out[f"{prefix}{idx}.weight"] = f"layer_{i}/weights"
        if f"{prefix}{idx}.bias" in tensors:
            out[f"{prefix}{idx}.bias"] = f"layer_{i}/bias"
    return out


def _torch_indices(model, n_layers) -> list:
    if model is None:
        return [2 * i for i in range(n_layers)]
    out, k = [], 0
    for spec in model.layers():
        out.append(k)
        k += 1 + (spec.activation != "identity")
    return out


def export_safetensors(path_or_params, out_file, names: str = "mpishard", model=None) -> str:
    """Write one consolidated safetensors file from a checkpoint directory or a full dict
    (e.g. engine.gather_params()). names="torch" writes the nn.Sequential layout above."""
    from safetensors.numpy import save_file

    if names not in ("mpishard", "torch"):
        raise ValueError(f"names must be 'mpishard' or 'torch', got {names!r}")
    meta = {"format": "mpishard"}
    if isinstance(path_or_params, (str, os.PathLike)):
        ckpt = load(path_or_params)
        params = {k: np.asarray(v) for k, v in ckpt.items()}
        model = model or ckpt.model()
        meta["model"] = json.dumps(ckpt.model_spec)
    else:
        params = {k: (v.get() if hasattr(v, "get") and not isinstance(v, np.ndarray)
                      else np.asarray(v)) for k, v in path_or_params.items()}
    if model is not None:
        meta["model"] = json.dumps(model_spec(model))
    if names == "torch":
        n = len([k for k in params if k.endswith("/weights")])
        idx = _torch_indices(model, n)
        out = {}
        for k, v in params.items():
            i, kind = int(k.split("/")[0][6:]), k.split("/")[1]
            out[f"{idx[i]}.{'weight' if kind == 'weights' else 'bias'}"] = \
                np.ascontiguousarray(v.T if kind == "weights" else v)
        params, meta["format"] = out, "pt"
    tmp = f"{out_file}.tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in params.items()}, tmp, metadata=meta)
    os.replace(tmp, out_file)
    return os.fspath(out_file)


def import_safetensors(file, model=None) -> dict:
    """Full parameter dict from a safetensors file written by export_safetensors or by
    PyTorch (`safetensors.torch.save_file(nn.Sequential(...).state_dict(), file)`; weights
    transposed through the name map above). `model=` checks names and shapes."""
    from safetensors.numpy import load_file

    tensors = load_file(os.fspath(file))
    if tensors and all(_OURS_KEY.match(k) for k in tensors):
        params = tensors
    else:
        mapping = torch_name_map(tensors)
        if not mapping:
            raise ValueError(f"{file}: neither mpishard names (layer_0/weights) nor an "
                             f"nn.Sequential of Linear ('0.weight'); keys {sorted(tensors)[:8]}")
        params = {ours: np.ascontiguousarray(tensors[k].T if ours.endswith("/weights")
                                             else tensors[k]) for k, ours in mapping.items()}
    if model is not None:
        model.check_params(params)
    return params

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
`save(..., assets={name: bytes or array})` adds files the checkpoint carries (a tokenizer's
files, a data set's standardisation as .npy), listed in `files` like the blocks (format.py).
Under retention (`Checkpointer(keep_last=N > 1)`) DIR holds one such directory per save,
`DIR/step-00000500/`, and `load(DIR)` opens the newest complete one (storage.py). A Trainer's
checkpoint carries in `extra` its TrainState, data position and shuffle (callback.py).
Every block is written once, by the lowest rank holding it; the save is crash-consistent: the
index is written last and the new directory swapped in atomically, so at no moment is there
no complete checkpoint (writer.py describes the steps). `load` never opens a directory
without `index.json`; it checks that every file the index names exists with its recorded
size up front, and a file's sha256 before the first read from it (a rank reads and hashes
only the files overlapping the slices it asks for).

`restore` continues exactly in any order of building: the optimizer passed, built before
the restore, or built after it (which then starts from the restored state); restorer.py.

Errors (corrupt/missing/truncated shard, missing index, another model) raise
`CheckpointError` (a ValueError). `save` and `restore` are collective and raise the same
error on every rank (no rank is left in a collective); `load` is local, and `load(path,
comm=engine)` verifies every file collectively up front. Every wait between ranks is bounded
by the engine's timeout: a rank that does not come raises CollectiveTimeout naming it on the
others (comm/objects.py), and the previous checkpoint stays intact.

The pieces live in their own modules; this package re-exports them, so `ms.checkpoint.X` is
the one place to reach any of them:
  format.py       what the others share: constants, CheckpointError, the model spec JSON
  writer.py       `save`: blocks deduplicated over ranks, crash-consistent directory swap
  reader.py       `load`: the index, lazy memory-mapped arrays, verification, `describe`
  restorer.py     `restore`: exact resume of an engine and its optimizer
  callback.py     the Trainer's `Checkpointer` callback (failure policy) and `resume`
  storage.py      retention in step folders (`latest`), the up-front directory checks
  safetensors.py  `export_safetensors` / `import_safetensors`, PyTorch's name map
"""
from .callback import FAILURE_POLICIES, Checkpointer, resume
from .format import FORMAT, INDEX, VERSION, CheckpointError, model_from_spec, model_spec
from .reader import Checkpoint, LazyArray, describe, load, read_index
from .restorer import restore
from .storage import checkpoint_bytes, is_checkpoint, latest, preflight
from .safetensors import export_safetensors, import_safetensors, torch_name_map
from .writer import save

__all__ = ["save", "load", "restore", "describe", "Checkpoint", "LazyArray", "CheckpointError",
           "Checkpointer", "resume", "export_safetensors", "import_safetensors",
           "torch_name_map", "model_spec", "model_from_spec", "read_index", "INDEX", "FORMAT",
           "VERSION", "FAILURE_POLICIES", "checkpoint_bytes", "is_checkpoint", "latest",
           "preflight"]

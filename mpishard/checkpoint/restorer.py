"""Exact resume: a checkpoint back into a live engine and its optimizer, under any layout.

    step = ms.checkpoint.restore("ckpt", engine, opt)        # collective: params + optimizer

Each rank verifies (sha256) only the files overlapping the blocks it will read, then every
rank agrees on the outcome before the engine or the optimizer is touched, so an unusable
checkpoint raises the same CheckpointError on every rank and leaves the run as it was.
"""
from __future__ import annotations

import numpy as np

from ..comm.collectives import agree
from .format import CheckpointError, run_captured
from .reader import Checkpoint, LazyArray, load


def restore(path, engine, optimizer=None) -> int:
    """Collective exact resume: parameters, and the optimizer state sliced into this rank's
    optimizer blocks (any layout, any world size). Returns the step; `load(path).extra` has
    the rest. Raises the same CheckpointError on every rank, before touching the engine."""
    return restore_state(path, engine, optimizer).step


def restore_state(path, engine, optimizer) -> Checkpoint:
    """Collective: `restore`, returning the opened Checkpoint (its `step` and `extra` are
    what a caller such as the Trainer's `resume` continues from)."""
    comm = engine.mpi_comm
    ckpt, err = run_captured(load, path, True, engine.model)
    agree(comm, err, exc=CheckpointError)
    shards = engine.optimizer_shards() if optimizer is not None else []
    opt_saved = optimizer is not None and ckpt.optimizer_type is not None
    err = run_captured(_verify_needed, ckpt, engine, optimizer if opt_saved else None,
                       shards)[1]
    agree(comm, err, exc=CheckpointError)
    sd, err = run_captured(_read_optimizer_state, ckpt, engine, shards) if opt_saved \
        else (None, None)
    agree(comm, err, exc=CheckpointError)

    engine.load_checkpoint(ckpt)
    if sd is not None:
        if hasattr(optimizer, "load_state_dict"):
            optimizer.load_state_dict(sd)
        else:
            optimizer.state = {n: {k: engine.xp.asarray(v) if np.ndim(v) else v
                                   for k, v in st.items()} for n, st in sd["state"].items()}
    return ckpt


def _verify_needed(ckpt, engine, optimizer, shards) -> None:
    """Check the sha256 of the files this rank will read: its parameter blocks, and its
    optimizer blocks when `optimizer` is given (whose type must be the saved one)."""
    files = []
    for name in engine.local_names:
        for region, _ in engine.store.block_pieces(name, "param"):
            files += ckpt[name].files_for(region)
    if optimizer is not None:
        if ckpt.optimizer_type != type(optimizer).__name__:
            raise CheckpointError(f"checkpoint {ckpt.path} holds {ckpt.optimizer_type} "
                                  f"state, the optimizer is {type(optimizer).__name__}")
        for name, *_ in shards:
            for v in ckpt.optimizer_state(name).values():
                if isinstance(v, LazyArray):
                    for region, _ in engine.store.block_pieces(name, "optimizer"):
                        files += v.files_for(region)
    for f in sorted(set(files)):
        ckpt.verify_file(f)


def _read_optimizer_state(ckpt, engine, shards) -> dict:
    """This rank's optimizer blocks as optimizer.state_dict() would return them."""
    state = {}
    for name, block, *_ in shards:
        saved = ckpt.optimizer_state(name)
        if not saved:
            continue
        pieces = engine.store.block_pieces(name, "optimizer")
        state[name] = {}
        for key, v in saved.items():
            if isinstance(v, LazyArray):
                a = np.zeros(block.shape, dtype=v.dtype)    # padding stays zero
                for region, local in pieces:                # several under a blocked split
                    a[local] = v[tuple(slice(lo, hi) for lo, hi in region)]
                v = a
            state[name][key] = v
    return {"type": ckpt.optimizer_type, "state": state,
            "hyperparameters": ckpt.optimizer_hyperparameters}

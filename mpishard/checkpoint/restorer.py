"""Exact resume: a checkpoint back into a live engine and its optimizer, under any layout.

    step = ms.checkpoint.restore("ckpt", engine, opt)        # collective: params + optimizer

Any order of building works: the optimizer passed, or built on the engine before the restore,
or built after it (it then starts from the restored state: train/optim.py hand_over_state).
Each rank verifies (sha256) only the files overlapping the blocks it will read and reads its
optimizer blocks, then every rank agrees on the outcome before the engine or the optimizer is
touched, so an unusable checkpoint raises the same CheckpointError on every rank and leaves
the run as it was. Every wait is bounded by the engine's timeout (comm/objects.py).
"""
from __future__ import annotations

import logging

import numpy as np

from ..comm.objects import agree
from ..train.optim import built_optimizer, hand_over_state
from .format import CheckpointError, run_captured
from .reader import Checkpoint, LazyArray, load

log = logging.getLogger("mpishard")


def restore(path, engine, optimizer=None) -> int:
    """Collective exact resume: the parameters, and the optimizer state sliced into this
    rank's optimizer blocks (any layout, any world size). Returns the step; `load(path).extra`
    has the rest.

    The optimizer state goes to `optimizer`; when none is passed, to the optimizer already
    built on `engine`, else to the next one built on it (which starts from it; one of another
    type raises ValueError naming the saved type). Its hyperparameters (lr, betas, ...) are
    restored too into an optimizer that exists, as torch's load_state_dict does; one built
    after the restore keeps the arguments it is built with (a warning names those that differ
    from the saved ones). To start a fresh optimizer on the saved
    weights, load them alone: `engine.load_checkpoint(ms.checkpoint.load(path))`.
    An unusable checkpoint (missing, corrupt, another model or optimizer type) raises the
    same CheckpointError on every rank before the engine is touched."""
    return restore_state(path, engine, optimizer).step


def restore_state(path, engine, optimizer=None) -> Checkpoint:
    """Collective: `restore`, returning the opened Checkpoint (its `step` and `extra` are
    what a caller such as the Trainer's `resume` continues from)."""
    comm, what = engine.comm, "checkpoint restore"
    ckpt, err = run_captured(load, path, True, engine.model)
    agree(comm, err, CheckpointError, what)
    target = optimizer if optimizer is not None else built_optimizer(engine)
    err = run_captured(_verify_needed, ckpt, engine, target)[1]
    agree(comm, err, CheckpointError, what)
    pieces, err = run_captured(_read_optimizer_pieces, ckpt, engine)
    agree(comm, err, CheckpointError, what)

    engine.load_checkpoint(ckpt)
    if ckpt.optimizer_type is not None:
        hand_over_state(engine, _state_dict(ckpt, engine, pieces), target)
    elif target is not None and engine.comm.rank() == 0:
        log.warning("checkpoint %s holds no optimizer state: the %s starts afresh", ckpt.path,
                    type(target).__name__)
    return ckpt


def _verify_needed(ckpt, engine, optimizer) -> None:
    """Check the sha256 of the files this rank will read: its parameter blocks and its
    optimizer blocks; and that `optimizer` (when given) has the saved type."""
    if optimizer is not None and ckpt.optimizer_type not in (None, type(optimizer).__name__):
        raise CheckpointError(f"checkpoint {ckpt.path} holds {ckpt.optimizer_type} "
                              f"state, the optimizer is {type(optimizer).__name__}")
    files = []
    for name in engine.local_names:
        for region, _ in engine.store.block_pieces(name, "param"):
            files += ckpt[name].files_for(region)
        for v in ckpt.optimizer_state(name).values():
            if isinstance(v, LazyArray):
                for region, _ in engine.store.block_pieces(name, "optimizer"):
                    files += v.files_for(region)
    for f in sorted(set(files)):
        ckpt.verify_file(f)


def _read_optimizer_pieces(ckpt, engine) -> dict:
    """This rank's parts of the saved optimizer state, read before the engine is touched:
    {name: {key: scalar, or [(index into the local block, values), ...]}}."""
    out = {}
    for name in engine.local_names:
        saved = ckpt.optimizer_state(name)
        pieces = engine.store.block_pieces(name, "optimizer")
        out[name] = {key: [(local, v[tuple(slice(lo, hi) for lo, hi in region)])
                           for region, local in pieces]   # several under a blocked split
                     if isinstance(v, LazyArray) else v for key, v in saved.items()}
    return out


def _state_dict(ckpt, engine, pieces) -> dict:
    """This rank's optimizer blocks, as `Optimizer.state_dict()` returns them (the blocks'
    shapes known once the engine holds its parameters: ZeRO-1/2 pad them)."""
    state = {}
    for name, block, *_ in engine.optimizer_shards():
        if not pieces.get(name):
            continue
        state[name] = {}
        for key, v in pieces[name].items():
            if isinstance(v, list):
                a = np.zeros(block.shape, dtype=ckpt.optimizer_state(name)[key].dtype)
                for local, values in v:       # padding stays zero
                    a[local] = values
                v = a
            state[name][key] = v
    return {"type": ckpt.optimizer_type, "state": state,
            "hyperparameters": ckpt.optimizer_hyperparameters}

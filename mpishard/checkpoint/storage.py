"""Where checkpoints live on disk: retention in step folders, and the checks made before
training starts (the directory is writable and has room).

Retention (`Checkpointer(keep_last=N)`, `train --keep-last N`):
  N = 1 (default): DIR itself is the checkpoint, replaced atomically at each save (writer.py).
  N > 1: DIR holds one complete checkpoint per save, `DIR/step-00000500/` (each written by
         `save` into `DIR/step-00000500.tmp-500` and renamed into place once its index is
         durable); after a save has completed, the oldest beyond the N newest complete ones
         are deleted. An incomplete folder (no index) never counts and is never the newest.
         The same pass (`retain`) removes what crashed saves left: every `step-N.tmp-S`
         (a save that never wrote its index or never renamed the folder into place) and
         `step-N.old` beside a complete `step-N` (a swap that ended before its cleanup).
         Each is a full checkpoint's size, and a requeued run may never save at step N
         again (a preemption save lands at any step). It runs on rank 0 after a save has
         completed, when no save of the job is in flight: a Checkpointer finishes its
         pending asynchronous save before it begins another, and a save completes only
         once every rank's writes have ended (writer.finish gathers them), so no such
         folder has a live writer, short of a second job writing into the same directory,
         which retention never supports (each job's pruning would delete the other's).
         A directory holding only such leftovers (a crash during the first save) holds no
         checkpoint and nothing foreign (`foreign_entries`): `--resume auto` starts fresh.
`load(DIR)` / `--resume DIR` / `inspect DIR` open DIR itself when it holds an index (a
single-directory checkpoint, also those written before retention existed), else the newest
complete `DIR/step-*` folder (`latest`).

The checks (`preflight`, collective): every rank creates and removes a probe file in the
checkpoint directory (or its parent when it does not exist yet), and asks `shutil.disk_usage`
for the free bytes there; the need is `checkpoint_bytes` (parameters and optimizer state at
the engine's full shapes and dtype, each block written once) times the checkpoints that are on
disk together at the peak of a save (the kept ones plus the one being written; the previous
one stays until the swap), less what the existing checkpoints there already occupy. Every
rank agrees on the verdict (`comm.objects.agree`, bounded by the engine's timeout), so a bad
directory is one CheckpointError on every rank before the first step.
"""
from __future__ import annotations

import os
import re
import shutil

import numpy as np

from ..comm.objects import agree
from ..train.optim import AdamW
from .format import INDEX, CheckpointError, run_captured

STEP_DIR = re.compile(r"^step-(\d+)$")
CRASHED_SAVE = re.compile(r"^(step-\d+)\.(tmp-\d+|old)$")   # what a crashed save leaves
HEADROOM = 1 << 16          # index.json and the .npy headers, per checkpoint


def step_dir(path, step: int) -> str:
    """The folder of the checkpoint of `step` under retention directory `path`."""
    return os.path.join(os.fspath(path), f"step-{int(step):08d}")


def complete_steps(path) -> list:
    """[(step, folder)] of the complete checkpoints (with an index) in `path`, oldest first."""
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    found = []
    for entry in entries:
        m = STEP_DIR.match(entry)
        if m and os.path.isfile(os.path.join(path, entry, INDEX)):
            found.append((int(m.group(1)), os.path.join(path, entry)))
    return sorted(found)


def latest(path):
    """The folder of the newest complete checkpoint under `path`, or None."""
    found = complete_steps(path)
    return found[-1][1] if found else None


def is_checkpoint(path) -> bool:
    """Does `path` hold a complete checkpoint (itself, its `.old` mid-swap, or a step folder)?"""
    path = os.path.abspath(os.fspath(path))
    return any(os.path.isfile(os.path.join(p, INDEX)) for p in (path, path + ".old")) \
        or latest(path) is not None


def prune(path, keep: int) -> list:
    """Delete the complete step folders of `path` older than the `keep` newest (call only
    once the newest is complete). Returns the folders deleted."""
    gone = [d for _, d in complete_steps(path)[:-keep]] if keep > 0 else []
    for d in gone:
        shutil.rmtree(d)
    return gone


def crashed_saves(path) -> list:
    """The folders crashed saves left in retention directory `path` (module docstring): every
    `step-N.tmp-S`, and `step-N.old` when `step-N` is complete (without it, `.old` is the
    checkpoint of step N, mid-swap, and stays)."""
    try:
        entries = sorted(os.listdir(path))
    except OSError:
        return []
    found = []
    for entry in entries:
        m = CRASHED_SAVE.match(entry)
        if m and (m.group(2) != "old" or
                  os.path.isfile(os.path.join(path, m.group(1), INDEX))):
            found.append(os.path.join(path, entry))
    return found


def retain(path, keep: int) -> list:
    """The retention pass after a completed save (rank 0, no save in flight): `prune` to the
    `keep` newest, then remove the folders of crashed saves. Returns the folders removed."""
    gone = prune(path, keep)
    for d in crashed_saves(path):
        shutil.rmtree(d)
        gone.append(d)
    return gone


def foreign_entries(path) -> list:
    """The entries of directory `path` that no save wrote: neither step folders nor the
    leftovers of crashed saves ([] when `path` does not exist). A lone complete `step-N.old`
    is no leftover but a checkpoint that `latest` does not see: it stays foreign."""
    try:
        entries = os.listdir(path)
    except OSError:
        return []
    crashed = {os.path.basename(d) for d in crashed_saves(path)}
    return sorted(e for e in entries if not (STEP_DIR.match(e) or e in crashed))


def checkpoint_bytes(engine, optimizer=None) -> int:
    """Bytes of one checkpoint of `engine` (+ `optimizer`): every parameter at its full shape
    in the engine's dtype, once, and the optimizer's arrays (AdamW two moments, SGD with
    momentum one buffer, an fp32 master copy under 16-bit parameters)."""
    itemsize = np.dtype(engine.dtype).itemsize
    elements = sum(int(np.prod(s, dtype=np.int64)) for s in engine.full_shapes.values())
    slots = 0
    if optimizer is not None:
        slots = 2 if isinstance(optimizer, AdamW) else int(bool(getattr(optimizer, "momentum",
                                                                        0)))
        slots += int(engine.precision.param.itemsize != itemsize)
    return elements * itemsize * (1 + slots) + HEADROOM


def _used_bytes(path) -> int:
    """Bytes of the files under `path` (0 when it does not exist)."""
    total = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                total += os.path.getsize(os.path.join(root, f))
            except OSError:
                pass
    return total


def check_directory(path, need: int, keep: int = 1) -> None:
    """Raise CheckpointError unless `path` (or its parent, before the first save) takes a new
    file and has room for the saves to come: (keep + 1) checkpoints of `need` bytes on disk at
    the peak, less what the checkpoints there already use."""
    path = os.path.abspath(os.fspath(path))
    where = path if os.path.isdir(path) else os.path.dirname(path)
    probe = os.path.join(where, f".mpishard-probe-{os.getpid()}")
    try:
        with open(probe, "wb") as f:
            f.write(b"probe")
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"checkpoint directory {where} is not writable: "
                              f"{e.strerror or e}") from None
    free = shutil.disk_usage(where).free
    required = max(need, (keep + 1) * need - _used_bytes(path) - _used_bytes(path + ".old"))
    if free < required:
        raise CheckpointError(f"checkpoint directory {where} has {free} bytes free, the "
                              f"checkpoints need {required} ({need} bytes each, {keep} kept "
                              f"+ 1 being written)")


def preflight(path, engine, optimizer=None, keep: int = 1) -> int:
    """Collective: `check_directory` on every rank, the same CheckpointError on every rank
    when any rank fails. Returns the bytes of one checkpoint."""
    need = checkpoint_bytes(engine, optimizer)
    err = run_captured(check_directory, path, need, keep)[1]
    agree(engine.comm, err, CheckpointError, "checkpoint preflight")
    return need

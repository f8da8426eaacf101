"""Checkpoints in the training loop: the Trainer's `Checkpointer` callback and `resume`.

    trainer.callbacks.append(Checkpointer("ckpt", every=100, keep_last=3,
                                          on_failure="continue"))
    resume(trainer, "ckpt")           # collective: params, optimizer, step, data position

`python -m mpishard train --checkpoint-dir DIR --checkpoint-every N [--keep-last N]
[--checkpoint-failures stop|continue] [--checkpoint-async] [--resume]` is this. With
`asynchronous=True` the interval saves are written by a thread while training goes on and
become the checkpoint at a later step boundary (async_writer.py); a failure is reported then,
naming the step it was saving.

Before the first step the directory is checked (storage.preflight: writable, room for the
checkpoints to come), the same CheckpointError on every rank otherwise. A save that fails
(an unwritable or full directory, an exception in any rank's block write) is a CheckpointError
on every rank (writer.save agrees on it; the swap never happened, the temporary directory is
removed, so the previous complete checkpoint is untouched): with on_failure="stop" the
Checkpointer raises it, naming the step and the last complete checkpoint; with "continue"
rank 0 logs one line, the failure is counted (`checkpoint_failures` in the metrics) and the
next interval (or the end of training) tries again.

What a save stores besides parameters and optimizer state, in the index's `extra`, is what
an exact resume needs: the TrainState (step, samples seen, histories), the data position
(epoch, batch within the epoch, samples), the shuffle (the batcher's seed: each epoch's order
is numpy's default_rng([seed, 3, epoch]).permutation, and the sha256 of the current epoch's
permutation), and the loss scaler's state when there is one. The run goes on with the same
batches under any layout and world size; `resume` warns when the settings would change them.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from ..comm.objects import agree
from ..train.trainer import Callback, TrainState
from ..validate import check_number
from .format import INDEX, CheckpointError, run_captured
from .async_writer import AsyncSave
from .restorer import restore_state
from .storage import latest, preflight, retain, step_dir
from .writer import save

FAILURE_POLICIES = ("stop", "continue")


class Checkpointer(Callback):
    """Trainer callback: save to `path` every `every` optimizer steps and at the end.

    keep_last=1: `path` is the checkpoint, replaced atomically at each save; keep_last=N > 1:
    one folder per save, `path/step-00000500/`, the N newest complete ones kept (storage.py).
    on_failure: 'stop' (raise the save's CheckpointError, on every rank) or 'continue' (log,
    count in `failures`, retry at the next interval). extra: JSON kept in every checkpoint's
    extra besides the Trainer's (train --init-from-hf: {"hf": ms.hf.source(model)}, which
    `export` writes back as `import`'s record). assets: files every checkpoint carries
    (writer.save's; train: the tokenizer's files, a data set's standardisation arrays).
    asynchronous: the interval saves write
    in a background thread and are finished at a later step boundary (async_writer.py); the
    final save and `save()` (preemption's) are synchronous, after finishing a pending one."""

    def __init__(self, path, every: int = 0, keep_last: int = 1, on_failure: str = "stop",
                 asynchronous: bool = False, extra=None, assets=None):
        self.every = check_number("checkpoint every", every, low=0, integer=True)
        self.keep_last = check_number("keep_last", keep_last, low=1, integer=True)
        if on_failure not in FAILURE_POLICIES:
            raise ValueError(f"on_failure must be one of {list(FAILURE_POLICIES)}, got "
                             f"{on_failure!r}")
        self.path, self.on_failure = os.path.abspath(os.fspath(path)), on_failure
        self.last_saved, self.failures = None, 0
        self.asynchronous, self.pending = bool(asynchronous), None   # pending: an AsyncSave
        self.extra = dict(extra or {})  # kept besides resume_extra's (train: {"hf": source})
        self.assets = dict(assets or {})

    def on_train_begin(self, trainer) -> None:
        """Collective: refuse a directory of the other retention kind, then make it (step
        folders) and check it is writable with room to spare (storage.preflight)."""
        comm = trainer.engine.comm
        err = run_captured(self._prepare, comm.rank())[1]
        agree(comm, err, CheckpointError, "checkpoint preflight")
        preflight(self.path, trainer.engine, trainer.optimizer, self.keep_last)

    def _prepare(self, rank) -> None:
        single = os.path.isfile(os.path.join(self.path, INDEX))
        if self.keep_last > 1 and single:
            raise CheckpointError(f"{self.path} holds a single checkpoint; keeping the last "
                                  f"{self.keep_last} needs a directory of step folders: give "
                                  "another directory or keep the last 1")
        if self.keep_last == 1 and latest(self.path) is not None:
            raise CheckpointError(f"{self.path} holds step folders of kept checkpoints; keep "
                                  "the last N > 1 there, or give another directory")
        if self.keep_last > 1 and rank == 0:
            os.makedirs(self.path, exist_ok=True)

    def target(self, step: int) -> str:
        return self.path if self.keep_last == 1 else step_dir(self.path, step)

    def save(self, trainer) -> None:
        """Collective save (see the module docstring for what happens when it fails); none
        when the pending asynchronous save it finishes first was of this very step."""
        self.complete(trainer)
        st = trainer.state
        if self.last_saved == st.step:      # preemption at an async interval step: saved once
            return
        try:
            save(self.target(st.step), trainer.engine, trainer.optimizer, st.step,
                 {**self.extra, **resume_extra(trainer)}, self.assets)
        except CheckpointError as e:
            self.failed(trainer, e)
            return
        self.saved(trainer, st.step)

    def save_async(self, trainer) -> None:
        """Collective: begin an asynchronous save of this step (async_writer.py)."""
        self.complete(trainer)
        st = trainer.state
        try:
            self.pending = AsyncSave(self.target(st.step), trainer.engine, trainer.optimizer,
                                     st.step, {**self.extra, **resume_extra(trainer)},
                                     self.assets)
        except CheckpointError as e:
            self.failed(trainer, e)

    def complete(self, trainer) -> None:
        """Collective: finish the pending asynchronous save, if any (waits for its write)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return
        try:
            pending.finish()
        except CheckpointError as e:
            self.failed(trainer, e, pending.step)
            return
        self.saved(trainer, pending.step)

    def saved(self, trainer, step) -> None:
        """The save of `step` is complete: log it, prune old ones and remove what crashed
        saves left (storage.retain; no save of this job is in flight now)."""
        self.last_saved = step
        trainer.log.info("saved checkpoint %s at step %d", self.target(step), step)
        if self.keep_last > 1 and trainer.rank == 0:
            gone, err = run_captured(retain, self.path, self.keep_last)
            if err:       # nothing is lost: a folder too many stays on disk
                trainer.log.warning("removing old checkpoints in %s failed: %s", self.path, err)
            elif gone:
                trainer.log.info("removed %s", ", ".join(map(os.path.basename, gone)))

    def failed(self, trainer, error, step=None) -> None:
        self.failures += 1
        kept = (f"the last complete checkpoint (step {self.last_saved}) is intact"
                if self.last_saved is not None else "nothing was saved by this run; what "
                f"{self.path} held before is intact")
        step = trainer.state.step if step is None else step
        text = f"checkpoint save at step {step} failed: {error}; {kept}"
        if self.on_failure == "stop":
            raise CheckpointError(text) from None
        if trainer.rank == 0:
            trainer.log.warning("%s (failure %d; training continues, the next save tries "
                                "again)", text, self.failures)

    def on_step_end(self, trainer) -> None:
        if self.pending is not None and self.pending.ready():      # collective
            self.complete(trainer)
        if self.every and trainer.state.step % self.every == 0:
            self.save_async(trainer) if self.asynchronous else self.save(trainer)

    def on_train_end(self, trainer, metrics) -> None:
        self.complete(trainer)
        if self.last_saved != trainer.state.step:
            self.save(trainer)
        metrics["checkpoint_failures"] = self.failures   # written to the metrics JSON after
        metrics["checkpoint_last_step"] = self.last_saved


def permutation_digest(batcher, epoch: int) -> str:
    """sha256 of the order of the training rows in `epoch` (int64 little-endian)."""
    perm = np.asarray(batcher.permutation(int(epoch)), dtype="<i8")
    return hashlib.sha256(perm.tobytes()).hexdigest()


def resume_extra(trainer) -> dict:
    """The `extra` of a Trainer checkpoint: TrainState, data position and shuffle, scaler."""
    b, st = trainer.batcher, trainer.state
    epoch, index = b.position(st.step)
    extra = {"trainer": st.to_dict(),
             "data": {"dataset": trainer.data.name, "seed": b.seed, "batch": trainer.batch,
                      "accumulate": trainer.accumulate, "epoch": epoch, "batch_index": index,
                      "samples": st.samples, "rows": b.n, "steps_per_epoch": b.steps_per_epoch,
                      "shuffle": b.shuffle, "rng": "numpy default_rng([seed, 3, epoch])",
                      "permutation_sha256": permutation_digest(b, epoch)}}
    if trainer.scaler is not None:
        extra["scaler"] = trainer.scaler.state_dict()
    return extra


def resume(trainer, path) -> int:
    """Collective: restore parameters, optimizer state, `trainer.state` (step, histories) and
    the loss scaler from a Checkpointer's checkpoint (the newest one under retention); the
    data position follows from the step. Returns the step. Warns when the data settings or
    the shuffle order differ from the saved ones (the batches would differ)."""
    ckpt = restore_state(path, trainer.engine, trainer.optimizer)
    extra = ckpt.extra or {}
    if "trainer" not in extra:
        raise CheckpointError(f"checkpoint {ckpt.path} was not written by a Trainer "
                              "(no trainer state in its extra)")
    trainer.state = TrainState.from_dict(extra["trainer"])
    if extra.get("scaler") and trainer.scaler is not None:
        trainer.scaler.load_state_dict(extra["scaler"])
    data, b = extra.get("data", {}), trainer.batcher
    now = {"dataset": trainer.data.name, "seed": b.seed, "batch": trainer.batch,
           "accumulate": trainer.accumulate}
    if "permutation_sha256" in data:
        now.update(rows=b.n, shuffle=b.shuffle,
                   permutation_sha256=permutation_digest(b, data["epoch"]))
    changed = {k: (data.get(k), v) for k, v in now.items() if data.get(k) != v}
    if changed:
        trainer.log.warning("resuming with other data settings than the checkpoint's "
                            "(saved, now): %s; the data order will differ", changed)
    trainer.log.info("resumed from %s at step %d", ckpt.path, trainer.state.step)
    return trainer.state.step

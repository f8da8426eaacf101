"""Checkpoints in the training loop: the Trainer's `Checkpointer` callback and `resume`.

    trainer.callbacks.append(Checkpointer("ckpt", every=100))   # save every 100 steps + at end
    resume(trainer, "ckpt")           # collective: params, optimizer, step, data position

`python -m mpishard train --checkpoint-dir DIR --checkpoint-every N [--resume]` is this.
A save stores the Trainer's state (step, histories) and data settings in the checkpoint's
`extra`, so a resumed run continues the same loss curve, under any layout and world size.
"""
from __future__ import annotations

import os

from ..train.trainer import Callback, TrainState
from ..validate import check_number
from .format import CheckpointError
from .restorer import restore_state
from .writer import save


class Checkpointer(Callback):
    """Trainer callback: save to `path` every `every` optimizer steps and at the end (each save
    replaces the previous one atomically). The extra holds the TrainState (step, histories)
    and the data position, so `resume` continues the same loss curve."""

    def __init__(self, path, every: int = 0):
        self.every = check_number("checkpoint every", every, low=0, integer=True)
        self.path, self.last_saved = os.fspath(path), None

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

    def on_step_end(self, trainer) -> None:
        if self.every and trainer.state.step % self.every == 0:
            self.save(trainer)

    def on_train_end(self, trainer, metrics) -> None:
        if self.last_saved != trainer.state.step:
            self.save(trainer)


def resume(trainer, path) -> int:
    """Collective: restore parameters, optimizer state and `trainer.state` (step, histories;
    the data position follows from the step) from a Checkpointer's checkpoint. Returns the
    step. Warns when the data settings differ from the saved ones."""
    ckpt = restore_state(path, trainer.engine, trainer.optimizer)
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


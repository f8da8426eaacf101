"""Preemption: SIGTERM/SIGUSR1 become one agreed stop at a step boundary, after a checkpoint.

    trainer.callbacks += [checkpointer, Preemption(StopFlag(), checkpointer, every=1)]
    try:
        trainer.fit()
    except Preempted as stop:                      # raised on every rank alike
        sys.exit(PREEMPTED_EXIT)                   # 75, EX_TEMPFAIL: "requeue me"

A batch system asks a job to stop before it kills it (Slurm `--signal=B:USR1@120`, `scancel
--signal=USR1`, the SIGTERM of a time limit or of a PBS `qdel`). The handler only records the
signal: a handler that saved would run between two bytecodes of whatever the rank was doing,
possibly inside a collective the other ranks are waiting in. Instead, every `every` optimizer
steps the ranks agree on the flags with one bounded collective:

    stop = max over ranks of (signal number seen on this rank, or 0)        one int64 Iallreduce

waited by the engine's watchdog (comm/objects.py), so a rank that alone received the signal
(mpiexec forwarding to one process, a `kill` of one pid) stops the whole job at the same step,
and no rank ever saves alone. Then the `saver` (the Checkpointer: the normal crash-safe
writer, tmp directory + atomic swap + collective verdict) writes the checkpoint unless it saved
this very step already, and `Preempted` is raised on every rank. A second signal while saving
only sets the flag again: nothing is interrupted, the save completes or fails as a whole.

The agreement costs one 8-byte non-blocking all-reduce per `every` steps (docs/clusters.md has
the measured cost); with `every=k` the stop comes at most k - 1 steps later.
"""
from __future__ import annotations

import signal

import numpy as np
from mpi4py import MPI

from ..comm.objects import wait
from .trainer import Callback

PREEMPTED_EXIT = 75                          # EX_TEMPFAIL (sysexits.h): try again later
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preempted(Exception):
    """Raised on every rank after the agreed stop's checkpoint: `signum`, `step`, `saved`."""

    def __init__(self, signum: int, step: int, saved: bool):
        self.signum, self.step, self.saved = signum, step, saved
        name = signal.Signals(signum).name
        what = f"checkpoint saved at step {step}" if saved else \
            f"no checkpoint at step {step}"
        super().__init__(f"stopped by {name} at step {step}: {what}; exit {PREEMPTED_EXIT} "
                         "(EX_TEMPFAIL): requeue with --resume auto to continue")


class StopFlag:
    """The signal a stop was asked with (0: none). `install` makes SIGTERM and SIGUSR1 set it
    (main thread only, as Python requires; the handler does nothing else), `restore` puts the
    previous handlers back (idempotent)."""

    def __init__(self, signals=STOP_SIGNALS):
        self.signum, self.signals, self.previous = 0, tuple(signals), {}

    def _handler(self, signum, frame):
        self.signum = self.signum or signum      # the first signal names the stop

    def install(self) -> "StopFlag":
        for signum in self.signals:
            self.previous.setdefault(signum, signal.signal(signum, self._handler))
        return self

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous.clear()


def any_rank(comm, value: int, what: str = "preemption check") -> int:
    """Collective: the largest `value` over the ranks of `comm` (an engine's Comm), one
    8-byte Iallreduce waited at most the engine's timeout."""
    mine = np.array([value], dtype=np.int64)
    out = np.zeros(1, dtype=np.int64)
    wait(comm, comm.mpi.Iallreduce(mine, out, MPI.MAX), what)
    return int(out[0])


class Preemption(Callback):
    """Trainer callback: from the start of `fit` to its end the StopFlag's handlers are
    installed; every `every` steps the ranks agree on it; on a stop, save through `saver` (an
    object with `save(trainer)` and `last_saved`, the Checkpointer; None: no checkpoint),
    restore the handlers and raise Preempted on every rank. A caller that catches other
    exceptions out of `fit` calls `flag.restore()` itself."""

    def __init__(self, flag: StopFlag, saver=None, every: int = 1):
        if int(every) < 1:
            raise ValueError(f"preemption check every must be >= 1 step, got {every}")
        self.flag, self.saver, self.every = flag, saver, int(every)

    def on_train_begin(self, trainer) -> None:
        self.flag.install()

    def on_train_end(self, trainer, metrics) -> None:
        self.flag.restore()

    def on_step_end(self, trainer) -> None:
        step = trainer.state.step
        if step % self.every:
            return
        signum = any_rank(trainer.engine.comm, self.flag.signum)
        if not signum:
            return
        saved = False
        if self.saver is not None:
            if self.saver.last_saved != step:
                self.saver.save(trainer)             # collective, crash-safe (writer.py)
            saved = self.saver.last_saved == step
        self.flag.restore()
        raise Preempted(signum, step, saved)


__all__ = ["PREEMPTED_EXIT", "Preempted", "Preemption", "StopFlag", "any_rank"]

"""Trace a window of a training run: `train --trace DIR --trace-steps A:B`, or in Python

    trainer.callbacks.append(TraceSteps("runs/trace", first=2, last=4))

A Trainer callback that starts `engine.trace(DIR)` (parallel/tracing.py) just before optimizer
step `first` and stops it, writing the merged DIR/trace.json, right after step `last` (steps
counted from 1, as the log counts them, both included). Whatever the engine runs in between is
recorded: the micro-steps' layers, loss, collectives and pipeline actions, gradient clipping,
the optimizer step, checkpoint saves and an evaluation made at a step of the window (the
final evaluation at the end of the run is not traced). A window, not the whole run, keeps the
file small: a step is tens of spans per rank (hundreds under a pipeline with many
microbatches), ~200 bytes each in the JSON; 3 steps of the dp=2,tp=2 GPT on 4 ranks in
docs/planning-and-tracing.md are 456 spans, 88 KB.

DEFAULT_STEPS is steps 2 to 4: step 1 pays one-time costs (first allocations, the result
pool filling, BLAS warm-up) that are not what later steps look like. A default window that
runs past the end is clipped to the run, and a run of one step traces that step.
"""
from __future__ import annotations

from .trainer import Callback

DEFAULT_STEPS = (2, 4)


def parse_steps(text: str) -> tuple:
    """'A:B' -> (A, B); 'A:' -> (A, None) (to the end of the run); 'all' -> (1, None).
    Raises ValueError with the rule in the message."""
    rule = (f"--trace-steps must be A:B with 1 <= A <= B (optimizer steps, both included), "
            f"A: (from A to the end) or all, got {text!r}")
    if text == "all":
        return 1, None
    first, sep, last = text.partition(":")
    try:
        a = int(first)
        b = int(last) if last else None
    except ValueError:
        raise ValueError(rule) from None
    if not sep or a < 1 or (b is not None and b < a):
        raise ValueError(rule)
    return a, b


def window(steps, done: int, total: int) -> tuple:
    """The (first, last) steps to trace of a run that has done `done` of `total` steps;
    `steps` is parse_steps' pair or None for the default. Raises ValueError when a window
    given explicitly runs no step of this run."""
    if steps is None:                 # the default: clipped to the steps this run has
        first = min(done + DEFAULT_STEPS[0], total)
        return first, min(done + DEFAULT_STEPS[1], total)
    first, last = steps
    last = total if last is None else min(last, total)
    if first <= done or first > last:
        raise ValueError(f"--trace-steps {first}:{'' if steps[1] is None else steps[1]} "
                         f"traces no step of this run, which runs steps {done + 1} to {total}")
    return first, last


class TraceSteps(Callback):
    """Trace optimizer steps `first`..`last` into `directory` (collective, every rank)."""

    def __init__(self, directory, first: int, last: int):
        if not 1 <= first <= last:
            raise ValueError(f"TraceSteps needs 1 <= first <= last, got {first}, {last}")
        self.directory, self.first, self.last = str(directory), int(first), int(last)
        self.trace = None
        self.path = None           # DIR/trace.json once written

    def on_train_begin(self, trainer) -> None:
        self._maybe_start(trainer)

    def on_step_end(self, trainer) -> None:
        step = trainer.state.step
        if self.trace is not None and step >= self.last:
            self.path = self.trace.stop()
            self.trace = None
        self._maybe_start(trainer)

    def on_train_end(self, trainer, metrics: dict) -> None:
        if self.trace is not None:          # the run ended inside the window
            self.path = self.trace.stop()
            self.trace = None

    def _maybe_start(self, trainer) -> None:
        if self.trace is None and self.path is None and trainer.state.step + 1 == self.first:
            self.trace = trainer.engine.trace(self.directory)
            self.trace.meta["steps"] = [self.first, self.last]
            self.trace.start()

"""What the training loop does when a step's loss or gradients are not finite (inf/nan).

    stop (default)  the step runs as usual; a non-finite global mean loss ends training with
                    one FloatingPointError (the same float on every rank, so every rank stops)
    skip            before the optimizer update every rank learns whether the loss (already
                    global) or any rank's gradients (one all_reduce(max) of a flag, the fp16
                    GradScaler's check, scaler.nonfinite_gradients) are non-finite; if so the
                    update is dropped (parameters and optimizer state untouched, the data moves
                    on), the step is counted, and `max_in_row` such steps in a row end training
                    with one FloatingPointError

With a GradScaler (float16) the scaler already skips on non-finite gradients (an overflow is
expected there and backs off the scale), so the guard checks only the loss.

Numpy's overflow/invalid RuntimeWarnings are silenced around a step (`quiet()`): the guard, not
a warning printed by every rank, reports a diverging run.
"""
from __future__ import annotations

import math

import numpy as np

from ..validate import check_number
from .scaler import nonfinite_gradients

NONFINITE_POLICIES = ("stop", "skip")
DEFAULT_MAX_NONFINITE = 10
ADVICE = "lower --lr or enable --clip"


def quiet():
    """np.errstate that keeps overflow/invalid/divide warnings of a diverging step silent."""
    return np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore")


class NonFiniteGuard:
    """The non-finite policy of one Trainer: `allows_update(loss)` before the optimizer
    update, `end_of_step(loss, step)` after it (raises FloatingPointError on every rank)."""

    def __init__(self, engine, policy="stop", max_in_row=DEFAULT_MAX_NONFINITE,
                 check_gradients=True):
        if policy not in NONFINITE_POLICIES:
            raise ValueError(f"on_nonfinite must be one of {list(NONFINITE_POLICIES)}, "
                             f"got {policy!r}")
        self.engine, self.policy = engine, policy
        self.max_in_row = int(check_number("max_nonfinite", max_in_row, low=1, integer=True))
        self.check_gradients = bool(check_gradients)
        self.skipped = 0              # steps whose update was dropped, in all
        self.in_row = 0               # ... in a row, up to the last step
        self.last_skipped = False

    def allows_update(self, loss: float) -> bool:
        """skip: False when the loss or (one collective) any rank's gradients are non-finite;
        stop: always True. The same answer on every rank."""
        if self.policy == "stop":
            self.last_skipped = False
            return True
        bad = not math.isfinite(loss)
        if not bad and self.check_gradients:
            bad = nonfinite_gradients(self.engine)
        self.last_skipped = bad
        return not bad

    def end_of_step(self, loss: float, step: int, log=None) -> None:
        """Count a skipped step; raise FloatingPointError when the policy says stop."""
        if self.policy == "stop":
            if not math.isfinite(loss):
                raise FloatingPointError(f"loss is {loss} at step {step}; {ADVICE}")
            return
        if not self.last_skipped:
            self.in_row = 0
            return
        self.skipped += 1
        self.in_row += 1
        what = "loss" if not math.isfinite(loss) else "gradients"
        if self.in_row >= self.max_in_row:
            raise FloatingPointError(
                f"{self.in_row} non-finite steps in a row (steps {step - self.in_row + 1} to "
                f"{step}, the last with non-finite {what}, loss {loss}); {ADVICE}")
        if log is not None:
            log.info("step %d: non-finite %s (loss %s), update skipped (%d in a row; %d stop "
                     "training)", step, what, loss, self.in_row, self.max_in_row)


__all__ = ["DEFAULT_MAX_NONFINITE", "NONFINITE_POLICIES", "NonFiniteGuard", "quiet"]

"""Learning-rate schedules: functions step -> lr that the Trainer sets on its optimizer.

    schedule = cosine_schedule(1e-3, total_steps=1000, warmup_steps=100)
    Trainer(engine, opt, data, steps=1000, schedule=schedule)     # opt.lr = schedule(step)

`step` is the 0-based index of the optimizer step about to run. `make_lr_schedule` picks one
by name (the `train --schedule` option).
"""
from __future__ import annotations

import math

from ..validate import check_number


def constant_schedule(lr, warmup_steps=0):
    """step -> lr, after a linear warm-up from 0 over `warmup_steps` (step is 0-based)."""
    lr = check_number("lr", lr, low=0)
    warmup_steps = check_number("warmup_steps", warmup_steps, low=0, integer=True)

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return lr * step / warmup_steps
        return lr
    return schedule


def cosine_schedule(lr, total_steps, warmup_steps=0, min_lr=0.0):
    """step -> lr: linear warm-up 0 -> lr over `warmup_steps`, then a half cosine lr -> min_lr
    reached at `total_steps` (the formula of transformers' get_cosine_schedule_with_warmup,
    with a floor). `step` is the 0-based index of the optimizer step about to run."""
    lr = check_number("lr", lr, low=0)
    total_steps = check_number("total_steps", total_steps, low=1, integer=True)
    warmup_steps = check_number("warmup_steps", warmup_steps, low=0, integer=True)
    min_lr = check_number("min_lr", min_lr, low=0)
    if min_lr > lr:
        raise ValueError(f"min_lr {min_lr:g} must not exceed lr {lr:g}")

    def schedule(step: int) -> float:
        if step < warmup_steps:
            return lr * step / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_lr + (lr - min_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return schedule


def make_lr_schedule(name, lr, total_steps, warmup_steps=0, min_lr=0.0):
    """'constant' or 'cosine' -> a step -> lr function."""
    if name == "constant":
        return constant_schedule(lr, warmup_steps)
    if name == "cosine":
        return cosine_schedule(lr, total_steps, warmup_steps, min_lr)
    raise ValueError(f"unknown schedule {name!r}; choose 'constant' or 'cosine'")


__all__ = ["constant_schedule", "cosine_schedule", "make_lr_schedule"]

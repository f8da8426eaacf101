"""Dynamic loss scaling for float16 (PyTorch's torch.amp.GradScaler rules).

float16 has 5 exponent bits: gradients below ~6e-8 flush to zero when they travel in float16
(comm_dtype="float16") and large ones overflow to inf. The scaler multiplies the loss gradient
by `scale` (train_step's grad_scale), divides the gradients by it before clipping and the
optimizer, and skips the step when any gradient on ANY rank is inf/nan (one all_reduce(max) of
a flag over the whole world, so every rank skips together):

    scaled   loss, grads = engine.train_step(x, t, loss_fn, grad_scale=scaler.scale)
    step     scaler.step(optimizer, max_norm=clip)   # unscale, agree, clip, step or skip
    found inf:  scale *= backoff_factor (0.5), step skipped, skipped_steps += 1
    else:       after growth_interval (2000) good steps in a row, scale *= growth_factor (2)

Defaults are PyTorch's: init_scale 2**16, growth 2, backoff 0.5, growth_interval 2000.
"""
from __future__ import annotations

import numpy as np

from ..validate import check_number
from .optim import clip_grad_norm


def nonfinite_gradients(engine, multiply=None) -> bool:
    """True when a gradient block on ANY rank holds inf/nan: one all_reduce(max) of a flag
    over the whole world, so every rank gets the same answer. `multiply` first scales this
    rank's blocks in place (the scaler's unscale)."""
    bad = 0.0
    for _, _, g, _ in engine.optimizer_shards():
        if multiply is not None:
            g *= multiply
        if g.size and not bool(engine.xp.isfinite(g).all()):
            bad = 1.0
    flag = engine.all_reduce(np.array([bad], dtype=np.float64), op="max", group=None)
    return bool(engine.backend.to_host(flag)[0] > 0)


class GradScaler:
    """Loss scale of one engine; keeps `optimizer_shards`, `all_reduce` and `backend` of it."""

    def __init__(self, engine, init_scale=2.0 ** 16, growth_factor=2.0, backoff_factor=0.5,
                 growth_interval=2000):
        self.engine = engine
        self.scale = check_number("init_scale", init_scale, low=0, low_open=True)
        self.growth_factor = check_number("growth_factor", growth_factor, low=1, low_open=True)
        self.backoff_factor = check_number("backoff_factor", backoff_factor, low=0, high=1,
                                           low_open=True)
        self.growth_interval = int(check_number("growth_interval", growth_interval, low=1))
        self.good_steps = 0            # finite steps since the last growth or backoff
        self.skipped_steps = 0

    def unscale(self) -> bool:
        """Divide this rank's gradient blocks by the scale in place; True when a gradient on
        any rank is inf/nan (collective over the whole world: one all_reduce(max))."""
        return nonfinite_gradients(self.engine, 1.0 / self.scale)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow; grow after growth_interval finite steps in a row."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.good_steps = 0
            self.skipped_steps += 1
            return
        self.good_steps += 1
        if self.good_steps == self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def step(self, optimizer, max_norm=None):
        """Unscale, then clip (max_norm) and step, or skip on inf/nan; update the scale.
        Returns (stepped, grad norm or None), the same on every rank."""
        found_inf = self.unscale()
        norm = None
        if not found_inf:
            if max_norm is not None:
                norm = clip_grad_norm(self.engine, None, max_norm)
            optimizer.step()
        self.update(found_inf)
        return not found_inf, norm

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps,
                "skipped_steps": self.skipped_steps}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
        self.skipped_steps = int(sd["skipped_steps"])


__all__ = ["GradScaler", "nonfinite_gradients"]

"""AdamW's update of one parameter block as one numba loop (the `cpu-fused` extra).

optim.AdamW.update on numpy runs ~10 whole-array passes per block (decay, lerp, two for the
second moment, sqrt, divide, add, divide, scale, subtract) and allocates four temporaries;
in a GPT-2-small step at one rank that is a large share of the step. `adamw` is the same
arithmetic, element by element, in one pass over p, g, m, v: every scalar is rounded to the
block's dtype first (as numpy does with a Python float beside an array) and every operation
is in the numpy path's order, without fast-math (no FMA contraction), so the result is bit
for bit the numpy one in float32 and float64 (tests/train/test_optim_fused.py).

Compiled by nn/cpu_fused.jit: numpy's error model, so the square root's and divisions' loop
vectorises (numba's default tests each divisor to raise, one element at a time: 5x slower).

Used when nn/cpu_fused.use() allows it for the four arrays (numba present,
MPISHARD_CPU_FUSED != "0", float32/float64 numpy) and p, m, v are C-contiguous (updated in
place through a flat view).
"""
from __future__ import annotations

import math

from ..nn.cpu_fused import jit, use


@jit
def _adamw(p, g, m, v, decay, c1, b2, c2, step_size, bias2, eps):
    for i in range(p.shape[0]):
        gi = g[i]
        pi = p[i] * decay                       # decoupled decay first
        mi = m[i] + c1 * (gi - m[i])            # m + (1 - b1)(g - m)
        vi = v[i] * b2
        vi += c2 * (gi * gi)                    # b2 v + (1 - b2) g^2
        denom = math.sqrt(vi) / bias2 + eps
        p[i] = pi - step_size * (mi / denom)
        m[i] = mi
        v[i] = vi


def usable(p, g, m, v) -> bool:
    """Whether `adamw` runs for these blocks (see the module docstring)."""
    return use(p, g, m, v) and all(a.flags.c_contiguous for a in (p, m, v))


def adamw(p, g, m, v, lr, betas, eps, weight_decay, t) -> None:
    """One AdamW step (optim.AdamW's rule, step number `t` >= 1) on p, m, v in place."""
    dt = p.dtype.type
    b1, b2 = betas
    decay = 1.0 - lr * weight_decay if weight_decay else 1.0
    _adamw(p.reshape(-1), g.reshape(-1), m.reshape(-1), v.reshape(-1), dt(decay),
           dt(1.0 - b1), dt(b2), dt(1.0 - b2), dt(lr / (1.0 - b1 ** t)),
           dt(math.sqrt(1.0 - b2 ** t)), dt(eps))


__all__ = ["adamw", "usable"]

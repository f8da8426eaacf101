"""Losses with PyTorch's default reductions: value and gradient, on any array module.

Every loss is called as `loss(y, t) -> (value, dy)`: `value` is a Python float, the mean over
this rank's rows (the DDP/Horovod convention), and `dy = dL/dy` of that local mean. Inside
a training step the engine calls `loss.pair(y, t)` through `step_pair`, which also applies
the step's gradient scale (CrossEntropy's pair takes it, and 16-bit logits as they are); the
value may be a 0-d device array that engine.train_step reads with float() once the backward
is launched.
The engines average values and gradients over the data-parallel axes, which for equal local
batches gives the single-device numbers of the mean over the global batch.

- `MSE`: mean over all elements of (y - t)^2            (torch.nn.MSELoss())
- `BCE`: mean over all elements of -(t log y + (1-t) log(1-y)) on probabilities, each log
  clamped at -100                                       (torch.nn.BCELoss())
- `CrossEntropy`: logits (B, C), integer labels (B,), mean over rows of -log softmax(y)[t];
  logits (B, T, C) with labels (B, T): mean over all B*T tokens  (torch.nn.CrossEntropyLoss());
  a label equal to `ignore_index` (-100, PyTorch's default) counts nowhere: the mean is over
  the counted labels, and the ignored positions get a zero gradient.

The global-token mean. With ignored labels, ranks count different numbers of targets, and the
mean of per-rank means is not the mean over the global batch. `loss.over(n)` is the same loss
divided by n instead of its own count (`counted(t)`): the engine gives each rank n = (counted
targets of the global batch) / (ranks averaged over x microbatches), so that the engines'
average over ranks and microbatches is sum(token losses) / (global count) exactly
(engine.train_step's `count`).
"""
from __future__ import annotations

import copy
import inspect
from functools import lru_cache

import numpy as np

from . import cpu_rows, cuda_ops, fused
from .functional import array_module
from .gemm import is_low, widened


class Loss:
    name = "loss"

    def __call__(self, y, t):
        return self.value(y, t), self.grad(y, t)

    def pair(self, y, t):
        """(value, dy) for a training step that has checked t already (the engine's
        check_targets, before the forward): __call__'s, except that the value may be a 0-d
        device array not yet read back (CrossEntropy on cupy), so that reading it, a wait for
        the device, comes after the backward is launched, not between forward and backward
        (engine.train_step reads it with float())."""
        return self(y, t)

    def value(self, y, t) -> float:
        raise NotImplementedError

    def grad(self, y, t):
        raise NotImplementedError

    denominator = None       # over(n): divide by n instead of counted(t)

    def counted(self, t) -> int:
        """How many target elements this loss averages over: all of them (CrossEntropy: the
        labels that are not ignore_index)."""
        return int(t.size)

    def over(self, denominator: float) -> "Loss":
        """This loss with its sum divided by `denominator` instead of counted(t): a copy
        (module docstring, the global-token mean). Cross-entropy only."""
        raise ValueError(f"{self.name}: a global target count (count=) applies to "
                         f"cross_entropy only")

    def check(self, y, t):
        if y.shape[0] != t.shape[0]:
            raise ValueError(f"{self.name}: output has {y.shape[0]} rows but target has "
                             f"{t.shape[0]}")


class MSE(Loss):
    name = "mse"

    def check(self, y, t):
        super().check(y, t)
        if y.shape != t.shape:
            raise ValueError(f"mse: output shape {y.shape} != target shape {t.shape}")

    def value(self, y, t):
        self.check(y, t)
        d = y - t
        return float((d * d).mean())

    def grad(self, y, t):
        return (2.0 / y.size) * (y - t)         # d/dy mean((y - t)^2)


class BCE(Loss):
    """Binary cross entropy on probabilities (after a sigmoid), like torch.nn.BCELoss."""

    name = "bce"
    eps = 1e-12  # PyTorch clamps the denominator y(1-y) at 1e-12 in the backward

    def check(self, y, t):
        super().check(y, t)
        if y.shape != t.shape:
            raise ValueError(f"bce: output shape {y.shape} != target shape {t.shape}")

    def value(self, y, t):
        self.check(y, t)
        xp = array_module(y)
        with np.errstate(divide="ignore"):          # log(0) = -inf, clamped like PyTorch
            log_y = xp.maximum(xp.log(y), -100.0)
            log_1my = xp.maximum(xp.log1p(-y), -100.0)
        return float(-(t * log_y + (1.0 - t) * log_1my).mean())

    def grad(self, y, t):
        xp = array_module(y)
        return (y - t) / xp.maximum(y * (1.0 - y), self.eps) / y.size


class CrossEntropy(Loss):
    """Softmax cross entropy on logits with integer labels, mean over every counted position:
    logits (B, C) with labels (B,), or a sequence model's (B, T, C) with (B, T) (the mean over
    the B*T tokens, like torch.nn.CrossEntropyLoss on the flattened (B*T, C)). A label equal
    to `ignore_index` (default -100, as PyTorch's) is not counted: no loss, zero gradient; a
    call where every label is ignored gives 0.0 and a zero gradient (PyTorch: nan)."""

    name = "cross_entropy"

    def __init__(self, ignore_index: int = -100):
        self.ignore_index = int(ignore_index)

    def over(self, denominator: float) -> "CrossEntropy":
        out = copy.copy(self)
        out.denominator = float(denominator)
        return out

    def counted(self, t) -> int:
        return int((t != self.ignore_index).sum())

    def check_shapes(self, y, t):
        """The checks that read no label (no wait for a device): shapes and dtype."""
        super().check(y, t)
        if y.ndim not in (2, 3) or t.ndim != y.ndim - 1 or tuple(y.shape[:-1]) != tuple(t.shape):
            raise ValueError(f"cross_entropy: expects logits (B, C) with labels (B,) or logits "
                             f"(B, T, C) with labels (B, T), got {tuple(y.shape)} and "
                             f"{tuple(t.shape)}")
        if t.dtype.kind not in "iu":
            raise TypeError(f"cross_entropy: labels must be integers, got {t.dtype}")

    def check(self, y, t):
        self.check_shapes(y, t)
        if t.size:                             # one host read; the message's only on error
            bad = (t != self.ignore_index) & ((t < 0) | (t >= y.shape[-1]))
            if bool(bad.any()):
                kept = t[t != self.ignore_index]
                raise ValueError(f"cross_entropy: labels must lie in [0, {y.shape[-1]}) or be "
                                 f"ignore_index={self.ignore_index}, got [{int(kept.min())}, "
                                 f"{int(kept.max())}]")

    def divisor(self, t) -> float:
        """What the summed token losses are divided by: `denominator` when set (over), else
        the counted labels; 1 where nothing counts (the sum is then 0)."""
        n = self.counted(t) if self.denominator is None else self.denominator
        return n if n > 0 else 1.0

    @staticmethod
    def _log_softmax(y):
        xp = array_module(y)
        z = y - y.max(axis=-1, keepdims=True)
        return z - xp.log(xp.exp(z).sum(axis=-1, keepdims=True))

    def __call__(self, y, t):
        """(value, dy) from one log-softmax."""
        self.check(y, t)
        value, dy = self.pair(y, t)
        return float(value), dy

    def pair(self, y, t, scale=None):
        """(value, dy) checking shapes only (Loss.pair: the labels' range was checked before
        the step); on cupy the value, and the count of the labels it divides by, stay on the
        device (no read back).

        scale: the step's gradient scale (step_pair's), or None. With a scale, dy is
        multiplied by it, and 16-bit logits (a device's 16-bit step, autocast.Narrow.kept)
        give a 16-bit dy, the array the head's backward matmul takes: on cupy one kernel
        reads the logits where they are and writes it (cuda_ops.cross_entropy), elsewhere
        the logits are widened, the float32 loss runs, and dy is scaled and rounded. The
        values are the float32 loss's on the widened logits either way (the head's backward
        rounds dy to 16 bits itself). Without a scale, 16-bit logits are widened first."""
        self.check_shapes(y, t)
        xp = array_module(y)
        low = y.dtype if is_low(y) else None
        if scale is None:
            y, low = widened(y), None
        flat_t = t.reshape(-1)
        keep = flat_t != self.ignore_index
        y2 = y.reshape(-1, y.shape[-1])
        if fused.use(xp):                                            # cupy: 4 passes, not ~11
            n = (self.divisor(t) if self.denominator is not None     # (0: 1, as divisor says)
                 else xp.maximum(keep.sum(), 1).astype(np.float32 if low else y.dtype))
            if low is not None:                                      # 16 bits: 1 kernel
                rows, dy = cuda_ops.cross_entropy(xp, y2, xp.where(keep, flat_t, 0), keep, n,
                                                  scale)
                return -rows.sum() / n, dy.reshape(y.shape)
            value, dy = fused.cross_entropy(xp, y2, t, keep, n)
            return value, scaled(dy, scale).reshape(y.shape)
        y2 = widened(y2)
        n = self.divisor(t)
        if cpu_rows.takes_loss(y2, flat_t):                          # numpy + numba: in place
            value, dy = cpu_rows.cross_entropy(y2, flat_t, keep, n)
        else:
            keep = None if bool(keep.all()) else keep                # one host read per call
            lp = self._log_softmax(y2)                               # (N, C), N = B or B*T
            value, dy = self._value(lp, flat_t, keep, n), self._grad(lp, flat_t, keep, n)
        dy = scaled(dy, scale)
        return value, (dy if low is None else dy.astype(low)).reshape(y.shape)

    def value(self, y, t):
        self.check(y, t)
        flat_t = t.reshape(-1)
        return self._value(self._log_softmax(y.reshape(-1, y.shape[-1])), flat_t,
                           self._kept(flat_t), self.divisor(t))

    def grad(self, y, t):
        flat_t = t.reshape(-1)
        return self._grad(self._log_softmax(y.reshape(-1, y.shape[-1])), flat_t,
                          self._kept(flat_t), self.divisor(t)).reshape(y.shape)

    def _kept(self, flat_t):
        """The counted labels' mask (N,), or None when every label counts."""
        keep = flat_t != self.ignore_index
        return None if bool(keep.all()) else keep

    @staticmethod
    def _value(lp, t, keep, n) -> float:
        """sum over counted rows (keep; None: all) of -log softmax[t], over n."""
        xp = array_module(lp)
        if keep is None:                                              # nothing ignored
            return float(-lp[xp.arange(lp.shape[0]), t].sum() / n)
        picked = lp[xp.arange(lp.shape[0]), xp.where(keep, t, 0)]   # (N,)
        return float(-xp.where(keep, picked, 0).sum() / n)  # an ignored row: 0, even inf/nan

    @staticmethod
    def _grad(lp, t, keep, n):
        """(softmax - onehot) / n on counted rows, 0 on ignored ones (even where their
        logits are inf or nan, as the kernels give: torch gives nan there), in place on lp
        (the caller's temporary)."""
        xp = array_module(lp)
        p = xp.exp(lp, out=lp)                                       # softmax, (N, C)
        rows = xp.arange(p.shape[0])
        if keep is None:                                              # nothing ignored
            p[rows, t] -= 1.0                                        # softmax - onehot
            p /= n
            return p
        p[rows, xp.where(keep, t, 0)] -= keep                        # softmax - onehot
        p /= n
        p[~keep] = 0                                                 # 0 on ignored rows
        return p


def scaled(dy, scale):
    """dy times the gradient scale, in place (dy is the loss's own new array); None or 1:
    dy as it is."""
    if scale is not None and scale != 1.0:
        dy *= scale
    return dy


def step_pair(loss, y, t, scale=None):
    """(value, dy * scale) of `loss` inside a training step (scale: the step's gradient
    scale, None for 1): its `pair` (the value possibly still on the device, Loss.pair) where
    it has one defined at or below the class that defines its call, else its call (a
    subclass that overrides __call__ alone, label smoothing say, is called). A pair that
    takes `scale` (CrossEntropy's) gets it, and with it the logits as they are (16 bits in a
    device's 16-bit step: its dy is then 16-bit too); any other loss gets 16-bit logits
    widened to float32, and its dy is scaled after."""
    cls = type(loss)
    uses_pair = pair_owner(cls)
    if uses_pair and takes_scale(cls) and scale is not None:
        return loss.pair(y, t, scale=scale)
    y = widened(y)
    value, dy = loss.pair(y, t) if uses_pair else loss(y, t)
    return value, (dy if scale is None or scale == 1.0 else dy * scale)


@lru_cache(maxsize=None)
def pair_owner(cls) -> bool:
    """Whether a loss of class `cls` is called through its `pair` (step_pair)."""
    owner = {name: next((c for c in cls.__mro__ if name in c.__dict__), None)
             for name in ("pair", "__call__")}
    return owner["pair"] is not None and issubclass(owner["pair"], owner["__call__"])


@lru_cache(maxsize=None)
def takes_scale(cls) -> bool:
    """Whether the `pair` of loss class `cls` takes the gradient scale."""
    return "scale" in inspect.signature(cls.pair).parameters


LOSSES = {"mse": MSE, "bce": BCE, "cross_entropy": CrossEntropy, "ce": CrossEntropy}


def get_loss(name) -> Loss:
    if isinstance(name, Loss):
        return name
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; choose one of {sorted(LOSSES)}")
    return LOSSES[name]()

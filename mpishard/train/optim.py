"""Optimizers on local shards, and global-norm clipping aware of sharding.

Each optimizer keeps two things of the engine: `optimizer_shards`, which lists

    (name, param block, grad block, replication)

and `after_optimizer_step`. It updates each parameter block in place; its state (momentum
buffer, Adam moments) is created with the block's shape, so the state has exactly the sharding
of its parameter: tp-split under tp, split again under fsdp/ZeRO, replicated where the
parameter is. After the update it calls `after_optimizer_step()` (ZeRO-1/2 all-gather the
updated slices there).

The update rules are PyTorch's, so a user moving from PyTorch gets the same numbers:

    SGD     g <- g + wd p                       (weight decay added to the gradient)
            b <- g on the first step, else b <- mu b + g        (dampening 0)
            p <- p - lr b   (or p - lr g without momentum)
    AdamW   p <- p (1 - lr wd)                  (decoupled decay, first)
            m <- m + (1 - b1)(g - m)            v <- b2 v + (1 - b2) g^2
            p <- p - lr/(1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)

Clipping follows `torch.nn.utils.clip_grad_norm_`: total = ||all gradients||_2, every gradient
multiplied by min(1, max_norm / (total + 1e-6)). The total is global: each rank sums the squares
of its grad blocks divided by their replication (the number of ranks holding an identical copy),
and one all_reduce(sum) over the whole world adds the rest. A replicated block is therefore
counted once and a sharded one summed over its shards, on every layout.

With numba installed (the `cpu-fused` extra) AdamW's update of a float32/float64 numpy block
is one fused loop, bit for bit the same numbers (optim_fused.py; MPISHARD_CPU_FUSED=0 turns it
off). On a GPU AdamW updates every block of a step in one launch of nn/cuda_ops' multi-tensor
kernel, the same numbers element for element (MPISHARD_FUSED=0 turns it off).

Mixed precision (parameters stored in bfloat16/float16, parallel/precision.py): the update runs
on an fp32 master copy of each block (state key 'master'), which is then rounded into the
stored parameter; gradients are fp32 already.

Resume in any order (`ms.checkpoint.restore`): restored optimizer state goes to the optimizer
given, else to the optimizer last built on the engine, else it is kept for the next optimizer
built on the engine, which starts from it (`hand_over_state`). So `opt = AdamW(engine);
restore(path, engine)` and `restore(path, engine); opt = AdamW(engine)` both continue exactly.
"""
from __future__ import annotations

import math
import logging
import time
import weakref

import numpy as np

from ..nn import cuda_ops
from ..parallel.precision import assign, widen
from ..validate import check_number
from . import optim_fused

log = logging.getLogger("mpishard")


def built_optimizer(engine):
    """The optimizer last built on `engine` that is still alive, or None."""
    ref = engine.optimizer_ref
    return ref() if ref is not None else None


def hand_over_state(engine, sd: dict, optimizer=None) -> None:
    """Restored optimizer state `sd` (this rank's blocks, as `Optimizer.state_dict()` returns
    them) into `optimizer`, else into the optimizer built on `engine`; with neither, kept
    until an optimizer is built on `engine`, which loads it as it is built, as long as the
    engine still holds the same parameter blocks."""
    optimizer = optimizer if optimizer is not None else built_optimizer(engine)
    if optimizer is None:
        engine.kept_optimizer_state = (sd, dict(engine.params))
    else:
        engine.kept_optimizer_state = None
        optimizer.load_state_dict(sd)


class Optimizer:
    """Base: state per parameter name, shaped like this rank's block of it."""

    def __init__(self, engine, lr, weight_decay=0.0):
        if not hasattr(engine, "optimizer_shards"):
            raise TypeError(f"optimizer needs an mpishard engine, got {type(engine).__name__}")
        # what the optimizer uses of the engine, and nothing else
        self.shards = engine.optimizer_shards          # -> [(name, param, grad, replication)]
        self.after_step = engine.after_optimizer_step  # ZeRO-1/2 re-gather the slices there
        self.xp, self.dtype, self.to_host = engine.xp, engine.dtype, engine.backend.to_host
        self.comm_stats = engine.comm.stats   # .tracer: a span per step while tracing
        self.lr = lr                    # checked by the setter below
        self.weight_decay = check_number("weight_decay", weight_decay, low=0)
        self.state: dict = {}           # name -> {'step': int, arrays shaped like the block}

    def attach_to(self, engine) -> None:
        """Become the optimizer a restore of `engine` fills (`hand_over_state`), loading the
        state a restore kept for the next optimizer built, if the engine still holds the
        blocks it was read for; the arguments this optimizer was built with win over the
        saved hyperparameters (a warning names each that differs). Subclasses call it last in
        __init__ (hyperparameters set)."""
        sd, blocks = engine.kept_optimizer_state or (None, None)
        if sd is not None and (blocks.keys() != engine.params.keys() or any(
                engine.params[n] is not b for n, b in blocks.items())):
            engine.kept_optimizer_state = None   # loaded again since: state for other weights
            sd = None
        if sd is not None and sd["type"] != type(self).__name__:
            raise ValueError(f"the engine was restored from a checkpoint that holds "
                             f"{sd['type']} state: build an {sd['type']} to continue from it "
                             f"(or load the weights alone with engine.load_checkpoint("
                             f"ms.checkpoint.load(path)))")
        if sd is not None:
            engine.kept_optimizer_state = None
            mine = self.hyperparameters()
            self.load_state_dict(sd)
            for k, v in mine.items():
                setattr(self, k, tuple(v) if k == "betas" else v)
            changed = {k: (v, sd["hyperparameters"][k]) for k, v in mine.items()
                       if k in sd.get("hyperparameters", {})
                       and np.any(np.asarray(v) != np.asarray(sd["hyperparameters"][k]))}
            if changed:
                log.warning("%s built after a restore: its own %s replace the checkpoint's",
                            type(self).__name__, ", ".join(f"{k}={v!r} (saved {s!r})"
                                                          for k, (v, s) in changed.items()))
        engine.optimizer_ref = weakref.ref(self)

    @property
    def lr(self) -> float:
        return self._lr

    @lr.setter
    def lr(self, value) -> None:
        self._lr = check_number("lr", value, low=0)

    def step(self, grads=None) -> None:
        """Update this rank's parameter blocks in place from their gradient blocks.

        `grads` (the dict returned by train_step) is accepted for API compatibility; the arrays
        used are the engine's own blocks from `optimizer_shards()`, which are the same arrays
        (or, under ZeRO, the slice of them this rank owns).
        """
        if grads is not None and not isinstance(grads, dict):
            raise TypeError(f"step(grads): grads must be the dict from train_step, got "
                            f"{type(grads).__name__}")
        t0 = time.perf_counter()
        work = []                    # (name, stored block, the block updated, grad)
        for name, param, grad, _ in self.shards():
            # 16-bit parameters (mixed precision): the update runs on an fp32 master copy
            target = param if param.dtype == self.dtype else self.master(name, param)
            work.append((name, param, target, grad))
        self.update_blocks([(name, target, grad) for name, _, target, grad in work])
        for _, param, target, _ in work:
            if target is not param:
                assign(param, target, self.xp)        # rounded to the stored dtype
        self.after_step()
        if self.comm_stats.tracer is not None:
            self.comm_stats.tracer.span("optimizer step", "compute", t0)

    def master(self, name, param):
        """The fp32 master weights of a 16-bit parameter block: optimizer state 'master' (so
        memory_report counts it and checkpoints save it), made from the block on first use."""
        entry = self.state.setdefault(name, {"step": 0})
        if "master" not in entry:
            entry["master"] = widen(param, self.dtype, self.xp)
        return entry["master"]

    def update(self, name, param, grad) -> None:
        raise NotImplementedError

    def update_blocks(self, blocks) -> None:
        """update() of every (name, block, grad) of a step; an optimizer with a multi-tensor
        kernel (AdamW on a GPU) updates them together."""
        for name, param, grad in blocks:
            self.update(name, param, grad)

    def hyperparameters(self) -> dict:
        return {"lr": self.lr, "weight_decay": self.weight_decay}

    # -- state in and out (the sharded checkpoint writes these arrays) ---------------------------
    def state_dict(self) -> dict:
        """{'type', 'hyperparameters', 'state': {name: {'step': int, key: host array}}}.

        The arrays are host (numpy) copies of this rank's local blocks, shaped like the
        parameter block, keyed by the full parameter name."""
        to_host = self.to_host
        state = {name: {k: (int(v) if k == "step" else np.array(to_host(v), copy=True))
                        for k, v in entry.items()} for name, entry in self.state.items()}
        return {"type": type(self).__name__, "hyperparameters": self.hyperparameters(),
                "state": state}

    def load_state_dict(self, sd: dict) -> None:
        """Restore `state_dict()` output (this rank's blocks). Raises ValueError for another
        optimizer type or a block whose shape does not match this rank's parameter block."""
        if sd.get("type") != type(self).__name__:
            raise ValueError(f"state dict is for {sd.get('type')!r}, not {type(self).__name__}")
        blocks = {name: p.shape for name, p, _, _ in self.shards()}
        xp, dtype = self.xp, self.dtype
        state = {}
        for name, entry in sd["state"].items():
            if blocks and name not in blocks:
                raise ValueError(f"optimizer state has {name!r}, which this rank does not hold; "
                                 f"it holds {sorted(blocks)}")
            new = {}
            for k, v in entry.items():
                if k == "step":
                    new[k] = int(v)
                    continue
                if name in blocks and tuple(np.shape(v)) != tuple(blocks[name]):
                    raise ValueError(f"optimizer state {name}/{k} has shape {np.shape(v)}, but "
                                     f"this rank's block is {tuple(blocks[name])}")
                new[k] = xp.array(v, dtype=dtype)
            state[name] = new
        for k, v in sd.get("hyperparameters", {}).items():    # as torch's load_state_dict
            setattr(self, k, tuple(v) if k == "betas" else v)
        self.state = state


class SGD(Optimizer):
    """torch.optim.SGD (dampening 0, no Nesterov): weight decay into the gradient, momentum
    buffer initialised to the first gradient."""

    def __init__(self, engine, lr, momentum=0.0, weight_decay=0.0):
        super().__init__(engine, lr, weight_decay)
        self.momentum = check_number("momentum", momentum, low=0)
        self.attach_to(engine)

    def hyperparameters(self) -> dict:
        return dict(super().hyperparameters(), momentum=self.momentum)

    def update(self, name, p, g) -> None:
        if self.weight_decay:
            g = g + self.weight_decay * p                 # grad.add(param, alpha=wd)
        if self.momentum:
            entry = self.state.setdefault(name, {"step": 0})
            buf = entry.get("momentum_buffer")
            if buf is None:
                buf = entry["momentum_buffer"] = g.copy()         # first step: b = g
            else:
                buf *= self.momentum                               # b = mu b + g
                buf += g
            entry["step"] += 1
            g = buf
        p -= self.lr * g


class AdamW(Optimizer):
    """torch.optim.AdamW (amsgrad off): decoupled weight decay, bias-corrected moments."""

    def __init__(self, engine, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
        super().__init__(engine, lr, weight_decay)
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise TypeError(f"betas must be a pair (beta1, beta2), got {betas!r}")
        self.betas = (check_number("beta1", betas[0], low=0, high=1),
                      check_number("beta2", betas[1], low=0, high=1))
        self.eps = check_number("eps", eps, low=0)
        self.attach_to(engine)

    def hyperparameters(self) -> dict:
        return dict(super().hyperparameters(), betas=list(self.betas), eps=self.eps)

    def moments(self, name, p):
        """(exp_avg, exp_avg_sq, t) of block `name` for this step: the moments (zeros on the
        first step), t its step after the increment."""
        entry = self.state.setdefault(name, {"step": 0})     # (may hold a 'master' already)
        if "exp_avg" not in entry:
            entry.update(exp_avg=self.xp.zeros_like(p), exp_avg_sq=self.xp.zeros_like(p))
        entry["step"] += 1
        return entry["exp_avg"], entry["exp_avg_sq"], entry["step"]

    def update_blocks(self, blocks) -> None:
        """On a GPU (nn/cuda_ops.use: cupy, MPISHARD_FUSED not "0") every block the kernel
        takes (cuda_ops.adamw_takes: float32/float64, C-contiguous) in one launch of the
        multi-tensor kernel, the same numbers element for element; the others one by one."""
        if not cuda_ops.use(self.xp):
            return super().update_blocks(blocks)
        together = []
        for name, p, g in blocks:
            m, v, t = self.moments(name, p)
            if cuda_ops.adamw_takes(p, g, m, v):
                together.append((p, g, m, v, t))
            else:
                self.apply(p, g, m, v, t)
        for dtype in sorted({p.dtype.str for p, *_ in together}):   # a launch per dtype (one)
            cuda_ops.adamw_step(self.xp, [b for b in together if b[0].dtype.str == dtype],
                                self.lr, self.betas, self.eps, self.weight_decay)

    def update(self, name, p, g) -> None:
        self.apply(p, g, *self.moments(name, p))

    def apply(self, p, g, m, v, t) -> None:
        """One AdamW step of block p (in place) with its moments m, v at step t."""
        xp = self.xp
        b1, b2 = self.betas
        if optim_fused.usable(p, g, m, v):                 # numba: the same steps, one pass
            return optim_fused.adamw(p, g, m, v, self.lr, (b1, b2), self.eps,
                                     self.weight_decay, t)
        if self.weight_decay:
            p *= 1.0 - self.lr * self.weight_decay         # decoupled decay first
        m += (1.0 - b1) * (g - m)                          # exp_avg.lerp_(grad, 1 - beta1)
        v *= b2                                            # exp_avg_sq.mul_(b2)
        v += (1.0 - b2) * (g * g)                          #   .addcmul_(g, g, value=1 - b2)
        step_size = self.lr / (1.0 - b1 ** t)
        denom = xp.sqrt(v) / math.sqrt(1.0 - b2 ** t) + self.eps
        p -= step_size * (m / denom)                       # p.addcdiv_(m, denom, -step_size)


# -- clipping ----------------------------------------------------------------------------------
def global_grad_norm(engine, norm_type=2.0) -> float:
    """||gradients|| over the whole model, the same float on every rank (one all_reduce)."""
    xp = engine.xp
    local = 0.0
    inf = norm_type == math.inf
    for _, _, g, replication in engine.optimizer_shards():
        if g.size == 0:
            continue
        if inf:
            local = max(local, float(xp.abs(g).max()))
        else:
            g64 = g.astype(xp.float64, copy=False).ravel()
            local += float(xp.vdot(g64, g64)) / replication    # a copy on r ranks counts 1/r
    total = engine.all_reduce(np.array([local], dtype=np.float64), op="max" if inf else "sum",
                              group=None)
    total = float(engine.backend.to_host(total)[0])
    return total if inf else math.sqrt(total)


def clip_grad_norm(engine, grads=None, max_norm=1.0, norm_type=2.0) -> float:
    """Scale the gradients in place so their global norm is at most `max_norm` (PyTorch's
    clip_grad_norm_: coefficient max_norm / (norm + 1e-6), clamped to 1). Returns the norm
    before clipping, the same float on every rank. Collective over the whole world.

    `grads` (the dict from train_step) is accepted for API compatibility; the blocks scaled are
    `engine.optimizer_shards()`'s gradient blocks, which are those arrays."""
    max_norm = check_number("max_norm", max_norm, low=0, low_open=True)
    if norm_type not in (2, 2.0, math.inf):
        raise ValueError(f"norm_type must be 2.0 or math.inf, got {norm_type!r}")
    total = global_grad_norm(engine, norm_type)
    coef = max_norm / (total + 1e-6)
    if coef < 1.0:                                   # clamp(max=1.0): 1.0 leaves grads as they are
        for _, _, g, _ in engine.optimizer_shards():
            g *= coef
    return total


__all__ = ["Optimizer", "SGD", "AdamW", "clip_grad_norm", "global_grad_norm"]

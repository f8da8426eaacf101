"""Layers: the units an engine stacks into pipeline stages.

A layer has `forward(x, mb) -> y` and `backward(dy, mb) -> dx` side by side. Activations saved
for the backward live on a tape keyed by microbatch id `mb`, so a pipeline can hold several
microbatches in flight without them aliasing each other. `predict`-style calls pass
`record=False` and keep nothing.

Parameters are not owned by layers: they live in the engine's `params` dict (local shards keyed
by full names), and a layer reaches them through a `ParamAccess` policy:

- `LocalAccess` (single, dp, tp, pp): the local array is the one to compute with; gradients are
  added into the engine's `grads` dict.
- `fsdp.FSDPAccess`: all-gathers the weight before use and reduce-scatters its gradient.

A data-parallel strategy hooks `on_grad_ready` to start communicating a gradient bucket while
the backward of earlier layers still runs. Strategies thus compose by swapping the access policy
and inserting communication layers, not by rewriting the math.
"""
from __future__ import annotations

from . import functional as nn


class LocalAccess:
    """Parameters used as stored; gradients accumulated in place."""

    def __init__(self, engine):
        self.engine = engine

    def get(self, name, mb=0):
        """The array to compute with (here: the local shard itself)."""
        return self.engine.params[name]

    def release(self, name, mb=0) -> None:
        """Called once the forward (or backward) no longer needs the gathered weight."""

    def add_grad(self, name, g) -> None:
        """Accumulate dL/d(param) (shaped like get(name)) into the engine's gradient."""
        self.engine.grads[name] += g
        self.engine.on_grad_ready(name)

    # Engine hooks; FSDPAccess gives them work, here there is none.
    def on_load(self) -> None:
        """After load_checkpoint allocated params and grads."""

    def zero_grad(self) -> None:
        """Clear any gradient storage besides engine.grads."""

    def finish_grads(self) -> None:
        """Before the data-parallel gradient sync."""

    def owned(self, name):
        """The parameter block the optimizer updates: the whole local block."""
        return self.engine.params[name]

    def after_optimizer_step(self) -> None:
        """After the optimizer updated the owned blocks."""


class Layer:
    """Base: a tape of saved activations per microbatch."""

    param_names: tuple = ()

    def __init__(self):
        self.tape = {}

    def save(self, mb, record, value):
        if record:
            if mb in self.tape:
                raise RuntimeError(f"{self}: microbatch {mb} already has a saved activation")
            self.tape[mb] = value

    def pop(self, mb):
        try:
            return self.tape.pop(mb)
        except KeyError:
            raise RuntimeError(f"{self}: backward for microbatch {mb} without its forward "
                               "(was forward called with record=False?)") from None

    def clear(self):
        self.tape.clear()

    def forward(self, x, mb=0, record=True):
        raise NotImplementedError

    def backward(self, dy, mb=0):
        raise NotImplementedError


class Linear(Layer):
    """y = x W + b on whatever block of W the access policy hands out.

    forward   'bd,df->bf'   x: (B, D_local), W: (D_local, F_local)
    backward  dW = 'bd,bf->df', db = sum_b dy, dx = 'bf,df->bd'
    """

    def __init__(self, access, w_name, b_name=None, need_dx=True):
        super().__init__()
        self.access = access
        self.w_name, self.b_name = w_name, b_name
        self.need_dx = need_dx
        self.param_names = (w_name,) + ((b_name,) if b_name else ())

    def __repr__(self):
        return f"{type(self).__name__}({self.w_name})"

    def forward(self, x, mb=0, record=True):
        w = self.access.get(self.w_name, mb)
        b = self.access.get(self.b_name, mb) if self.b_name else None
        y = nn.linear_forward(x, w, b)                          # 'bd,df->bf' + b
        self.access.release(self.w_name, mb)
        if self.b_name:
            self.access.release(self.b_name, mb)                # FSDP drops the gathered bias
        self.save(mb, record, x)
        return y

    def backward(self, dy, mb=0):
        x = self.pop(mb)
        w = self.access.get(self.w_name, mb)
        dx, dw, db = nn.linear_backward(dy, x, w, self.need_dx)  # undoes 'bd,df->bf'
        self.access.release(self.w_name, mb)
        self.access.add_grad(self.w_name, dw)
        if self.b_name:
            self.access.add_grad(self.b_name, db)                # undoes the broadcast of b
        return dx


class Activation(Layer):
    """Element-wise act(z); works on full or feature-sharded activations alike."""

    def __init__(self, name):
        super().__init__()
        self.name = nn.check_activation(name)

    def __repr__(self):
        return f"Activation({self.name})"

    def forward(self, z, mb=0, record=True):
        y, saved = nn.activation_forward(self.name, z)
        self.save(mb, record, saved)
        return y

    def backward(self, dy, mb=0):
        return nn.activation_backward(self.name, dy, self.pop(mb))

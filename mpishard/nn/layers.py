"""Layers: the units an engine stacks into pipeline stages.

A layer has `forward(x, mb) -> y` and `backward(dy, mb) -> dx` side by side. Activations saved
for the backward live on a tape keyed by microbatch id `mb`, so a pipeline can hold several
microbatches in flight without them aliasing each other. `predict`-style calls pass
`record=False` and keep nothing.

Parameters are not owned by layers: they live in a parameter store (`params` and `grads`
dicts of local blocks keyed by full names), and a layer reaches them through an access policy:

- `LocalAccess` (single, dp, tp, pp): the stored block is the one to compute with; gradients
  are added into the store's `grads`.
- `parallel.fsdp.FSDPAccess`: all-gathers the weight before use and reduce-scatters its
  gradient.

Both report a final gradient to `grad_ready(name)` (the data-parallel gradient sync starts a
bucket's all-reduce there while the backward of earlier layers still runs). Strategies thus
compose by swapping the access policy and inserting communication units (layers whose forward
and backward are a collective and its adjoint), not by rewriting the math.
"""
from __future__ import annotations

import time

from . import functional as nn
from .autocast import FULL
from .losses import step_pair


class LocalAccess:
    """Parameters used as stored; gradients accumulated in place.

    store: anything with `params` and `grads` dicts; grad_ready(name): called once a gradient
    is final for this backward (or None).
    """

    def __init__(self, store, grad_ready=None):
        self.store = store
        self.grad_ready = grad_ready

    def get(self, name, mb=0):
        """The array to compute with (here: the local block itself)."""
        return self.store.params[name]

    def release(self, name, mb=0) -> None:
        """Called once the forward (or backward) no longer needs the gathered weight."""

    def add_grad(self, name, g) -> None:
        """Accumulate dL/d(param) (shaped like get(name)) into the store's gradient."""
        self.store.grads[name] += g
        if self.grad_ready is not None:
            self.grad_ready(name)

    # Engine hooks; FSDPAccess gives them work, here there is none.
    def on_load(self) -> None:
        """After the store allocated params and grads."""

    def zero_grad(self) -> None:
        """Clear any gradient storage besides the store's grads."""

    def end_backward(self) -> None:
        """After every backward, sync or not (FSDP sends its last gradient bucket)."""

    def finish_grads(self) -> None:
        """Before the data-parallel gradient sync."""

    def owned(self, name):
        """The parameter block the optimizer updates: the whole local block."""
        return self.store.params[name]

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

    def forget(self, mb) -> None:
        """Drop what microbatch `mb` saved, if anything (a forward never backed)."""
        self.tape.pop(mb, None)

    def in_flight(self):
        """Microbatches with something saved for a backward (or a deferred W)."""
        return self.tape.keys()

    def forward(self, x, mb=0, record=True):
        raise NotImplementedError

    def backward(self, dy, mb=0):
        raise NotImplementedError

    # Zero-bubble pipelines split the backward: B = backward_input now, W = backward_weights
    # later. By default B does the whole backward (cheap or parameter-free layers) and W nothing.
    def backward_input(self, dy, mb=0):
        """dL/dx alone; what the weight gradients need stays for backward_weights."""
        return self.backward(dy, mb)

    def backward_weights(self, mb=0) -> None:
        """The weight gradients backward_input deferred for microbatch `mb`."""


class Linear(Layer):
    """y = x W + b on whatever block of W the access policy hands out.

    forward   'bd,df->bf'   x: (B, D_local), W: (D_local, F_local)
    backward  dW = 'bd,bf->df', db = sum_b dy, dx = 'bf,df->bd'
              split (zero bubble): backward_input gives dx and keeps (x, dy) in `deferred`,
              backward_weights turns them into dW, db later

    `reduce`: a communication unit applied to the partial products x W before the bias is
    added (a row-parallel layer sums its partial products over tp there); its backward runs
    on dy before the local backward.

    `autocast` (nn/autocast.py, set by attach_autocast): x, W, b and dy rounded before use,
    y, dx, dW and db rounded after (a partial product before its reduce too); the tape and
    the deferred W pass keep the rounded x and dy. `low_logits` (a model's own head without
    a bias or a reduce, transformer.model_head): a training forward's y is `cast.kept`.
    `low_out` (no reduce) / `low_dx`: y is `cast.linear_kept` / dx is `cast.grad_kept`, for
    a next unit with 16-bit kernels (activation_layer.keep_low_around).
    """

    autocast = FULL
    low_logits = low_out = low_dx = False

    def __init__(self, access, w_name, b_name=None, need_dx=True, reduce=None):
        super().__init__()
        self.access = access
        self.w_name, self.b_name = w_name, b_name
        self.need_dx = need_dx
        self.reduce = reduce
        self.param_names = (w_name,) + ((b_name,) if b_name else ())
        self.deferred = {}                                      # mb -> (x, dy) for the W pass

    def __repr__(self):
        return f"{type(self).__name__}({self.w_name})"

    def in_flight(self):
        return self.tape.keys() | self.deferred.keys()

    def clear(self):
        super().clear()
        self.deferred.clear()

    def forget(self, mb) -> None:
        super().forget(mb)
        self.deferred.pop(mb, None)

    def forward(self, x, mb=0, record=True):
        cast = self.autocast
        x = cast.round(x)
        w = cast.round(self.access.get(self.w_name, mb))
        if self.reduce is None:
            b = cast.round(self.access.get(self.b_name, mb)) if self.b_name else None
            if self.low_out:                                    # the next unit's kernels
                y = cast.linear_kept(x, w, b)                   # read 16 bits
            elif self.low_logits and record and b is None:      # the loss reads it as it is
                y = cast.kept(nn.linear_forward(x, w))
            else:
                y = cast.linear_output(x, w, b)                 # 'bd,df->bf' + b
        else:
            y = cast.output(nn.linear_forward(x, w))            # 'bf,fd->bd' partial sums
        self.access.release(self.w_name, mb)
        if self.reduce is not None:
            y = self.reduce.forward(y, mb, record)              # e.g. all-reduce over tp
            if self.b_name:                                     # bias once, after the sum
                y += cast.round(self.access.get(self.b_name, mb))
                y = cast.output(y)
        if self.b_name:
            self.access.release(self.b_name, mb)                # FSDP drops the gathered bias
        self.save(mb, record, x)
        return y

    def backward(self, dy, mb=0):
        dx = self.backward_input(dy, mb)
        self.backward_weights(mb)
        return dx

    def backward_input(self, dy, mb=0):
        x = self.pop(mb)
        if self.reduce is not None:
            dy = self.reduce.backward(dy, mb)                   # undoes the reduce
        cast = self.autocast
        dy = cast.round(dy)
        dx = None                  # the model input: dW = x^T dy needs no W, so no get
        if self.need_dx:           # (FSDP ZeRO-3 skips the layer's backward all_gather)
            w = cast.round(self.access.get(self.w_name, mb))
            out = cast.grad_kept if self.low_dx else cast.output
            dx = out(nn.linear_backward_input(dy, w, x.shape))                # 'bf,df->bd'
            self.access.release(self.w_name, mb)
        self.deferred[mb] = (x, dy)
        return dx

    def backward_weights(self, mb=0) -> None:
        x, dy = self.deferred.pop(mb)
        x2, dy2 = x.reshape(-1, x.shape[-1]), dy.reshape(-1, dy.shape[-1])
        db = nn.column_sums(dy2) if self.b_name else None       # undoes the broadcast of b
        self.autocast.enter()                   # a matmul whose inputs were rounded earlier
        dw = nn.einsum("bd,bf->df", x2, dy2)                     # undoes 'bd,df->bf' in W
        self.access.add_grad(self.w_name, self.autocast.output(dw))
        if self.b_name:
            self.access.add_grad(self.b_name, self.autocast.output(db))


def every_layer(chunks):
    """Each layer in `chunks` (lists of layers) and every layer inside them (a composite's
    units, a wrapper's inner unit, a Linear's communication unit), once."""
    seen: set = set()
    stack = [layer for chunk in chunks for layer in chunk]
    while stack:
        layer = stack.pop()
        if id(layer) in seen:
            continue
        seen.add(id(layer))
        yield layer
        for v in vars(layer).values():
            if isinstance(v, Layer):
                stack.append(v)
            elif isinstance(v, (list, tuple)):
                stack.extend(u for u in v if isinstance(u, Layer))


def attach_autocast(chunks, policy) -> None:
    """Give the matmul precision `policy` (nn/autocast.py) to every layer in `chunks`, or
    inside them, that multiplies matrices: those whose class declares an `autocast`
    attribute. A policy that rounds nothing (FULL) leaves the class default in place."""
    if not policy.active:
        return
    for layer in every_layer(chunks):
        if hasattr(type(layer), "autocast"):
            layer.autocast = policy


class Sequential:
    """Runs layers in order, the backward in reverse order: the runner of a one-stage
    pipeline (pp=1). `tracer` (health.trace.Tracer, set while tracing): a span per layer."""

    tracer = None

    def __init__(self, layers):
        self.layers = layers

    def forward(self, x, mb=0, record=True):
        if self.tracer is not None:
            return self.tracer.layers_forward(self.layers, x, mb, record)
        for layer in self.layers:
            x = layer.forward(x, mb, record)
        return x

    def backward(self, dy, mb=0):
        if self.tracer is not None:
            return self.tracer.layers_backward(self.layers, dy, mb)
        for layer in reversed(self.layers):
            dy = layer.backward(dy, mb)                          # undoes forward, last first
        return dy

    def train_step(self, x, t, loss, grad_scale):
        """Forward, loss, backward of one batch: (this rank's local-mean loss, rows)."""
        y = self.forward(x)
        t0 = time.perf_counter() if self.tracer is not None else 0.0
        value, dy = step_pair(loss, y, t, grad_scale)   # value: maybe on the device, read
        if self.tracer is not None:                       # at the end; dy scaled
            self.tracer.span("loss", "compute", t0)
        self.backward(dy)
        return value, t.shape[0]


class Composite(Layer):
    """A layer made of sub-layers run in order (a transformer block, a residual branch).

    The sub-layers keep their own tapes; the composite's tape only marks which microbatches
    are in flight (what a pipeline counts), and `clear`/`forget` reach every sub-layer. Its
    `param_names` are the sub-layers' (FSDP prefetch groups them as one layer)."""

    def __init__(self, units):
        super().__init__()
        self.units = list(units)
        self.param_names = tuple(n for u in self.units for n in u.param_names)

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(map(repr, self.units))})"

    def clear(self):
        super().clear()
        for u in self.units:
            u.clear()

    def forget(self, mb) -> None:
        super().forget(mb)
        for u in self.units:
            u.forget(mb)

    def in_flight(self):
        return self.tape.keys() | set().union(*(u.in_flight() for u in self.units))

    def forward(self, x, mb=0, record=True):
        self.save(mb, record, True)
        for u in self.units:
            x = u.forward(x, mb, record)
        return x

    def backward(self, dy, mb=0):
        self.pop(mb)
        for u in reversed(self.units):
            dy = u.backward(dy, mb)                              # undoes forward, last first
        return dy

    def backward_input(self, dy, mb=0):
        self.pop(mb)
        for u in reversed(self.units):
            dy = u.backward_input(dy, mb)                        # B of each, last first
        return dy

    def backward_weights(self, mb=0) -> None:
        for u in reversed(self.units):
            u.backward_weights(mb)                               # W of each, same order


class Head(Composite):
    """A model's final norm and output head, run in order (a Composite).

    `keep_last` is None, or a function h (B, t, d) -> h (B, 1, d): each row's position whose
    logits are wanted, which nn/kv_cache.caching sets while decoding. A forward without a
    tape then runs the norm and the head on that position only: a prefill of t tokens
    computes one row of logits per prompt, not t (the head, d x V, is most of a decode
    step's work for a small model with a large vocabulary; transformers' logits_to_keep=1)."""

    keep_last = None

    def forward(self, x, mb=0, record=True):
        if self.keep_last is not None and not record:
            x = self.keep_last(x)
        return super().forward(x, mb, record)


class Residual(Composite):
    """x + branch(x): the sub-layers are the branch.

    forward   y = x + f(x)
    backward  dx = dy + f'(x)^T dy        (the identity path plus the branch's backward)
    """

    def forward(self, x, mb=0, record=True):
        return x + super().forward(x, mb, record)

    def backward(self, dy, mb=0):
        return dy + super().backward(dy, mb)

    def backward_input(self, dy, mb=0):
        return dy + super().backward_input(dy, mb)

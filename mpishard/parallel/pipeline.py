"""Pipeline parallelism: stages of layers, an executor for `schedules.py`, streaming inference.

The simplest pipeline puts layer 0 on device 0 and layer 1 on device 1 and passes the
activation forward with `send`, the gradient back with `send` the other way:

    stage 0:  h = relu(x W0 + b0)         send(h, 1)            ...   dh = receive(1)
    stage 1:  h = receive(0)              y = sigmoid(h W1 + b1)      send(dh, 0)

Here the model's layers are cut into `pp * v` contiguous *virtual stages* (`stages.assign_stages`);
virtual stage k = chunk * pp + stage lives on pp rank k % pp as its chunk k // pp (v = 1
except for the interleaved schedule). A batch is split into `microbatches`, and every rank runs
its row of a schedule from `schedules.py`, a plain list of actions:

    F(mb, c):  h = x[mb] (k = 0) or receive(stage of k-1)    forward chunk c    send(stage of k+1)
    B(mb, c):  dy = dLoss (k = last) or receive(stage of k+1) backward chunk c  send(stage of k-1)
    W(mb, c):  weight gradients of chunk c for mb              (zero-bubble schedules only)

In a zero-bubble schedule (schedule=zb1p) B runs each layer's `backward_input`: only dL/dx,
what the previous stage waits for; a Linear keeps (x, dy) until W runs its
`backward_weights` (dW, db) later, in what would otherwise be bubbles.

send / receive are adjoint: the activation sent forward is what the gradient comes back for.
Sends are non-blocking (Isend, kept as Futures until the step ends), so a rank never waits for
its neighbour to *take* a message, only to *produce* one: the executor then deadlocks exactly
when the schedule's simulation (buffered sends) does, which `schedules.simulate` rules out.
Every message's tag encodes (microbatch, receiving chunk, kind), so with interleaving
stage 0 can receive activations from stage pp-1 and gradients from stage 1 (one rank at pp=2)
without mixing them up. Each layer keeps one tape entry per microbatch, so microbatches in
flight never share buffers. Under tp each tp rank talks to the same tp coordinate of its
neighbour stage (the 'pp' communicator groups exactly those ranks); under dp every replica
runs its own pipeline.

The loss lives on the last stage: each microbatch's local-mean loss, averaged over the m
microbatches, with dy scaled by 1/m, which equals the single-device gradient of the batch mean.

`engine.stats` after a `train_step` (per rank): `peak_stashed` (most microbatch-chunks whose
forward is done and backward not yet, read off the layers' tapes), `idle_s` (time blocked
waiting for a neighbour's message or for our sends to drain), `busy_s` (compute), `step_s`,
`bubble_fraction` (1 - busy_s / step_s on this rank), `actions` (the order actually run) and
`timeline` ((action, start, end) from the step's start). `pipeline_bubble(engine)` combines
the stages' numbers (a small collective over 'pp').
"""
from __future__ import annotations

import time
from itertools import islice

import numpy as np

from ..nn.losses import step_pair
from .schedules import make_schedule, splits_backward
from .stages import assign_stages, pipeline_options

# message kinds: an activation (forward), a gradient (backward), and in streaming inference
# the count of requests that follow in a group (fewer than a full group: the end of stream)
ACT, GRAD, COUNT = 0, 1, 2
KINDS = 3


# -- the executor ------------------------------------------------------------------------------
class PipelineRunner:
    """Runs this rank's chunks of layers: single passes, a training schedule, a stream.

    chunks: this rank's layers, one list per virtual stage it holds; layout: the pipeline
    options; pp: the Comm of this rank's pp group (its rank is the stage); stats: the dict the
    step's measurements land in.
    """

    def __init__(self, chunks, layout, pp, stats: dict):
        self.pp, self.schedule_name, self.v, self.m = pipeline_options(layout)
        self.layout_text = layout.text
        self.comm = pp
        self.stage = pp.rank()
        self.stats = stats
        self.n_virtual = self.pp * self.v
        self.chunks = chunks
        assert len(self.chunks) == self.v and all(self.chunks), "every chunk holds layers"
        # raises ValueError (e.g. interleaved with microbatches % pp != 0) before any comm
        self.schedule = make_schedule(self.schedule_name, self.pp, self.m, self.v)[self.stage]
        self.split = splits_backward(self.schedule)       # zero bubble: B and W separately
        self.tracer = None                                 # a health.trace.Tracer while tracing
        self.before_action = lambda action: None  # train_step calls it first in each action
        self._sends, self._idle, self._peak = [], 0.0, 0

    # -- topology: virtual stage k = chunk * pp + stage -----------------------------------------
    def _k(self, chunk):
        return chunk * self.pp + self.stage

    def _tag(self, mb, chunk, kind):
        """Unique per (microbatch, receiving chunk, message kind); mb = -1 (predict) allowed."""
        return KINDS * ((mb + 1) * self.v + chunk) + kind

    def _send(self, arr, k_to, mb, kind):
        """Non-blocking send to the rank of virtual stage k_to; adjoint: its _receive."""
        fut = self.comm.send_async(arr, dest=k_to % self.pp,
                                   tag=self._tag(mb, k_to // self.pp, kind))
        self._sends.append(fut)

    def _post_receive(self, k_from, mb, chunk, kind):
        return self.comm.receive_async(k_from % self.pp, tag=self._tag(mb, chunk, kind))

    def _send_count(self, q):
        """Streaming: tell the next stage that q requests follow (the COUNT kind). Its one
        int64 travels without a shape header: the receiver knows what it is."""
        count = self.comm.xp.full(1, q, dtype=np.int64)
        self._sends.append(self.comm.send_async(count, None, self.stage + 1,
                                                tag=self._tag(-1, 0, COUNT)))

    def _receive_count(self) -> int:
        """The count the previous stage sent with `_send_count`."""
        count = self.comm.xp.empty(1, dtype=np.int64)
        return int(self._wait(self.comm.receive_async(self.stage - 1, out=count,
                                                      tag=self._tag(-1, 0, COUNT)))[0])

    def _wait(self, future):
        """Block until a neighbour's message is here; the wait is idle time."""
        t0 = time.perf_counter()
        arr = future.result()
        self._idle += time.perf_counter() - t0
        if self.tracer is not None:
            self.tracer.span("wait", "wait", t0)
        return arr

    def _drain_sends(self, keep=0):
        """Wait for all but the newest `keep` sends (their buffers are then free)."""
        self._sends = [f for f in self._sends if not f.done()]
        while len(self._sends) > keep:
            self._wait(self._sends.pop(0))

    def _stashed(self):
        """Microbatch-chunks with a saved activation, read off the layers' tapes."""
        return sum(len(set().union(*(layer.in_flight() for layer in chunk)))
                   for chunk in self.chunks)

    # -- one chunk: forward and backward side by side ------------------------------------------
    def _chunk_forward(self, c, h, mb, record):
        if self.tracer is not None:
            h = self.tracer.layers_forward(self.chunks[c], h, mb, record)
        else:
            for layer in self.chunks[c]:
                h = layer.forward(h, mb, record)
        if record:
            self._peak = max(self._peak, self._stashed())
        return h

    def _chunk_backward(self, c, dy, mb, method="backward"):
        """`method`: 'backward', or 'backward_input' (a zero-bubble B: weights deferred)."""
        if self.tracer is not None:
            return self.tracer.layers_backward(self.chunks[c], dy, mb, method)
        for layer in reversed(self.chunks[c]):         # undoes _chunk_forward, last layer first
            dy = getattr(layer, method)(dy, mb)
        return dy

    def _chunk_weights(self, c, mb):
        """A zero-bubble W: the weight gradients the B of (mb, c) deferred."""
        if self.tracer is not None:
            return self.tracer.layers_weights(self.chunks[c], mb)
        for layer in reversed(self.chunks[c]):
            layer.backward_weights(mb)
        return None

    # -- single passes (engine.forward / predict / backward) -----------------------------------
    def forward(self, x, mb=0, record=True):
        """Forward one batch through every stage; the output on the last stage, else None."""
        if self.stage == 0 and x is None:
            raise ValueError("pipeline stage 0 needs the input x (got None)")
        out = None
        for c in range(self.v):
            k = self._k(c)
            h = x if k == 0 else self._wait(self._post_receive(k - 1, mb, c, ACT))
            h = self._chunk_forward(c, h, mb, record)
            if k == self.n_virtual - 1:
                out = h
            else:
                self._send(h, k + 1, mb, ACT)                # adjoint: the B receive below
        self._drain_sends()
        return out

    def backward(self, dy, mb=0):
        """Backward one batch; dy (dL/dy of the local-mean loss) is used on the last stage."""
        if self.stage == self.pp - 1 and dy is None:
            raise ValueError("the last pipeline stage needs dy (got None)")
        for c in reversed(range(self.v)):
            k = self._k(c)
            g = dy if k == self.n_virtual - 1 else \
                self._wait(self._post_receive(k + 1, mb, c, GRAD))
            g = self._chunk_backward(c, g, mb)
            if k > 0:
                self._send(g, k - 1, mb, GRAD)                # adjoint of the F receive
        self._drain_sends()
        return None                                          # layer 0 computes no dx

    # -- training: run the schedule ------------------------------------------------------------
    def _check_batch(self, x, t):
        ref = x if x is not None else t
        if ref is None:
            raise ValueError("train_step needs x (first stage) and t (last stage), got None")
        rows = int(ref.shape[0])
        if rows % self.m:
            raise ValueError(f"microbatches={self.m} does not divide the local batch of "
                             f"{rows} rows (layout {self.layout_text!r})")
        if self.stage == 0 and x is None:
            raise ValueError("pipeline stage 0 needs the inputs x (got None)")
        if self.stage == self.pp - 1 and t is None:
            raise ValueError("the last pipeline stage needs the targets t (got None)")
        return rows

    def _post_step_receives(self):
        """Post every receive of the step now (distinct tags): messages land as they come."""
        pending, last_k = {}, self.n_virtual - 1
        for a in self.schedule:
            k = self._k(a.chunk)
            if a.kind == "F" and k > 0:
                pending[a] = self._post_receive(k - 1, a.microbatch, a.chunk, ACT)
            elif a.kind == "B" and k < last_k:
                pending[a] = self._post_receive(k + 1, a.microbatch, a.chunk, GRAD)
        return pending

    def _loss(self, loss, y, t, mb, scale):
        """(local-mean loss of microbatch mb, its dy scaled: the mean over microbatches)."""
        t0 = time.perf_counter()
        value, dy = step_pair(loss, y, t, scale)   # value: maybe a device scalar (summed,
        if self.tracer is not None:                 # then read)
            self.tracer.span("loss", "compute", t0, mb=mb)
        return value, dy

    def _trace_actions(self, timeline, t_start):
        for a, t0, t1 in timeline:
            self.tracer.span(f"{a.kind}{a.microbatch}" + (f"/{a.chunk}" if self.v > 1 else ""),
                             "action", t_start + t0, t_start + t1, kind=a.kind,
                             microbatch=a.microbatch, chunk=a.chunk, stage=self.stage)

    def train_step(self, x, t, loss, grad_scale):
        """Forward + loss + backward of every microbatch in schedule order.

        Returns (this rank's local-mean loss on the last stage, else 0.0; local rows).
        """
        rows = self._check_batch(x, t)
        m, b, last_k = self.m, rows // self.m, self.n_virtual - 1
        xs = [x[i * b:(i + 1) * b] for i in range(m)] if self.stage == 0 else None
        ts = [t[i * b:(i + 1) * b] for i in range(m)] if self.stage == self.pp - 1 else None
        t_start = time.perf_counter()
        self._idle, self._peak, busy = 0.0, self._stashed(), 0.0
        pending = self._post_step_receives()
        dys, values, timeline = {}, [], []
        backward = "backward_input" if self.split else "backward"
        for a in self.schedule:
            mb, c, k = a.microbatch, a.chunk, self._k(a.chunk)
            self.comm.context(microbatch=mb)                     # for a CollectiveTimeout
            self.before_action(a)              # e.g. aux_loss.AuxLossPipeline's hook
            if a.kind == "W":                                    # weight gradients of B(mb)
                t0 = time.perf_counter()
                self._chunk_weights(c, mb)
            elif a.kind == "F":
                h = xs[mb] if k == 0 else self._wait(pending.pop(a))
                t0 = time.perf_counter()
                y = self._chunk_forward(c, h, mb, record=True)
                if k == last_k:                                  # the loss lives here
                    value, dys[mb] = self._loss(loss, y, ts[mb], mb, grad_scale / m)
                    values.append(value)
            else:
                g = dys.pop(mb) if k == last_k else self._wait(pending.pop(a))
                t0 = time.perf_counter()
                g = self._chunk_backward(c, g, mb, backward)
            t1 = time.perf_counter()
            busy += t1 - t0
            timeline.append((a, t0 - t_start, t1 - t_start))
            if a.kind == "F" and k < last_k:
                self._send(y, k + 1, mb, ACT)                    # adjoint: B receive
            elif a.kind == "B" and k > 0:
                self._send(g, k - 1, mb, GRAD)                    # adjoint: F receive
        assert not pending and not dys, "schedule left messages or gradients behind"
        self.comm.context(microbatch=None)
        self._drain_sends()
        step = time.perf_counter() - t_start
        if self.tracer is not None:                              # the actions, on the clock
            self._trace_actions(timeline, t_start)
        self.stats.update(
            schedule=self.schedule_name, pp=self.pp, stage=self.stage, microbatches=m,
            virtual_stages=self.v, peak_stashed=self._peak, idle_s=self._idle, busy_s=busy,
            step_s=step, bubble_fraction=1.0 - busy / step if step > 0 else 0.0,
            actions=[a for a, _, _ in timeline], timeline=timeline)
        value = float(sum(values) / m) if self.stage == self.pp - 1 else 0.0
        return value, rows

    # -- streaming inference -------------------------------------------------------------------
    def inference_loop(self, input_stream, output_stream, prepare=None):
        """Stage 0 reads `input_stream`, the last stage writes `output_stream`, every stage
        forwards what it receives; returns on every rank once the input is exhausted.

        Requests go in groups of G (G = 1, or pp when interleaved): chunk 0 for each request of
        the group, then chunk 1, ... Each rank works in the order (group, chunk, request), in
        which every message it waits for was produced earlier, so with non-blocking sends no
        rank waits forever, and stage 0 reads request i+1 while stage 1 works on request i.
        Each group starts with a COUNT message [q] down the chunk-0 stages: q requests follow.
        A group of q < G requests (q = 0 included) is the last one: the end of stream, after
        which every stage returns. No stage looks at a request's shape to tell. A stage sends
        the count right before the group's first activation, so the next stage wakes once for
        both. `prepare(x)` (stage 0) checks and converts each input.
        """
        pp, s = self.pp, self.stage
        group = pp if self.v > 1 else 1
        window = 4 * (group + 1) * self.v + 4      # bounds the sends in flight per rank
        stream = iter(input_stream) if s == 0 else None
        self._idle, busy, requests = 0.0, 0.0, 0
        t_start = time.perf_counter()

        def work(c, h, count=None):                # forward chunk c of one request, pass it on
            nonlocal busy, requests                # (count: the group's COUNT goes first)
            k = self._k(c)
            t0 = time.perf_counter()
            y = self._chunk_forward(c, h, -1, record=False)
            busy += time.perf_counter() - t0
            if k == self.n_virtual - 1:
                output_stream.write(y)
                requests += 1
            else:
                if count is not None:
                    self._send_count(count)
                self._send(y, k + 1, -1, ACT)
                self._drain_sends(keep=window)

        while True:
            if s == 0:                             # the group's requests, checked before any send
                xs = [x if prepare is None else prepare(x) for x in islice(stream, group)]
                q = len(xs)
            else:                                  # how many the previous stage will send
                q = self._receive_count()
            tell = s < pp - 1                      # the next stage waits for our count
            if tell and q == 0:
                self._send_count(0)
            for i in range(q):                     # chunk 0
                h = xs[i] if s == 0 else self._wait(self._post_receive(s - 1, -1, 0, ACT))
                work(0, h, q if tell and i == 0 else None)
            for c in range(1, self.v):             # later chunks of the same group
                for _ in range(q):
                    work(c, self._wait(self._post_receive(self._k(c) - 1, -1, c, ACT)))
            if q < group:                          # the end of stream
                break
        self._drain_sends()
        step = time.perf_counter() - t_start
        self.stats.update(inference_requests=requests, inference_idle_s=self._idle,
                                 inference_busy_s=busy, inference_s=step)


def pipeline_bubble(engine) -> float:
    """Measured bubble of the last train_step over this rank's pipeline (collective on 'pp'):
    1 - sum of the stages' busy time / (pp * the longest stage's step time)."""
    pp = engine.layout.size("pp")
    mine = np.array([[engine.stats["busy_s"], engine.stats["step_s"]]], dtype=np.float64)
    every = engine.backend.to_host(engine.all_gather(mine, axis=0, group="pp"))
    return float(1.0 - every[:, 0].sum() / (pp * every[:, 1].max()))


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def step_microbatches(layout) -> int:
    """Microbatches per train_step (1 without pp); ValueError for a schedule the engine
    refuses (make_schedule: interleaved needs microbatches a multiple of pp)."""
    if layout.size("pp") == 1:
        return 1
    pp, name, v, m = pipeline_options(layout)
    make_schedule(name, pp, m, v)
    return m


def boundary_widths(model, layout) -> dict:
    """Virtual stage k -> width of the activation it sends on, per batch row: its last layer's
    output on one tp rank, or a decoder's residual stream (the spec's boundary_width)."""
    vstages = assign_stages(model, layout)
    return {vstages[spec.index]: model.boundary_width(layout, spec)
            for spec in model.layers()}                # a stage's later layers overwrite


def memory(view, n_state) -> dict:
    """Nothing beyond the base: the placement's stage keeps each layer on one pp rank."""
    return {}


def step_comm(view) -> dict:
    """Per virtual stage k of this rank, the activation (rows x width of k) sent on to k+1
    and the gradient (rows x width of k-1) sent back to k-1, over all microbatches; the last
    stage broadcasts the float64 loss over pp: (pp-1)/pp x 8."""
    pp = view.size("pp")
    if pp == 1:
        return {}
    widths = boundary_widths(view.model, view.layout)
    last, stage = max(widths), view.coords["pp"]
    sent = {"send": 0, "broadcast": 0.0}
    for k in range(stage, last + 1, pp):
        if k < last:                                   # F: activation to virtual stage k+1
            sent["send"] += view.rows * widths[k] * view.itemsize
        if k > 0:                                      # B: gradient back to virtual stage k-1
            sent["send"] += view.rows * widths[k - 1] * view.itemsize
    if stage == pp - 1:                                # global_mean: the loss, from the last
        sent["broadcast"] += (pp - 1) / pp * view.LOSS_BYTES
    return {"train_step": sent}

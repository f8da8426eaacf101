"""FSDP / ZeRO: parameters, gradients and optimizer state sharded over the `fsdp` axis.

`fsdp` is a data axis: each of its N ranks is fed different rows, like dp. What differs is what
a rank keeps. With P the parameter bytes, per rank (AdamW: 2 state arrays per parameter):

    stage     parameters   gradients        optimizer state   communication per step
    dp        P            P                2P                all_reduce(avg)        2(N-1)/N P
    zero=1    P            P + P/N          2P/N              reduce_scatter + all_gather = dp
    zero=2    P            P/N              2P/N              reduce_scatter + all_gather = dp
    zero=3    P/N          P/N              2P/N              all_gather fwd + bwd, reduce_scatter
                                                              = 1.5 dp (bias-free model) less
                                                              the first layer's W (no bwd get)

(plus zero padding, and under zero=3 one layer's gathered weights alive at a time, two with
prefetch=1). Gradients are reduce-scattered in buckets of the layout option `bucket_mb` (every
stage; fsdp_buckets.py): the same bytes in fewer calls; bucket_mb=0 is one call per tensor.

Shard layout, every stage: the block a rank would hold without fsdp (its tp block, or the whole
array) is split along dim 0 into N slices of s = ceil(L / N) rows, the last ones zero-padded:
`Shard('fsdp', 0, pad=True)` as the placement's last step. Padding rows are zeros that never
reach a gradient, a checkpoint or `gather_params`: gathered weights are trimmed to L rows, and
gradients are padded with zero rows before they are reduce-scattered.

ZeRO-3 (zero=3, the default: FSDP proper). The parameter placement itself is sharded, so
`engine.params[name]` is the (s, ...) slice and the optimizer updates only it:

    get(W)       W = all_gather(W_r, axis 0, 'fsdp')[:L]      before the forward, and again in
                                                               the backward (for dx)
                 adjoint: reduce_scatter(sum) along axis 0 -- the gradient line below
    release(W)   the gathered W is dropped (discard after use)
    add_grad(W)  dW_r += reduce_scatter(pad(dW), 'avg', axis 0, 'fsdp')   in its bucket
                 adjoint of the all_gather (a bucket's: of the same bucket's all_gather); 'avg'
                 rather than 'sum' because fsdp also splits the batch (the data-parallel
                 average and the adjoint in one call)

No backward gather where no input gradient is needed: the model's first layer (an MLP's
Linear 0 and a MoE layer on pipeline stage 0, need_dx=False) computes only dW = x^T dy and
db, which need x and dy, not W, so its backward gets nothing (a GPT's first unit, the
embedding, gets nothing in its backward anyway). The cost model counts the same
(the spec's param_uses), and prefetch=1 learns its plans from the gets that happen.

Activation gradients (dL/dx) are per-row quantities, so they are never reduce-scattered.

ZeRO-1 and ZeRO-2: parameters are replicated on fsdp (the placement has no fsdp step; the
layers use them as they are), while gradients and optimizer state are sharded. The gradient
placement `engine.grad_placements[name]` adds the fsdp step, so `engine.grads[name]` is the
averaged gradient of the (s, ...) slice this rank owns, and `optimizer_shards()` hands out that
slice of the parameter: a view into a zero-padded (N s, ...) buffer of which
`engine.params[name]` is the first L rows, so owning a slice costs no extra parameter memory.
After the optimizer step every rank's updated slice is all-gathered back into the buffer
(`after_optimizer_step`; adjoint of nothing: it only re-replicates parameters).

- ZeRO-1 holds a full (padded) gradient buffer per parameter during the backward; `finish_grads`
  (called by sync_grads) reduce-scatters it (avg, in buckets of `bucket_mb`) into the owned slice.
- ZeRO-2 queues each gradient as its layer's backward produces it (`add_grad`) and
  reduce-scatters the queue as soon as it holds a bucket (`bucket_mb`), and at the end of the
  backward, keeping only its slices: no rank holds more than one bucket of full gradients (or
  one tensor larger than it, plus the bucket's packed copy during its call), and none after
  the backward. ZeRO-3's gradients go through the same buckets.

The fsdp average is done here, so GradientSync is told to skip fsdp (`grad_sync_exempt`); it
still averages the slices over dp (hybrid sharding, HSDP: dp=2,fsdp=2).

Gradient accumulation (backward/train_step with sync=False, then accumulate=True):
- ZeRO-1 accumulates into its full buffers and communicates nothing until the synchronising
  step, exactly like dp.
- ZeRO-2 and ZeRO-3 reduce-scatter every micro-step (a rank cannot keep a gradient it does not
  own; reduce-scatter is linear, so the sum of the micro-steps' slices is the slice of the sum):
  the engine's end_backward flushes the last bucket after every backward.
  The sync=False promise of no communication therefore holds for dp only; ZeRO-3 must all-gather
  weights every micro-step anyway. The dp all-reduce of the slices still waits for sync=True.
  With sync=False, `engine.grads` of ZeRO-2/3 are already averaged over fsdp (not over dp).
  The same holds for pipeline microbatches (pp with fsdp): ZeRO-2/3 reduce-scatter each
  microbatch's gradient (the microbatches of a step share the buckets), so their
  reduce_scatter bytes grow with `microbatches=`.
Prefetch (layout option prefetch=1, ZeRO-3 only): the next layer's all_gather is issued
before the current layer computes; see fsdp_prefetch.py.
"""
from __future__ import annotations

from dataclasses import replace

from . import placement as pl
from .data_parallel import plan_buckets
from .fsdp_buckets import GradBuckets, bucket_calls, bucket_limit, pad_rows, reduce_scatter_chunks
from .fsdp_prefetch import Prefetcher

FSDP_SHARD = pl.Shard("fsdp", 0, pad=True)


def buckets(names, nbytes, limit: int) -> list:
    """Consecutive groups of `names` whose nbytes(name) add up to at most `limit` (at least
    one name each): the data-parallel bucket planner with the single group fsdp."""
    plan = plan_buckets(names, {n: nbytes(n) for n in names}, {n: ("fsdp",) for n in names},
                        limit)
    return [group for _, group in plan]


def gradient_layout(placements: dict):
    """(gradient placements, sync exemptions) under the fsdp axis, decided with no MPI.

    A parameter replicated on fsdp (ZeRO-1/2, or one another strategy left replicated) keeps
    its gradient (and optimizer state) sharded on fsdp all the same: its gradient placement
    gets the fsdp split, and the fsdp average is done here, so the data-parallel sync is told
    to skip fsdp for it (exempt[name] = ('fsdp',))."""
    grad_placements, exempt = dict(placements), {}
    for name, placement in placements.items():
        if placement.is_replicated_on("fsdp"):
            grad_placements[name] = replace(placement,
                                            shards=placement.shards + (FSDP_SHARD,))
            exempt[name] = ("fsdp",)
    return grad_placements, exempt


class FSDPAccess:
    """Parameter-access policy of the `fsdp` axis (see layers.LocalAccess for the interface).

    The stage is decided per parameter: one whose placement is sharded on fsdp gets ZeRO-3
    gather-before-use; one replicated on fsdp gets ZeRO-1 or ZeRO-2 (zero=3 on a parameter
    another strategy left replicated on fsdp falls back to ZeRO-2). With prefetch=1 its
    `Prefetcher` gathers the next layer's ZeRO-3 weights early (module docstring, 'Prefetch').
    """

    def __init__(self, store, fsdp, grad_ready=None):
        layout = store.layout
        self.zero = layout.option("zero", 3)
        if layout.option("prefetch", 0) and self.zero != 3:
            raise ValueError(f"layout {layout.text!r}: prefetch=1 needs zero=3, got zero="
                             f"{self.zero}: ZeRO-1/2 keep parameters replicated on fsdp, so no "
                             "layer all-gathers a weight that could be prefetched")
        self.store, self.comm, self.grad_ready = store, fsdp, grad_ready
        self.xp = fsdp.xp
        self.n = fsdp.size()
        self.rank = fsdp.rank()
        self.bucket_bytes = bucket_limit(layout)
        self.buckets = GradBuckets(fsdp, self.n, self.bucket_bytes, self.deliver)   # ZeRO-2/3
        sizes = layout.sizes
        self.stage: dict = {}   # name -> 1, 2 or 3
        self.rows: dict = {}    # name -> L, rows of the block before the fsdp split
        for name, placement in store.placements.items():
            self.stage[name] = zero_stage(placement, layout)
            if self.stage[name] == 3:
                assert placement.shards[-1] == FSDP_SHARD, f"{name}: {placement}"
                placement = replace(placement, shards=placement.shards[:-1])   # before fsdp
            self.rows[name] = pl.local_shape(store.full_shapes[name], placement, sizes)[0]
        self.padded: dict = {}      # ZeRO-1/2: name -> (N s, ...) replicated parameter buffer
        self.grad_buffers: dict = {}  # ZeRO-1: name -> (N s, ...) full local gradient
        self._live: dict = {}       # (name, mb) -> bytes of a gathered copy not yet released
        self.live_bytes = 0         # gathered bytes alive now (prefetches in flight included)
        self.peak_gathered_bytes = 0
        self.prefetcher = Prefetcher(self) if layout.option("prefetch", 0) else None

    # -- set-up, called by the engine's load_checkpoint ------------------------------------------
    def on_load(self) -> None:
        """ZeRO-1/2: move each replicated parameter into a zero-padded buffer of N s rows (the
        parameter becomes a view of its first L rows) and allocate ZeRO-1's gradient buffers."""
        store, xp = self.store, self.xp
        self.padded.clear()
        self.grad_buffers.clear()
        self.buckets.drop()
        for name in store.local_names:
            if self.stage[name] == 3:
                continue
            buf = pad_rows(xp, store.params[name], self.n)
            self.padded[name] = buf
            store.params[name] = buf[:self.rows[name]]
            if self.stage[name] == 1:
                self.grad_buffers[name] = xp.zeros(buf.shape, store.grads[name].dtype)
        if self.prefetcher is not None:
            self.prefetcher.abandon()
        self._live.clear()
        self.live_bytes = 0

    def count_live(self, nbytes) -> None:
        """Gathered bytes alive changed by `nbytes` (memory_report's 'gathered_peak')."""
        self.live_bytes += nbytes
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.live_bytes)

    def owned(self, name):
        """The block of parameter `name` this rank's optimizer updates (a view)."""
        if self.stage[name] == 3:
            if self.prefetcher is not None and self.prefetcher.pending:
                self.prefetcher.abandon()   # (a pass left by an exception) before the update
            return self.store.params[name]
        buf = self.padded[name]
        s = buf.shape[0] // self.n
        return buf[self.rank * s:(self.rank + 1) * s]

    # -- the access policy -----------------------------------------------------------------------
    def get(self, name, mb=0):
        """The (L, ...) block to compute with: all-gathered over fsdp under ZeRO-3."""
        params = self.store.params
        if self.stage[name] != 3:
            return params[name]
        full = self.prefetcher.take(name) if self.prefetcher is not None else None
        if full is None:                                              # not prefetched
            full = self.comm.all_gather(params[name], axis=0)   # (N s, ...); RS
        self.count_live(full.nbytes - self._live.get((name, mb), 0))   # (an unreleased copy
        self._live[(name, mb)] = full.nbytes                           #  counts as dropped)
        if self.prefetcher is not None:
            self.prefetcher.gathered(name)            # prefetch=1: start the next layer's gather
        return full[:self.rows[name]]                                 # trim the padding rows

    def release(self, name, mb=0) -> None:
        """The gathered weight is no longer needed: drop it (nothing is kept here)."""
        self.live_bytes -= self._live.pop((name, mb), 0)

    def add_grad(self, name, g) -> None:
        """g = dL/d(block) of this rank's rows, shaped (L, ...) like get(name)."""
        if self.stage[name] != 1:   # ZeRO-2/3: averaged over fsdp in its bucket, slice kept
            self.buckets.add(name, g)                                 # -> deliver
            return
        self.grad_buffers[name][:self.rows[name]] += g                # held until finish_grads
        if self.grad_ready is not None:
            self.grad_ready(name)

    def deliver(self, name, shard) -> None:
        """The bucket's reduce-scatter(avg) gave this rank's slice of gradient `name`."""
        self.store.grads[name] += shard                               # adjoint of all_gather
        if self.grad_ready is not None:
            self.grad_ready(name)

    # -- engine hooks ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for g in self.grad_buffers.values():
            g[...] = 0
        self.buckets.drop()

    def end_backward(self) -> None:
        """After every backward (sync or not): ZeRO-2/3 reduce-scatter the last bucket."""
        self.buckets.flush()

    def finish_grads(self) -> None:
        """At sync: ZeRO-2/3's last bucket (if end_backward did not send it), then ZeRO-1's
        full gradients reduce-scattered (avg) into the owned slices, in buckets packed like
        ZeRO-2's (fsdp_buckets: row r of a bucket holds every gradient's slice r)."""
        self.buckets.flush()
        grads = self.store.grads
        names = list(reversed(list(self.grad_buffers)))           # backward order
        for bucket in buckets(names, lambda n: self.grad_buffers[n].nbytes, self.bucket_bytes):
            chunks = [self.grad_buffers[n].reshape(self.n, -1) for n in bucket]
            for name, mine in zip(bucket, reduce_scatter_chunks(self.comm, chunks)):
                g = grads[name]
                g += mine.reshape(g.shape)
                self.grad_buffers[name][...] = 0                   # consumed (accumulation)

    def after_optimizer_step(self) -> None:
        """ZeRO-1/2: all-gather every rank's updated slice back into the replicated buffers."""
        xp = self.xp
        names = list(self.padded)
        for bucket in buckets(names, lambda n: self.padded[n].nbytes, self.bucket_bytes):
            mine = [self.owned(n).reshape(1, -1) for n in bucket]
            flat = mine[0] if len(mine) == 1 else xp.concatenate(mine, axis=1)  # (1, k)
            full = self.comm.all_gather(flat, axis=0)                            # (N, k)
            offset = 0
            for name, m in zip(bucket, mine):
                self.padded[name].reshape(self.n, -1)[...] = full[:, offset:offset + m.shape[1]]
                offset += m.shape[1]


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def zero_stage(placement, layout) -> int:
    """The ZeRO stage of one parameter: 3 when its placement is sharded on fsdp, else the
    layout's zero option capped at 2 (zero=3 on a parameter another strategy left replicated
    on fsdp falls back to ZeRO-2)."""
    if not placement.is_replicated_on("fsdp"):
        return 3
    return min(layout.option("zero", 3), 2)


def memory(view, n_state) -> dict:
    """ZeRO-1/2 keep the parameter in a buffer padded to N owned slices (the base counts the
    L-row block), and ZeRO-1 also holds that full padded gradient during the backward."""
    n = view.size("fsdp")
    if n == 1:
        return {}
    extra = {"parameters": 0, "gradients": 0}
    for name, info in view.params.items():
        stage = zero_stage(info.placement, view.layout)
        if stage == 3:
            continue                                   # the placement made every block a shard
        padded = n * view.nbytes(view.grad_blocks[name])
        extra["parameters"] += padded - view.nbytes(view.blocks[name])
        if stage == 1:
            extra["gradients"] += padded
    return extra


def step_comm(view) -> dict:
    """Per parameter, with N = fsdp ranks and m microbatches (the module docstring's table):
    ZeRO-3 all-gathers the shard before the forward (W and b) and again before the backward
    (W, not the first layer's), and reduce-scatters its gradient, each m times: (N-1) x
    shard bytes per call (the padding travels too). ZeRO-1/2 reduce-scatter the gradient
    into the owned slice (ZeRO-2 per microbatch, ZeRO-1 once at sync) and all-gather the
    updated slices after the optimizer step: (N-1) x slice bytes each. How often a unit gets
    a parameter and adds its gradient (a tied GPT head, recompute, layer 0) is
    the spec's param_uses. Buckets change the calls (step_calls), not the bytes."""
    n, m = view.size("fsdp"), view.microbatches
    if n == 1:
        return {}
    step = {"all_gather": 0, "reduce_scatter": 0}
    opt = {"all_gather": 0}
    for name, info in view.params.items():
        stage = zero_stage(info.placement, view.layout)
        if stage == 3:
            shard = view.nbytes(view.blocks[name])
            gathers, adds = view.model.param_uses(view.layout, name, view.params)
            step["all_gather"] += m * gathers * (n - 1) * shard
            step["reduce_scatter"] += m * adds * (n - 1) * shard
        else:
            owned = view.nbytes(view.grad_blocks[name])
            uses = view.model.param_uses(view.layout, name, view.params)
            adds = m * uses[1] if stage == 2 else 1
            step["reduce_scatter"] += adds * (n - 1) * owned
            opt["all_gather"] += (n - 1) * owned
    return {"train_step": step, "optimizer": opt}


def step_calls(view) -> dict:
    """The calls behind step_comm's bytes, as `engine.comm_calls` counts them: ZeRO-3 one
    all_gather per get (param_uses) and microbatch; ZeRO-2/3 fsdp_buckets.bucket_calls over
    the padded gradients in the order the backward adds them (the spec's grad_order), the m
    microbatches one after the other (exact when each microbatch's backward adds its stage's
    gradients together; the interleaved and zb1p schedules order them otherwise, so there it
    estimates); ZeRO-1's reduce-scatter and ZeRO-1/2's optimizer all_gather: their buckets."""
    n, m = view.size("fsdp"), view.microbatches
    if n == 1:
        return {}
    limit = bucket_limit(view.layout)
    stage = {name: zero_stage(info.placement, view.layout) for name, info in view.params.items()}
    padded = {name: n * view.nbytes(view.grad_blocks[name]) for name in view.params}
    gets = sum(m * view.model.param_uses(view.layout, name, view.params)[0]
               for name in view.params if stage[name] == 3)
    streamed = [padded[k] for k in view.model.grad_order([k for k in stage if stage[k] > 1])]
    held = [padded[k] for k in reversed(list(stage)) if stage[k] == 1]
    replicated = [padded[k] for k in stage if stage[k] < 3]
    return {"train_step": {"all_gather": gets, "reduce_scatter":
                           bucket_calls(streamed * m, limit) + bucket_calls(held, limit)},
            "optimizer": {"all_gather": bucket_calls(replicated, limit)}}

"""FSDP / ZeRO: parameters, gradients and optimizer state sharded over the `fsdp` axis.

`fsdp` is a data axis: each of its N ranks is fed different rows, like dp. What differs is what
a rank keeps. With P the parameter bytes, per rank (AdamW: 2 state arrays per parameter):

    stage     parameters   gradients        optimizer state   communication per step
    dp        P            P                2P                all_reduce(avg)        2(N-1)/N P
    zero=1    P            P + P/N          2P/N              reduce_scatter + all_gather = dp
    zero=2    P            P/N              2P/N              reduce_scatter + all_gather = dp
    zero=3    P/N          P/N              2P/N              all_gather fwd + bwd, reduce_scatter
                                                              = 1.5 dp (bias-free model)

(plus zero padding, and under zero=3 one layer's gathered weights alive at a time, two with
prefetch=1).

Shard layout, every stage: the block a rank would hold without fsdp (its tp block, or the whole
array) is split along dim 0 into N slices of s = ceil(L / N) rows, the last ones zero-padded:
`Shard('fsdp', 0, pad=True)` as the placement's last step. Padding rows are zeros that never
reach a gradient, a checkpoint or `gather_params`: gathered weights are trimmed to L rows, and
gradients are padded with zero rows before they are reduce-scattered.

ZeRO-3 (zero=3, the default; the chapter's FSDP). The parameter placement itself is sharded, so
`engine.params[name]` is the (s, ...) slice and the optimizer updates only it:

    get(W)       W = all_gather(W_r, axis 0, 'fsdp')[:L]      before the forward, and again in
                                                               the backward
                 adjoint: reduce_scatter(sum) along axis 0 -- the gradient line below
    release(W)   the gathered W is dropped (discard after use)
    add_grad(W)  dW_r += reduce_scatter(pad(dW), 'avg', axis 0, 'fsdp')
                 adjoint of the all_gather; 'avg' rather than 'sum' because fsdp also splits the
                 batch (the data-parallel average and the adjoint in one call)

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
- ZeRO-2 reduce-scatters each weight gradient as soon as its layer's backward produced it
  (`add_grad`) and keeps only its slice: no rank holds a full gradient after a layer's backward.

The fsdp average is done here, so GradientSync is told to skip fsdp (`grad_sync_exempt`); it
still averages the slices over dp (hybrid sharding, HSDP: dp=2,fsdp=2).

Gradient accumulation (backward/train_step with sync=False, then accumulate=True):
- ZeRO-1 accumulates into its full buffers and communicates nothing until the synchronising
  step, exactly like dp.
- ZeRO-2 and ZeRO-3 reduce-scatter every micro-step (a rank cannot keep a gradient it does not
  own; reduce-scatter is linear, so the sum of the micro-steps' slices is the slice of the sum).
  The sync=False promise of no communication therefore holds for dp only; ZeRO-3 must all-gather
  weights every micro-step anyway. The dp all-reduce of the slices still waits for sync=True.
  With sync=False, `engine.grads` of ZeRO-2/3 are already averaged over fsdp (not over dp).
  The same holds for pipeline microbatches (pp with fsdp): ZeRO-2/3 reduce-scatter each
  microbatch's gradient, so their reduce_scatter bytes grow with `microbatches=`.

Prefetch (layout option prefetch=1; ZeRO-3 only). Without it every get(W) is a blocking
all_gather: the network idles while a layer computes and the layer waits while it gathers. With
it the next layer's weights are all-gathered with `all_gather_async` (MPI Iallgather) *before*
the current layer computes:

    get(W_i)    W_i = the prefetched gather, waited for (blocking for a pass's first layer)
                issue all_gather_async(W_i+1, b_i+1)       backward: W_i-1 (adjoint: RS, as above)
    compute     layer i                                     <- overlaps the gather of layer i+1
    release     the gathered W_i, b_i are dropped, as without prefetch

- The order is learned, not assumed: the first forward and the first backward pass of every
  chunk gather blocking and record what they gathered, grouped by layer (the `Prefetcher`'s
  plan); later passes of that (chunk, direction) replay it. A pass that departs from its plan
  stops prefetching and gathers blocking from there on; prefetches it did not use are completed
  and dropped at the pass's end, and what it did becomes the plan. A wrong guess costs bytes,
  never numbers: a prefetched buffer only serves the name it gathered, and parameters do not
  change inside a pass.
- Passes: identity `PassBoundary` layers at both ends of every chunk mark where a chunk's
  forward or backward (one microbatch, under pp) starts and ends. No gather is carried across
  them: a pipeline runs other chunks and microbatches in between, and the optimizer updates the
  parameters after the last one. So each pass's first layer is gathered blocking; the tradeoff
  buys simplicity and safety with pp (any schedule, interleaved chunks), tp and accumulation.
- Memory: the next layer's gathered weights are alive while the current layer's are in use, so
  `memory_report()['gathered_peak']` is at most two consecutive layers' gathered weights (one
  layer's without prefetch).
- Communication: the same collectives, bytes and counts as prefetch=0, issued earlier. The
  fsdp peers issue them in the same order, because a plan is a function of the sequence of
  get() calls, which the peers share (their blocking gathers already require it).
- zero=1|2 with prefetch=1 raise ValueError: their parameters are not sharded, so no layer
  gathers a weight that could be prefetched.
- Overlap needs the MPI library to progress a non-blocking collective while the rank computes
  (an asynchronous progress thread, e.g. MPICH's MPIR_CVAR_ASYNC_PROGRESS=1, or network
  offload). Otherwise the transfer mostly happens when the rank waits for it, and prefetch=1
  only moves the wait.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import replace

from .. import placement as pl
from ..layers import Layer
from .data_parallel import DEFAULT_BUCKET_MB

FSDP_SHARD = pl.Shard("fsdp", 0, pad=True)
FWD, BWD = "forward", "backward"


def pad_rows(xp, a, n: int):
    """`a` with zero rows appended along dim 0 up to a multiple of n (no copy if it divides)."""
    extra = -a.shape[0] % n
    if not extra:
        return a
    out = xp.zeros((a.shape[0] + extra,) + tuple(a.shape[1:]), dtype=a.dtype)
    out[:a.shape[0]] = a
    return out


def buckets(names, nbytes, limit: int) -> list:
    """Consecutive groups of `names` whose nbytes add up to at most `limit` (at least one each)."""
    out, size = [[]], 0
    for name in names:
        if out[-1] and size + nbytes(name) > limit:
            out.append([])
            size = 0
        out[-1].append(name)
        size += nbytes(name)
    return [b for b in out if b]


class FSDPAccess:
    """Parameter-access policy of the `fsdp` axis (see layers.LocalAccess for the interface).

    The stage is decided per parameter: one whose placement is sharded on fsdp gets ZeRO-3
    gather-before-use; one replicated on fsdp gets ZeRO-1 or ZeRO-2 (zero=3 on a parameter
    another strategy left replicated on fsdp falls back to ZeRO-2). With prefetch=1 its
    `Prefetcher` gathers the next layer's ZeRO-3 weights early (module docstring, 'Prefetch').
    """

    def __init__(self, engine):
        layout = engine.layout
        self.zero = layout.option("zero", 3)
        if layout.option("prefetch", 0) and self.zero != 3:
            raise ValueError(f"layout {layout.text!r}: prefetch=1 needs zero=3, got zero="
                             f"{self.zero}: ZeRO-1/2 keep parameters replicated on fsdp, so no "
                             "layer all-gathers a weight that could be prefetched")
        self.engine = engine
        self.n = engine.mesh.size("fsdp")
        self.rank = engine.mesh.coord("fsdp")
        self.bucket_bytes = max(1, int(layout.option("bucket_mb", DEFAULT_BUCKET_MB) * 2 ** 20))
        sizes = {a: engine.mesh.size(a) for a in layout.sizes}
        self.stage: dict = {}   # name -> 1, 2 or 3
        self.rows: dict = {}    # name -> L, rows of the block before the fsdp split
        for name, placement in engine.placements.items():
            if placement.is_replicated_on("fsdp"):
                self.stage[name] = min(self.zero, 2)
                self.rows[name] = pl.local_shape(engine.full_shapes[name], placement, sizes)[0]
                # gradients (and so optimizer state) are sharded even though parameters are not
                engine.grad_placements[name] = replace(placement,
                                                       shards=placement.shards + (FSDP_SHARD,))
                exempt = tuple(engine.grad_sync_exempt.get(name, ()))
                engine.grad_sync_exempt[name] = exempt + ("fsdp",)
            else:
                assert placement.shards[-1] == FSDP_SHARD, f"{name}: {placement}"
                self.stage[name] = 3
                before = replace(placement, shards=placement.shards[:-1])
                self.rows[name] = pl.local_shape(engine.full_shapes[name], before, sizes)[0]
        self.padded: dict = {}      # ZeRO-1/2: name -> (N s, ...) replicated parameter buffer
        self.grad_buffers: dict = {}  # ZeRO-1: name -> (N s, ...) full local gradient
        self._live: dict = {}       # (name, mb) -> bytes of a gathered copy not yet released
        self.live_bytes = 0         # gathered bytes alive now (prefetches in flight included)
        self.peak_gathered_bytes = 0
        self.prefetcher = Prefetcher(self) if layout.option("prefetch", 0) else None

    # -- set-up, called by MeshEngine.load_checkpoint --------------------------------------------
    def on_load(self) -> None:
        """ZeRO-1/2: move each replicated parameter into a zero-padded buffer of N s rows (the
        parameter becomes a view of its first L rows) and allocate ZeRO-1's gradient buffers."""
        e, xp = self.engine, self.engine.xp
        self.padded.clear()
        self.grad_buffers.clear()
        for name in e.local_names:
            if self.stage[name] == 3:
                continue
            buf = pad_rows(xp, e.params[name], self.n)
            self.padded[name] = buf
            e.params[name] = buf[:self.rows[name]]
            if self.stage[name] == 1:
                self.grad_buffers[name] = xp.zeros_like(buf)
        if self.prefetcher is not None:   # prefetch=1: pass boundaries around every chunk
            self.prefetcher.abandon()
            self.prefetcher.install(e.chunks)
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
            return self.engine.params[name]
        buf = self.padded[name]
        s = buf.shape[0] // self.n
        return buf[self.rank * s:(self.rank + 1) * s]

    # -- the access policy -----------------------------------------------------------------------
    def get(self, name, mb=0):
        """The (L, ...) block to compute with: all-gathered over fsdp under ZeRO-3."""
        e = self.engine
        if self.stage[name] != 3:
            return e.params[name]
        full = self.prefetcher.take(name) if self.prefetcher is not None else None
        if full is None:                                              # not prefetched
            full = e.all_gather(e.params[name], axis=0, group="fsdp")  # (N s, ...); adjoint: RS
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
        e = self.engine
        if self.stage[name] == 1:
            self.grad_buffers[name][:self.rows[name]] += g            # held until finish_grads
        else:   # ZeRO-2/3: average over fsdp now and keep only the own slice
            shard = e.reduce_scatter(pad_rows(e.xp, g, self.n), op="avg", axis=0, group="fsdp")
            e.grads[name] += shard                                    # adjoint of all_gather
        e.on_grad_ready(name)

    # -- engine hooks ------------------------------------------------------------------------------
    def zero_grad(self) -> None:
        for g in self.grad_buffers.values():
            g[...] = 0

    def finish_grads(self) -> None:
        """ZeRO-1, at sync: reduce-scatter(avg) the full gradients into the owned slices.

        A bucket packs several gradients as an (N, k) array whose row r holds every gradient's
        slice r, so one reduce_scatter along axis 0 serves them all."""
        e, xp = self.engine, self.engine.xp
        names = list(reversed(list(self.grad_buffers)))           # backward order
        for bucket in buckets(names, lambda n: self.grad_buffers[n].nbytes, self.bucket_bytes):
            rows = [self.grad_buffers[n].reshape(self.n, -1) for n in bucket]
            flat = rows[0] if len(rows) == 1 else xp.concatenate(rows, axis=1)   # pack
            mine = e.reduce_scatter(flat, op="avg", axis=0, group="fsdp")        # (1, k)
            offset = 0
            for name, r in zip(bucket, rows):                                     # unpack
                g = e.grads[name]
                g += mine[0, offset:offset + r.shape[1]].reshape(g.shape)
                offset += r.shape[1]
                self.grad_buffers[name][...] = 0                   # consumed (accumulation)

    def after_optimizer_step(self) -> None:
        """ZeRO-1/2: all-gather every rank's updated slice back into the replicated buffers."""
        e, xp = self.engine, self.engine.xp
        names = list(self.padded)
        for bucket in buckets(names, lambda n: self.padded[n].nbytes, self.bucket_bytes):
            mine = [self.owned(n).reshape(1, -1) for n in bucket]
            flat = mine[0] if len(mine) == 1 else xp.concatenate(mine, axis=1)  # (1, k)
            full = e.all_gather(flat, axis=0, group="fsdp")                      # (N, k)
            offset = 0
            for name, m in zip(bucket, mine):
                self.padded[name].reshape(self.n, -1)[...] = full[:, offset:offset + m.shape[1]]
                offset += m.shape[1]


# -- prefetch=1 ------------------------------------------------------------------------------------
class PassBoundary(Layer):
    """Identity layer at either end of a chunk (prefetch=1): where one pass starts and ends.

        chunk = [begin, layer 0, ..., layer k, end]
        forward:   begin.forward starts the pass    end.forward finishes it
        backward:  end.backward starts the pass     begin.backward finishes it (undoes forward)
    """

    def __init__(self, prefetcher, chunk: int, end: bool):
        super().__init__()
        self.prefetcher, self.chunk, self.end = prefetcher, chunk, end

    def __repr__(self):
        return f"PassBoundary(chunk {self.chunk}, {'end' if self.end else 'begin'})"

    def forward(self, x, mb=0, record=True):
        if self.end:
            self.prefetcher.end_pass()
        else:
            self.prefetcher.begin_pass((self.chunk, FWD))
        return x

    def backward(self, dy, mb=0):
        if self.end:
            self.prefetcher.begin_pass((self.chunk, BWD))
        else:
            self.prefetcher.end_pass()
        return dy


class Prefetcher:
    """Learns each pass's order of gathered weights and gathers one layer ahead of it.

    A plan, per (chunk, direction), is the list of names the pass gathered and, at the position
    of each layer's first gather, the names of the next layer to issue there. `counts` holds
    the prefetches issued, used and wasted (issued, then dropped unused at a pass's end).
    """

    def __init__(self, access):
        self.access, self.engine = access, access.engine
        self.layer_of: dict = {}   # parameter name -> (chunk, layer index): groups a plan
        self.plans: dict = {}      # (chunk, direction) -> (names in gather order, {i: next})
        self.pending: dict = {}    # name -> (Future of its all_gather_async, bytes)
        self.key = None            # (chunk, direction) of the pass running now, or None
        self.seen: list = []       # names gathered so far in this pass
        self.on_plan = False       # this pass has followed its plan so far
        self.counts: Counter = Counter()

    def install(self, chunks) -> None:
        """Put a PassBoundary at both ends of every chunk (in place; once)."""
        for c, chunk in enumerate(chunks):
            if chunk and isinstance(chunk[0], PassBoundary):
                continue
            for i, layer in enumerate(chunk):
                for name in layer.param_names:
                    self.layer_of[name] = (c, i)
            chunk[:] = [PassBoundary(self, c, end=False)] + chunk + [PassBoundary(self, c, True)]

    def begin_pass(self, key) -> None:
        if self.key is not None or self.pending:
            self.abandon()                     # the last pass never ended (an exception)
        self.key, self.seen, self.on_plan = key, [], True

    def end_pass(self) -> None:
        """Drop unused prefetches; what this pass gathered becomes its plan."""
        wasted = self.drain()
        if self.key is not None:
            plan = self.plans.get(self.key)
            if plan is None or plan[0] != self.seen or wasted:
                self.plans[self.key] = self.make_plan(self.seen)
        self.key = None

    def abandon(self) -> None:
        """Complete and drop the prefetches of a pass that did not finish; learn nothing."""
        self.drain()
        self.key = None

    def make_plan(self, names):
        """(names, {position of a layer's first gather: the next layer's names})."""
        starts = [i for i, n in enumerate(names)
                  if i == 0 or self.layer_of.get(n) != self.layer_of.get(names[i - 1])]
        groups = [tuple(names[a:b]) for a, b in zip(starts, starts[1:] + [len(names)])]
        return list(names), {starts[g]: groups[g + 1] for g in range(len(groups) - 1)}

    # -- called by FSDPAccess.get ------------------------------------------------------------------
    def take(self, name):
        """The prefetched gather of `name`, waited for; None when none is in flight."""
        entry = self.pending.pop(name, None)
        if entry is None:
            return None
        future, nbytes = entry
        self.access.count_live(-nbytes)        # get() counts it again, as held
        self.counts["used"] += 1
        return future.result()

    def gathered(self, name) -> None:
        """`name` was just gathered: if the plan says a layer starts here, issue the next."""
        if self.key is None:
            return                             # outside a pass: nothing to follow
        i = len(self.seen)
        self.seen.append(name)
        plan = self.plans.get(self.key)
        if plan is None or not self.on_plan:
            return
        order, ahead = plan
        if i >= len(order) or order[i] != name:
            self.on_plan = False               # departed from the plan: blocking from here on
            return
        for nxt in ahead.get(i, ()):
            self.issue(nxt)

    def issue(self, name) -> None:
        if name in self.pending:
            return
        e = self.engine
        future = e.all_gather_async(e.params[name], axis=0, group="fsdp")   # adjoint: RS
        nbytes = self.access.n * e.params[name].nbytes                      # (N s, ...) result
        self.pending[name] = (future, nbytes)
        self.access.count_live(nbytes)          # alive from the issue: its receive buffer
        self.counts["issued"] += 1

    def drain(self) -> int:
        """Complete and drop the prefetches not used; returns how many there were."""
        for future, nbytes in self.pending.values():
            future.result()                     # every peer issued it: complete, then drop
            self.access.count_live(-nbytes)
        wasted = len(self.pending)
        self.counts["wasted"] += wasted
        self.pending.clear()
        return wasted

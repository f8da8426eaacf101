"""FSDP prefetch: all-gather the next layer's ZeRO-3 weights while this layer computes.

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

from ..nn.layers import Layer

FWD, BWD = "forward", "backward"


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
        self.access = access
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
        block = self.access.store.params[name]
        future = self.access.comm.all_gather_async(block, axis=0)           # adjoint: RS
        nbytes = self.access.n * block.nbytes                               # (N s, ...) result
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

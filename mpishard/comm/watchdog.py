"""The stall watchdog: every blocking collective and receive waits at most `timeout` seconds.

Blocking collectives (`Watchdog.run`: all_reduce, all_gather, all_to_all, broadcast, barrier)
are the blocking MPI call itself (Allreduce, ...), bounded by the guard (guard.py): a thread
that sleeps beside the call and, past its deadline, prints the CollectiveTimeout line and
aborts the job. A poll loop from Python cannot match MPI's own wait (measured, 1 MiB Alltoall
at 4 ranks on 2 cores: Ialltoall waited by `Test` + `sched_yield` 1.08-1.13x the blocking call;
the blocking call under the guard 1.00-1.04x). Where the guard cannot run (MPI initialised
below MPI_THREAD_MULTIPLE), the call is issued in its non-blocking form and polled as below.

The collectives built from point-to-point messages (reduce_scatter, all_to_all_v's data) are
waited by MPI's Waitall under the guard the same way (`settle`). Receives, the non-blocking
calls' Futures, all_to_all_v's probes, and everything below MPI_THREAD_MULTIPLE are waited by
`Watchdog.collective` / `peer` / `until`, which poll with `Test`: polls that yield the core
(`sched_yield`) between them up to 0.1 s, then sleeps that grow with the time already waited
(5% of it, at most 10 ms), so a rank that waits long on a stalled peer uses ~1-5% of a core
instead of spinning in MPI (measured: benchmarks/watchdog_overhead.py). No busy-spin phase:
with more ranks than free cores a spinning rank takes the core its peer needs to progress the
collective (measured on 2 loaded cores, 4 MiB all_reduce: 1 ms of spin 1.25-1.33x raw
Allreduce, yielding from the first failed poll 1.09x, plain Waitall 1.03-1.06x); with a free
core per rank a yield returns at once.

With more ranks on a node than CPUs (`oversubscribed`, threads.py), yielding is not free
either: the scheduler still gives every runnable rank its share, so ranks that yield-poll
while a peer computes take the peer's core (measured, 256-GEMMs on rank 0 while the others
wait: 2x slower with 4 ranks on 2 cores, 4x with 8, whether the others yield or sit in MPICH's
Wait; 1.0x when they sleep). There, a poll yields for 1 ms (FAST), then, up to 0.1 s, yields
only while every member of the group has entered the call (the arrival counters below: the
rest is moving data, which needs every member's polls) and sleeps while one is still missing
(a laggard computing, a pipeline stage ahead); after that, it sleeps as above. A blocking
collective there passes a gate first (`guarded`): it stamps its arrival, and when a member is
missing and this group's members have been late by more than FAST before (`lagging`, learnt
from the arrival stamps after a call entered with a member missing: every LEARN-th call of a
group not lagging looks), it waits for them the same way, probing MPI so that its own
non-blocking calls progress, and only then enters MPI. The flag goes off at the first call
where nobody is late to this rank: every member came within FAST/2 at the gate, or was in
before it (a rank that is itself the last one, call after call, would otherwise never see the
gate again and never unlearn). A group whose members arrive together never waits at the
gate: a gate that always waited cost 1.04-1.12x on 1 MiB collectives at 4 ranks, against
1.00-1.06x for looking only.

When the timeout passes, a polled wait raises `CollectiveTimeout`, and the guard prints the
same text (`mpishard: error: CollectiveTimeout: ...`) and aborts: the operation, the group (its
axes and the ranks in it), the step and microbatch the trainer and the pipeline set with
`Comm.context`, and the late ranks. Every rank that waits times out on its own clock; under
`python -m mpi4py` the first uncaught exception aborts the job (the CLI prints it as one line
and calls MPI_Abort: cli/usage.py abort_job).

How late ranks are found without the stalled rank's help: arrival counters in an MPI-3 RMA
window (arrivals.py). Entering a collective, a rank bumps its own counter for the group's set
of active mesh axes: a plain store into its own window memory, no MPI call. On a timeout it
reads its peers' counters with passive-target `Rget`; a peer whose count is below the waiting
rank's has not entered this collective. Point-to-point waits name the peer directly.
`timeout=0` turns all of this off (the blocking call, or a plain `Waitall`).
"""
from __future__ import annotations

import os
import time

from mpi4py import MPI

from ..validate import check_number
from .arrivals import RING, STAMPS, Arrivals
from .guard import Guard, usable
from .mesh import AXES, coordinates
from .threads import oversubscribed

DEFAULT_TIMEOUT = 600.0
YIELD = 0.1           # seconds waited before the polls sleep
FAST = 1e-3           # oversubscribed: seconds of yielding before a wait looks who is missing
BURST = 32            # yielding polls between two clock reads
LEARN = 4             # a group not lagging looks for late members every LEARN-th call
MIN_SLEEP = 2e-5      # the shortest sleep between two polls
MAX_SLEEP = 1e-2      # the longest sleep between two polls


class CollectiveTimeout(RuntimeError):
    """A collective or a receive waited longer than the engine's timeout."""


class Watchdog:
    """Bounded waits for one engine's Comm (shared by its group views)."""

    def __init__(self, mesh, timeout=DEFAULT_TIMEOUT):
        self.timeout = check_number("timeout", timeout, low=0)
        self.timeout_ns = int(self.timeout * 1e9)   # the guard's deadline (guard.py)
        self.mesh = mesh
        crowded = bool(self.timeout) and oversubscribed(mesh.world)
        # seconds of yielding polls before a wait sleeps while a member is missing
        self.fast = FAST if crowded else YIELD
        self.where: dict = {}                 # step, microbatch: set by Comm.context
        self.groups: dict = {}                # communicator handle -> Watchdog.group
        self.tracer = None                    # a comm.trace.Tracer while tracing: wait times
        self.arrivals = Arrivals.of(mesh.world) if self.timeout else None
        self.cells = self.arrivals.cells if self.timeout else None     # its counters
        self.base = self.arrivals.take_block() if self.timeout else 0
        # blocking collectives under the guard's deadline (guard.py), else polled
        self.guard = Guard.shared(self.timeout) if self.timeout and usable() else None
        # an oversubscribed node: the gate before a blocking collective (run)
        self.gated = crowded and self.guard is not None and self.arrivals.peers is not None
        self.lagging: dict = {}               # counter index -> True: a member came > FAST late
        self.slots: dict = {}                 # communicator handle -> Watchdog.slot
        active = mesh.layout.active_axes
        for subset in range(1 << len(active)) if self.timeout else ():
            # every group's communicator now: MPI_Comm_split later, mid-step, is unbounded
            mesh.comm(tuple(a for i, a in enumerate(active) if subset >> i & 1))

    def group(self, comm) -> tuple:
        """(counter index, world ranks, name) of the group of `comm`, a communicator of the
        mesh: one counter per set of axes the members differ on, the same on every member."""
        key = comm.py2f()
        if key not in self.groups:
            mine, world = comm.Get_group(), self.mesh.world.Get_group()
            ranks = MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world)
            mine.Free()
            world.Free()
            coords = [coordinates(self.mesh.layout, r) for r in ranks]
            axes = [a for a in AXES if len({c[a] for c in coords}) > 1]
            name = "world" if len(ranks) == self.mesh.world.Get_size() else "+".join(axes)
            index = self.base + sum(1 << AXES.index(a) for a in axes)
            self.groups[key] = (index, list(ranks), name or "self")
        return self.groups[key]

    def arrive(self, comm):
        """Count this rank into its next collective on `comm`: (counter, count) or None."""
        if not self.timeout:
            return None
        index = self.group(comm)[0]
        cells = self.cells
        cells[index] += 1
        return index, cells[index]

    def run(self, blocking, nonblocking, args, what: str, comm):
        """One collective, bounded: `blocking(*args)` (comm.Allreduce, ...) under the guard's
        deadline, or where the guard cannot run, `nonblocking(*args)` polled. Without a
        timeout, the blocking call alone. Returns what `blocking` returns (None polled)."""
        if self.guard is None:
            if self.timeout:
                self.collective([nonblocking(*args)], what, comm)
                return None
            return blocking(*args)
        if self.tracer is not None:
            return self.traced(self.guarded, comm, blocking, args, what, comm)
        return self.guarded(blocking, args, what, comm)

    def guarded(self, blocking, args, what: str, comm):
        """Count in (and on an oversubscribed node, the gate), then the blocking call under
        the guard. The hot path of every collective, so written flat (`watched` inlined, one
        clock read for the arrival stamp and the deadline): at 4 ranks on 2 cores each call
        runs with its caches just evicted by the transfer, where every call and line costs
        several times its warm time (1 MiB, the same run: the engine's all_reduce(out=)
        1.10x raw Allreduce with `watched` a call, 1.07x inlined), and a group not `lagging`
        only looks for a missing member every LEARN-th call."""
        try:
            index, peers = self.slots[comm.py2f()]
        except KeyError:
            index, peers = self.slot(comm)
        cells = self.cells
        count = cells[index] + 1
        now = time.monotonic_ns()
        look = False
        if peers:                                  # gated: stamp, then count, then look
            cells[STAMPS + index * RING + count % RING] = now
            cells[index] = count
            if index in self.lagging or count % LEARN == 0:
                for view in peers:
                    if view[index] < count:
                        look = self.gate(peers, index, count, what, comm)
                        if not look:               # it waited at the gate: the deadline
                            now = time.monotonic_ns()       # counts from here
                        break
                else:                              # everyone was in before this rank:
                    self.lagging.pop(index, None)  # nobody is late to it now
        else:
            cells[index] = count
        guard = self.guard
        guard.watched = (now, self.timeout_ns, self.message, (what, comm, (index, count)))
        try:
            result = blocking(*args)
        finally:                  # an MPI error raised here must not time out later
            guard.watched = None
        if look:
            self.learn(peers, index, count, now)      # `now` is still the arrival stamp
        return result

    def settle(self, requests, what: str, comm, ticket=None) -> None:
        """Wait for the point-to-point requests of a collective built from messages
        (reduce_scatter, all_to_all_v). Under the guard: MPI's own Waitall, bounded by the
        guard's deadline like a blocking collective (counted in, and gated, here; `ticket`:
        already counted at issue). Below MPI_THREAD_MULTIPLE, polled (`collective`). Measured,
        4 MiB reduce_scatter at 4 ranks on 2 cores: polled 1.22-1.29x MPICH's
        Reduce_scatter_block, under the guard 1.11-1.13x (3 trials; 0.71-0.92x on 2 ranks)."""
        if self.guard is None:
            if ticket is None:
                self.collective(requests, what, comm)
            else:                      # with a `ticket` the caller traces the wait itself
                self.wait_collective(requests, what, comm, ticket)
        elif ticket is None:
            self.run(MPI.Request.Waitall, None, (requests,), what, comm)
        else:
            self.watched(MPI.Request.Waitall, (requests,), what, comm, ticket)

    def watched(self, blocking, args, what: str, comm, ticket):
        """`blocking(*args)` under the guard's deadline; its timeout describes the collective
        of `ticket` (counted in already)."""
        guard = self.guard
        guard.watched = (time.monotonic_ns(), self.timeout_ns, self.message, (what, comm, ticket))
        try:
            return blocking(*args)
        finally:                  # an MPI error raised here must not time out later
            guard.watched = None

    def slot(self, comm) -> tuple:
        """(counter index, the other members' counters as views or () when not gated) of
        `comm`, kept per communicator."""
        index, ranks, _ = self.group(comm)
        views = self.arrivals.peers if self.gated else None
        peers = tuple(views[r] for r in ranks if r != self.mesh.rank) if views else ()
        self.slots[comm.py2f()] = index, peers
        return index, peers

    def gate(self, peers, index: int, count: int, what: str, comm) -> bool:
        """A member is missing: if this group is `lagging`, wait for it (yield, after FAST
        sleep; module docstring) and return False, or past the timeout raise CollectiveTimeout
        (here, outside MPI, it can be raised); else go on at once and return True (the call is
        then `learn`ed from)."""
        if index not in self.lagging:
            return True
        progress = self.mesh.world.Iprobe

        def everyone_in():     # the probe drives MPI's progress: a peer waiting on this
            progress(MPI.ANY_SOURCE, MPI.ANY_TAG)     # rank's non-blocking calls gets it
            return all(view[index] >= count for view in peers)
        t0 = time.monotonic()
        if not self.poll_until(everyone_in):
            self.expired(what, comm, self.late(comm, (index, count)))
        if time.monotonic() - t0 < self.fast / 2:
            del self.lagging[index]               # everyone came soon: stop waiting here
        return False

    def learn(self, peers, index: int, count: int, since: int) -> None:
        """After a call entered with a member missing: wait at the gate from now on if the
        last member came more than FAST after this rank (its arrival stamp, arrivals.py)."""
        at = STAMPS + index * RING + count % RING
        if max(view[at] for view in peers) - since > self.fast * 1e9:
            self.lagging[index] = True

    def message(self, what: str, comm, ticket) -> str:
        """The timeout's text for the collective of `ticket` (on the guard's thread)."""
        return self.describe(what, comm, self.late(comm, ticket))

    def collective(self, requests, what: str, comm, ticket=None) -> None:
        """Wait for a collective's requests; `ticket` from `arrive` when it was counted at
        issue (the non-blocking calls), else it is counted now."""
        if self.tracer is not None:
            self.traced(self.wait_collective, comm, requests, what, comm, ticket)
        else:
            self.wait_collective(requests, what, comm, ticket)

    def traced(self, wait, comm, *args):
        """Run `wait(*args)` and tell the tracer how long it blocked, on which group; returns
        what `wait` returns."""
        t0 = time.perf_counter()
        result = wait(*args)
        self.tracer.blocked(self.group(comm)[2], time.perf_counter() - t0)
        return result

    def wait_collective(self, requests, what: str, comm, ticket=None) -> None:
        if not self.timeout:
            MPI.Request.Waitall(requests)
            return
        ticket = ticket or self.arrive(comm)
        if not self.poll(requests, lambda: self.everyone_in(comm, ticket)):
            self.expired(what, comm, self.late(comm, ticket))

    def peer(self, requests, what: str, comm, rank: int) -> None:
        """Wait for a send or receive with rank `rank` of `comm`."""
        if self.tracer is not None:
            self.traced(self.wait_peer, comm, requests, what, comm, rank)
        else:
            self.wait_peer(requests, what, comm, rank)

    def wait_peer(self, requests, what: str, comm, rank: int) -> None:
        if not self.timeout:
            MPI.Request.Waitall(requests)
        elif not self.poll(requests):
            ranks = self.group(comm)[1]
            self.expired(what, comm, f"[{ranks[rank] if 0 <= rank < len(ranks) else rank}] "
                         "(the peer)")

    def waiter(self, what: str, comm, ticket=None, rank=None):
        """A Future's wait: the collective (counted at issue) or the peer's."""
        if rank is not None:
            return lambda requests: self.peer(requests, what, comm, rank)
        return lambda requests: self.collective(requests, what, comm, ticket)

    def until(self, test, what: str, comm, ticket) -> None:
        """Poll `test()` (e.g. matched probes: comm/alltoallv.py) until it returns True, at
        most the timeout; then CollectiveTimeout naming the members of `comm` that have not
        arrived (`ticket` from `arrive`). Needs a timeout (no requests to Waitall on)."""
        if not self.poll_until(test, lambda: self.everyone_in(comm, ticket)):
            self.expired(what, comm, self.late(comm, ticket))

    def poll(self, requests, everyone_in=None) -> bool:
        """Test until done (True) or the timeout passes (False); yields, then sleeps (module
        docstring). One request is tested with its own `Test` (0.14 us here), not `Testall`
        (0.66 us): the cost of a poll is paid again on every turn of the yield loop."""
        if len(requests) == 1:
            return self.poll_until(requests[0].Test, everyone_in)
        return self.poll_until(lambda: MPI.Request.Testall(requests), everyone_in)

    def poll_until(self, test, everyone_in=None) -> bool:
        """poll's loop on any `test()`; `everyone_in()`: whether every member has entered the
        call (collectives; None for a peer's message)."""
        if test():
            return True
        t0 = time.monotonic()
        if self.yield_until(test, t0, min(self.fast, self.timeout)):
            return True
        while True:
            waited = time.monotonic() - t0
            if waited > self.timeout:
                return False
            if waited < YIELD and everyone_in is not None and everyone_in():
                if self.yield_until(test, t0, min(YIELD, self.timeout)):
                    return True
                continue
            time.sleep(min(MAX_SLEEP, max(MIN_SLEEP, 0.05 * waited)))
            if test():
                return True

    @staticmethod
    def yield_until(test, t0: float, limit: float) -> bool:
        """Poll `test()`, yielding the core between polls, until it is True (True) or `limit`
        seconds since `t0` passed (False). The clock is read once per BURST polls: with more
        ranks than cores, every turn of a waiting rank's loop delays the peers that share its
        core, and each step of the collective waits for them (4 ranks on 2 cores, 1 MiB
        Ialltoall: a clock read, a subtraction and two comparisons per turn cost 1.2x the bare
        `while not Test(): sched_yield()` loop; per BURST, 1.03x)."""
        yield_, clock = os.sched_yield, time.monotonic
        while clock() - t0 <= limit:
            for _ in range(BURST):
                yield_()
                if test():
                    return True
        return False

    def everyone_in(self, comm, ticket) -> bool:
        """Whether every member of `comm` has entered the collective of `ticket` (its arrival
        counter read where it is, in the window: shared memory on one node)."""
        index, mine = ticket
        self.arrivals.win.Sync()
        for rank in self.group(comm)[1]:
            if rank != self.mesh.rank:
                count = self.arrivals.read(rank, index)
                if count is None or count < mine:
                    return False
        return True

    def late(self, comm, ticket) -> str:
        """The members whose counter is below this rank's `ticket`, as text."""
        index, mine = ticket
        late, silent = [], []
        self.arrivals.win.Sync()
        for rank in self.group(comm)[1]:
            if rank != self.mesh.rank:
                count = self.arrivals.read(rank, index)
                if count is None:
                    silent.append(rank)
                elif count < mine:
                    late.append(rank)
        text = f"{late} (not yet in this collective)"
        return text + (f"; ranks {silent} did not answer" if silent else "")

    def expired(self, what, comm, late) -> None:
        raise CollectiveTimeout(self.describe(what, comm, late))

    def describe(self, what, comm, late) -> str:
        """The text of a timeout of `what` on `comm`, `late` naming the late ranks."""
        self.arrivals.broken = True
        _, ranks, name = self.group(comm)
        where = "".join(f", {k} {v}" for k, v in self.where.items() if v is not None)
        return (f"{what} on group {name} (ranks {ranks}) timed out after "
                f"{self.timeout:g} s on rank {self.mesh.rank}{where}: late ranks: {late}; "
                f"set make_engine(timeout=) or --timeout (0: off)")

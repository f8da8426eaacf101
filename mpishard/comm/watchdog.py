"""The stall watchdog: every blocking collective and receive waits at most `timeout` seconds.

A blocking call is issued in its non-blocking form (Iallreduce, Ibarrier, Irecv, ...) and
`Watchdog.collective` / `peer` poll it with `Test`: polls that yield the core (`sched_yield`)
between them up to 0.1 s, then sleeps that grow with the time already waited (5% of it, at
most 10 ms), so a rank that waits long on a stalled peer uses ~1-5% of a core instead of
spinning in MPI (measured: benchmarks/watchdog_overhead.py). No busy-spin phase: with more
ranks than free cores a spinning rank takes the core its peer needs to progress the collective
(measured on 2 loaded cores, 4 MiB all_reduce: 1 ms of spin 1.25-1.33x raw Allreduce, yielding
from the first failed poll 1.09x, plain Waitall 1.03-1.06x); with a free core per rank a yield
returns at once.

With more ranks on a node than CPUs (`oversubscribed`, threads.py), yielding is not free
either: the scheduler still gives every runnable rank its share, so ranks that yield-poll
while a peer computes take the peer's core (measured, 256-GEMMs on rank 0 while the others
wait: 2x slower with 4 ranks on 2 cores, 4x with 8, whether the others yield or sit in MPICH's
Wait; 1.0x when they sleep). There, a wait yields for 1 ms (FAST), then, up to 0.1 s, yields
only while every member of the group has entered the call (the arrival counters below: the
rest is moving data, which needs every member's polls) and sleeps while one is still missing
(a laggard computing, a pipeline stage ahead); after that, it sleeps as above.
When the timeout passes, it raises `CollectiveTimeout` naming the operation, the group
(its axes and the ranks in it), the step and microbatch the trainer and the pipeline set
with `Comm.context`, and the late ranks. Every rank that waits raises on its own clock;
under `python -m mpi4py` the first uncaught one aborts the job (the
CLI prints it as one line and calls MPI_Abort: cli/usage.py abort_job).

How late ranks are found without the stalled rank's help: arrival counters in an MPI-3 RMA
window (`Arrivals`, one per set of ranks engines are built on). Entering a collective, a rank
bumps its own counter for the group's set of active mesh axes: a plain store into its own
window memory, no MPI call. On a timeout it reads its peers' counters with
passive-target `Rget` under a `Lock_all` epoch held for the window's life; a peer whose count is
below the waiting rank's has not entered this collective. With MPICH (ch4, ucx or ofi) on one
node the window is shared memory, so the read needs no progress on the stalled rank; a read
that does not complete within a second reports that rank as not answering. Point-to-point
waits name the peer directly. `timeout=0` turns all of this off (plain `Waitall`).
"""
from __future__ import annotations

import atexit
import os
import sys
import time

import numpy as np
from mpi4py import MPI

from ..validate import check_number
from .mesh import AXES, coordinates
from .threads import oversubscribed

DEFAULT_TIMEOUT = 600.0
YIELD = 0.1           # seconds waited before the polls sleep
FAST = 1e-3           # oversubscribed: seconds of yielding before a wait looks who is missing
BURST = 32            # yielding polls between two clock reads
MIN_SLEEP = 2e-5      # the shortest sleep between two polls
MAX_SLEEP = 1e-2      # the longest sleep between two polls
SLOTS = 1 << len(AXES)     # one counter per set of mesh axes (bit i: AXES[i])
BLOCKS = 256               # engines sharing one window (a block of SLOTS counters each)
READ_TIMEOUT = 1.0


class CollectiveTimeout(RuntimeError):
    """A collective or a receive waited longer than the engine's timeout."""


def _zeros(n: int) -> memoryview:
    """n int64 zeros, to store into a slice of Arrivals.cells."""
    return memoryview(bytes(8 * n)).cast("q")


class Arrivals:
    """Arrival counters of the ranks of one communicator in an RMA window (module docstring).

    Created collectively by the first Comm with a timeout on a communicator of these ranks;
    each later Comm takes the next block of SLOTS counters (engines are built collectively, in
    the same order on every rank). Freed collectively at exit, before MPI_Finalize, unless the
    process ends on an uncaught exception or after a timeout (a peer may never come to free
    it; the job is being aborted anyway).
    """

    SHARED: dict = {}     # members (COMM_WORLD ranks, in rank order) -> their Arrivals

    def __init__(self, comm):
        self.comm = comm
        self.win = MPI.Win.Allocate(BLOCKS * SLOTS * 8, 8, comm=comm)
        # the counters as a memoryview: a Python int store (0.26 us) instead of numpy's
        # scalar += (0.63 us), on every call
        self.cells = memoryview(self.win.tomemory()).cast("B").cast("q")
        self.cells[:] = _zeros(len(self.cells))
        self.win.Lock_all()
        self.blocks = 0
        self.broken = False                   # a timeout happened: never free collectively
        atexit.register(self.free)

    @classmethod
    def of(cls, comm) -> "Arrivals":
        """The window of `comm`'s members: one per set of members, however many communicators
        (a test's split per case) engines are built on, so windows do not pile up."""
        mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        key = tuple(MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world))
        mine.Free()
        world.Free()
        if key not in cls.SHARED:
            cls.SHARED[key] = cls(comm)
        return cls.SHARED[key]

    def take_block(self) -> int:
        """The offset of a fresh block of SLOTS counters, zeroed."""
        base = (self.blocks % BLOCKS) * SLOTS
        self.blocks += 1
        self.cells[base:base + SLOTS] = _zeros(SLOTS)
        return base

    def read(self, rank: int, index: int):
        """Counter `index` of `rank`, or None if the read does not complete in time."""
        out = np.zeros(1, dtype=np.int64)
        req = self.win.Rget(out, rank, target=(index, 1, MPI.INT64_T))
        t0 = time.monotonic()
        while not req.Test():
            if time.monotonic() - t0 > READ_TIMEOUT:
                return None
            time.sleep(1e-3)
        return int(out[0])

    def free(self) -> None:
        failed = self.broken or getattr(sys, "last_value", None) is not None
        if self.win is not None and not failed and not MPI.Is_finalized():
            self.cells.release()
            self.win.Unlock_all()
            self.win.Free()
        self.win = None


class Watchdog:
    """Bounded waits for one engine's Comm (shared by its group views)."""

    def __init__(self, mesh, timeout=DEFAULT_TIMEOUT):
        self.timeout = check_number("timeout", timeout, low=0)
        self.mesh = mesh
        # seconds of yielding polls before a wait sleeps while a member is missing
        self.fast = FAST if self.timeout and oversubscribed(mesh.world) else YIELD
        self.where: dict = {}                 # step, microbatch: set by Comm.context
        self.groups: dict = {}                # communicator handle -> Watchdog.group
        self.tracer = None                    # a comm.trace.Tracer while tracing: wait times
        self.arrivals = Arrivals.of(mesh.world) if self.timeout else None
        self.base = self.arrivals.take_block() if self.timeout else 0
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
        cells = self.arrivals.cells
        cells[index] += 1
        return index, cells[index]

    def collective(self, requests, what: str, comm, ticket=None) -> None:
        """Wait for a collective's requests; `ticket` from `arrive` when it was counted at
        issue (the non-blocking calls), else it is counted now."""
        if self.tracer is not None:
            self.traced(self.wait_collective, comm, requests, what, comm, ticket)
        else:
            self.wait_collective(requests, what, comm, ticket)

    def traced(self, wait, comm, *args) -> None:
        """Run `wait(*args)` and tell the tracer how long it blocked, on which group."""
        t0 = time.perf_counter()
        wait(*args)
        self.tracer.blocked(self.group(comm)[2], time.perf_counter() - t0)

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
        self.arrivals.broken = True
        _, ranks, name = self.group(comm)
        where = "".join(f", {k} {v}" for k, v in self.where.items() if v is not None)
        raise CollectiveTimeout(
            f"{what} on group {name} (ranks {ranks}) timed out after "
            f"{self.timeout:g} s on rank {self.mesh.rank}{where}: late ranks: {late}; "
            f"set make_engine(timeout=) or --timeout (0: off)")

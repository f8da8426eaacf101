"""The stall watchdog: every blocking collective and receive waits at most `timeout` seconds.

The engine gives its Comm a `Watchdog`, which bounds each wait of the interface the Comm calls
(comm/waits.py: `run`, `wait_for_requests`, `wait_collective`, `wait_peer`, `wait_until`).

Blocking collectives (`Watchdog.run`: all_reduce, all_gather, all_to_all, broadcast, barrier)
are the blocking MPI call itself (Allreduce, ...), bounded by the guard (guard.py): a thread
that sleeps beside the call and, past its deadline, prints the CollectiveTimeout line and
aborts the job. The collectives built from point-to-point messages (reduce_scatter,
all_to_all_v's data) are waited by MPI's Waitall under the guard the same way
(`wait_for_requests`). Where the guard cannot run (MPI initialised below MPI_THREAD_MULTIPLE),
the call is issued in its non-blocking form and polled instead.

Receives, the non-blocking calls' Futures, all_to_all_v's probes, and everything below
MPI_THREAD_MULTIPLE are polled with `Test` (`wait_collective`, `wait_peer`, `wait_until`):
polls that yield the core (`sched_yield`) between them for the first YIELD seconds, then
sleeps that grow with the time already waited (5% of it, at most MAX_SLEEP), so a rank that
waits long on a stalled peer uses little CPU instead of spinning in MPI. A sleep that overran
by more than guard.FROZEN means the process was stopped or starved: that time is not
counted, as the guard does not count it (guard.py).

When the timeout passes, the guard prints the error and aborts; a polled wait raises
`CollectiveTimeout` with the same text: the operation, the group (its axes and the ranks in
it), the step and microbatch the trainer and the pipeline set with `Comm.context`, and the
late ranks. A polled timeout leaves its requests pending (MPI cannot cancel a collective): they
are kept (with their buffers) for the process's life, receives are cancelled, and the watchdog
refuses every later call with `CommUnusable`: the engine must be rebuilt. Every rank that
waits times out on its own clock; under `python -m mpi4py` the first uncaught exception aborts
the job (the CLI prints it as one line and calls MPI_Abort: cli/usage.py abort_job).

How late ranks are found without the stalled rank's help: arrival counters in an MPI-3 RMA
window (arrivals.py). Entering a collective, a rank bumps its own counter for the group's set
of active mesh axes: a plain store into its own window memory, no MPI call. On a timeout it
reads its peers' counters with passive-target `Rget`; a peer whose count is below the waiting
rank's has not entered this collective. When every peer's count is up to the waiting rank's,
none is late: one of them entered and stopped or hung inside the call (`kill -STOP`, a wedged
driver), which the counters cannot tell from the ones waiting, and the line says so in words
(`late_text`); a peer whose counter cannot be read is named as not answering. What the
counters found goes into the flight recorder's dump too (flight.note_arrivals), so `mpishard
flight` reasons from the same counts. Point-to-point waits name the peer directly.
`timeout=0` turns all of this off (the blocking call, or a plain `Waitall`).
"""
from __future__ import annotations

import os
import time

from mpi4py import MPI

from ..comm.mesh import AXES, coordinates
from ..comm.retired import abandon
from ..comm.waits import Waits
from ..validate import check_number
from .arrivals import Arrivals
from .flight import dump_all, note_arrivals, note_peer_wait
from .guard import Guard, not_running, not_running_part, thread_multiple

DEFAULT_TIMEOUT = 600.0
YIELD = 0.1           # seconds of yielding polls before the polls sleep
BURST = 32            # yielding polls between two clock reads (a clock read per poll slows
                      # the peers that share this rank's core)
MIN_SLEEP = 2e-5      # the shortest sleep between two polls
MAX_SLEEP = 1e-2      # the longest sleep between two polls


def late_text(late, entered, silent, **_) -> str:
    """What the arrival counters say of the other members of a collective that timed out:
    the late ones, or in words why none can be named."""
    if late:
        return (f"{late} (not yet in this collective)"
                + (f"; ranks {silent} did not answer" if silent else ""))
    if silent:
        return (f"unknown: ranks {silent} did not answer (their counters could not be read)"
                + (f"; ranks {entered} entered this collective" if entered else ""))
    return (f"none: every other member ({entered}) entered this collective too, so one "
            "stopped or hung inside it (or the network failed); the arrival counters cannot "
            "tell which")


class CollectiveTimeout(RuntimeError):
    """A collective or a receive waited longer than the engine's timeout."""


class Watchdog(Waits):
    """Bounded waits for one engine's Comm (shared by its group views). A polled timeout
    leaves its requests to comm/retired.py's `abandon` (MPI may still complete them)."""

    def __init__(self, mesh, timeout=DEFAULT_TIMEOUT):
        super().__init__()
        self.timeout = check_number("timeout", timeout, low=0)
        self.timeout_ns = int(self.timeout * 1e9)   # the guard's deadline (guard.py)
        self.mesh = mesh
        self.groups: dict = {}                # communicator handle -> Watchdog.group
        self.tracer = None                    # a health.trace.Tracer while tracing: wait times
        self.returned = False                 # the arrival block was given back (close)
        self.stopped_s = 0.0                  # of the last polled wait that timed out: the
                                              # seconds this process was not running
        self.arrivals = Arrivals.of(mesh.world) if self.timeout else None
        self.cells = self.arrivals.cells if self.timeout else None     # its counters
        self.base = self.arrivals.take_block() if self.timeout else 0
        # blocking collectives under the guard's deadline (guard.py), else polled
        self.guard = Guard.shared(self.timeout) if self.timeout and thread_multiple() else None
        active = mesh.layout.active_axes
        for subset in range(1 << len(active)) if self.timeout else ():
            # every group's communicator now: MPI_Comm_split later, mid-step, is unbounded
            mesh.comm(tuple(a for i, a in enumerate(active) if subset >> i & 1))

    def close(self, why: str, give_back: bool = True) -> None:
        """Refuse every later call with CommUnusable(`why`). `give_back`: this is a close on
        every rank (engine.close()), so the arrival block goes back for the next engine; a
        rank that closes alone (its own timeout, an exception leaving a `with` block) keeps it,
        or the ranks' next engines would count in different blocks."""
        if give_back and not self.returned and self.arrivals is not None:
            self.arrivals.give_back(self.base)
            self.returned = True
        super().close(why)

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
        """Count this rank into its next collective on `comm`: its ticket (counter, count),
        or None without a timeout."""
        self.check_usable()
        if not self.timeout:
            return None
        index = self.group(comm)[0]
        cells = self.cells
        cells[index] += 1
        return index, cells[index]

    # -- blocking collectives ------------------------------------------------------------------
    def run(self, blocking, nonblocking, args, what: str, comm):
        """One collective, bounded: `blocking(*args)` (comm.Allreduce, ...) under the guard's
        deadline, or where the guard cannot run, `nonblocking(*args)` polled. Without a
        timeout, the blocking call alone. Returns what `blocking` returns (None polled)."""
        if self.guard is None:
            if not self.timeout:
                self.check_usable()
                return blocking(*args)
            self.wait_collective([nonblocking(*args)], what, comm)
            return None
        if self.tracer is not None:
            return self.traced(self.call_with_deadline, comm, blocking, args, what, comm)
        return self.call_with_deadline(blocking, args, what, comm)

    def call_with_deadline(self, blocking, args, what: str, comm, ticket=None):
        """`blocking(*args)` with the guard's deadline set for its duration. `ticket`: the
        collective was counted in at issue (arrive); else it is counted in here."""
        if ticket is None:
            ticket = self.arrive(comm)
        else:
            self.check_usable()
        guard = self.guard
        guard.in_flight = (time.monotonic_ns(), self.timeout_ns, self.message, (what, comm, ticket))
        try:
            return blocking(*args)
        finally:                  # an MPI error raised here must not time out later
            guard.in_flight = None

    def wait_for_requests(self, requests, what: str, comm, ticket=None) -> None:
        """Wait for the point-to-point requests of a collective built from messages
        (reduce_scatter, all_to_all_v): MPI's own Waitall under the guard's deadline, like a
        blocking collective, or polled below MPI_THREAD_MULTIPLE. `ticket`: counted in at
        issue (then the caller traces the wait itself)."""
        if self.guard is None:
            if ticket is None:
                self.wait_collective(requests, what, comm)
            else:
                self._poll_collective(requests, what, comm, ticket)
        elif ticket is None:
            self.run(MPI.Request.Waitall, None, (requests,), what, comm)
        else:
            self.call_with_deadline(MPI.Request.Waitall, (requests,), what, comm, ticket)

    # -- polled waits --------------------------------------------------------------------------
    def wait_collective(self, requests, what: str, comm, ticket=None) -> None:
        """Wait for a collective's requests; `ticket` from `arrive` when it was counted at
        issue (the non-blocking calls), else it is counted now."""
        if self.tracer is not None:
            self.traced(self._poll_collective, comm, requests, what, comm, ticket)
        else:
            self._poll_collective(requests, what, comm, ticket)

    def _poll_collective(self, requests, what: str, comm, ticket=None) -> None:
        if ticket is None:
            ticket = self.arrive(comm)
        else:
            self.check_usable()
        if not self.timeout:
            MPI.Request.Waitall(requests)
        elif not self.poll(requests):
            self.timed_out(what, comm, self.late(comm, ticket), requests)

    def wait_peer(self, requests, what: str, comm, rank: int) -> None:
        """Wait for a send or receive with rank `rank` of `comm`; the time it blocked counts
        into the flight recorder's peer waits (flight.note_peer_wait: stragglers.py)."""
        self._peer_wait(self._poll_peer, comm, requests, what, comm, rank)

    def _peer_wait(self, wait, comm, *args):
        """`wait(*args)`, a wait for one peer of `comm`: traced, and counted into the flight
        recorder's peer waits (flight.note_peer_wait: stragglers.py); returns what it does."""
        t0 = time.perf_counter()
        try:
            if self.tracer is not None:
                return self.traced(wait, comm, *args)
            return wait(*args)
        finally:
            note_peer_wait(time.perf_counter() - t0)

    def peer_text(self, comm, rank: int) -> str:
        """Group rank `rank` of `comm` as a peer's timeout names it: its world rank."""
        ranks = self.group(comm)[1]
        return f"[{ranks[rank] if 0 <= rank < len(ranks) else rank}] (the peer)"

    def _poll_peer(self, requests, what: str, comm, rank: int) -> None:
        self.check_usable()
        if not self.timeout:
            MPI.Request.Waitall(requests)
        elif not self.poll(requests):
            self.timed_out(what, comm, self.peer_text(comm, rank), requests)

    def wait_until(self, test, what: str, comm, ticket) -> None:
        """Poll `test()` (e.g. matched probes: comm/alltoallv.py) until it returns True, at
        most the timeout; then CollectiveTimeout naming the members of `comm` that have not
        arrived (`ticket` from `arrive`). Without a timeout: Waits' unbounded poll."""
        if not self.timeout:
            return super().wait_until(test, what, comm, ticket)
        self.check_usable()
        if not self.poll_until(test):
            self.timed_out(what, comm, self.late(comm, ticket), [])

    def poll_peer_until(self, test, comm) -> bool:
        """Poll `test()` (a message with one peer of `comm` arriving: an NCCL receive's header,
        comm/nccl.py) at most the timeout: False once it passed (the caller names the peer).
        The time it blocked counts into the peer waits, as wait_peer's does."""
        if not self.timeout:
            return super().poll_peer_until(test, comm)
        self.check_usable()
        return self._peer_wait(self.poll_until, comm, test)

    def traced(self, wait, comm, *args):
        """Run `wait(*args)` and tell the tracer how long it blocked, on which group; returns
        what `wait` returns."""
        t0 = time.perf_counter()
        result = wait(*args)
        self.tracer.blocked(self.group(comm)[2], time.perf_counter() - t0)
        return result

    def poll(self, requests) -> bool:
        """Test `requests` until done (True) or the timeout passes (False). One request is
        tested with its own `Test`, cheaper than `Testall`: a poll is paid on every turn."""
        if len(requests) == 1:
            return self.poll_until(requests[0].Test)
        return self.poll_until(lambda: MPI.Request.Testall(requests))

    def poll_until(self, test) -> bool:
        """Call `test()` until it returns True (True) or the timeout passes (False): yielding
        the core between polls for the first YIELD seconds, then sleeping between them."""
        if test():
            return True
        t0, limit = time.monotonic(), min(YIELD, self.timeout)
        self.stopped_s = 0.0
        if self.yield_until(test, t0, limit):
            return True
        # not waited on the peers (guard.py FROZEN): the yielding polls' overrun past `limit`
        # (once per wait: a stop there, or slow tests, since the clock is read per BURST) and
        # each sleep's overrun (a stop or starvation; never a test's own time)
        stopped = not_running_part(time.monotonic() - t0 - limit)
        while True:
            waited = time.monotonic() - t0 - stopped
            if waited > self.timeout:
                self.stopped_s = stopped
                return False
            nap = min(MAX_SLEEP, max(MIN_SLEEP, 0.05 * waited))
            before = time.monotonic()
            time.sleep(nap)
            stopped += not_running_part(time.monotonic() - before - nap)
            if test():
                return True

    @staticmethod
    def yield_until(test, t0: float, limit: float) -> bool:
        """Poll `test()`, yielding the core between polls, until it is True (True) or `limit`
        seconds since `t0` passed (False); the clock is read once per BURST polls."""
        yield_, clock = os.sched_yield, time.monotonic
        while clock() - t0 <= limit:
            for _ in range(BURST):
                yield_()
                if test():
                    return True
        return False

    # -- timeouts ------------------------------------------------------------------------------
    def message(self, what: str, comm, ticket) -> str:
        """The timeout's text for the collective of `ticket` (on the guard's thread)."""
        return self.describe(what, comm, self.late(comm, ticket))

    def late(self, comm, ticket) -> str:
        """The members whose counter is below this rank's `ticket`, as text (the reads share
        one deadline: arrivals.py); the counts go to the flight recorder's next dump too."""
        index, mine = ticket
        _, members, name = self.group(comm)
        ranks = [r for r in members if r != self.mesh.rank]
        counts = self.arrivals.read(ranks, index)
        found = {"group": name, "ranks": list(members),
                 "late": [r for r, c in zip(ranks, counts) if c is not None and c < mine],
                 "entered": [r for r, c in zip(ranks, counts) if c is not None and c >= mine],
                 "silent": [r for r, c in zip(ranks, counts) if c is None]}
        note_arrivals(found)
        return late_text(**found)

    def timed_out(self, what: str, comm, late: str, requests) -> None:
        """A polled wait gave up: cancel the receives among `requests`, keep them all (MPI
        may still complete them), refuse every later call, raise CollectiveTimeout."""
        message = self.describe(what, comm, late) + not_running(self.stopped_s)
        for req in requests:
            if not req.Test():
                if what == "receive":
                    req.Cancel()
                abandon([req])
        self.close(f"this engine timed out earlier ({what} on group {self.group(comm)[2]}); "
                   "its communicators may still have operations pending: build a new engine",
                   give_back=False)
        self.mesh.keep()                      # never freed: a late message may still come
        for holder in self.keep_on_timeout:   # all_to_all_v's duplicates (Comm)
            holder.keep()
        dump_all(f"CollectiveTimeout: {message}")       # the flight recorder (flight.py)
        raise CollectiveTimeout(message)

    def describe(self, what, comm, late) -> str:
        """The text of a timeout of `what` on `comm`, `late` naming the late ranks."""
        _, ranks, name = self.group(comm)
        where = "".join(f", {k} {v}" for k, v in self.where.items() if v is not None)
        return (f"{what} on group {name} (ranks {ranks}) timed out after "
                f"{self.timeout:g} s on rank {self.mesh.rank}{where}: late ranks: {late}; "
                f"set make_engine(timeout=) or --timeout (0: off)")

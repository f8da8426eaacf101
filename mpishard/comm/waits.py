"""Waits without a bound: how a Comm waits when it is built without a watchdog.

Every wait of the Comm and its mixins goes through its `watchdog`: a blocking collective
(`run`), the requests of a collective made of messages (`wait_for_requests`), a collective's or
a peer's requests (`wait_collective`, `wait_peer`, a Future's `waiter`), a polled condition
(`wait_until`), and `arrive` counts the rank into a non-blocking collective when it is issued.
`Waits` is that interface with no bound: the blocking MPI call itself, MPI's Waitall, a poll
that yields the core. health/watchdog.py's Watchdog bounds each wait by the engine's timeout
and names the late ranks; the engine passes one in. After `close` every call raises
CommUnusable.
"""
from __future__ import annotations

import os

from mpi4py import MPI

from .mesh import CommUnusable


class Waits:
    """Unbounded waits for one Comm (shared by its group views)."""

    timeout = 0              # seconds a wait may take; 0: no bound
    guard = None             # the thread that bounds blocking calls (health/guard.py): none
    tracer = None            # what hears the blocked time (health/trace.py): none

    def __init__(self):
        self.where: dict = {}                 # step, microbatch: set by Comm.context
        self.unusable = None                  # why later calls are refused (CommUnusable)
        self.keep_on_timeout: list = []       # kept alive after a timeout (Comm.__init__)

    def close(self, why: str, give_back: bool = True) -> None:
        """Refuse every later call with CommUnusable(`why`)."""
        self.unusable = self.unusable or why

    def check_usable(self) -> None:
        """Raise CommUnusable after close() (or a watchdog's timeout)."""
        if self.unusable is not None:
            raise CommUnusable(self.unusable)

    def arrive(self, comm):
        """Count this rank into a collective on `comm` as it is issued: its ticket (None)."""
        self.check_usable()
        return None

    def run(self, blocking, nonblocking, args, what: str, comm):
        """One collective: `blocking(*args)` (comm.Allreduce, ...); returns what it returns."""
        self.check_usable()
        return blocking(*args)

    def wait_collective(self, requests, what: str, comm, ticket=None) -> None:
        """Wait for a collective's requests (`ticket` from `arrive`)."""
        self.check_usable()
        MPI.Request.Waitall(requests)

    wait_for_requests = wait_collective       # the messages of reduce_scatter, all_to_all_v

    def wait_peer(self, requests, what: str, comm, rank: int) -> None:
        """Wait for a send or receive with rank `rank` of `comm`."""
        self.check_usable()
        MPI.Request.Waitall(requests)

    def waiter(self, what: str, comm, ticket=None, rank=None):
        """A Future's wait: the collective's (counted in at issue) or the peer's."""
        if rank is not None:
            return lambda requests: self.wait_peer(requests, what, comm, rank)
        return lambda requests: self.wait_collective(requests, what, comm, ticket)

    def wait_until(self, test, what: str, comm, ticket) -> None:
        """Poll `test()` (e.g. matched probes: alltoallv.py) until it returns True, yielding
        the core between polls (MPICH's blocking Mprobe was slower)."""
        self.check_usable()
        while not test():
            os.sched_yield()

    def poll_peer_until(self, test, comm) -> bool:
        """Poll `test()` (a message with one peer of `comm` arriving: an NCCL receive's header,
        nccl.py) until it returns True, as wait_until; True."""
        self.wait_until(test, "receive", comm, None)
        return True

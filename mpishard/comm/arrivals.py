"""Arrival counters: which ranks have entered a collective, found without the stalled rank's help.

Entering a collective, a rank bumps its own counter for the group's set of active mesh axes
(one of SLOTS counters per engine) and stamps the time it arrived: plain stores into its own
window memory, no MPI call. A peer whose count is below this rank's has not entered this
collective yet. The counters live in an MPI-3 RMA window (`Arrivals`, one per set of ranks
engines are built on), read two ways:

- `read`: passive-target `Rget` under a `Lock_all` epoch held for the window's life, on any
  number of nodes. With MPICH (ch4) on one node the window is shared memory, so the read needs
  no progress on the stalled rank; a read that does not complete within READ_TIMEOUT reports
  that rank as not answering. Used to name the late ranks when a wait times out.
- `peers`: when every rank is on one node the window is allocated as shared memory
  (`Allocate_shared`) and every rank's counters are a memoryview here too, read with a plain
  load (0.1 us): the watchdog's gate reads them on every blocking collective of an
  oversubscribed node (watchdog.py `guarded`). Caches are coherent on the CPUs MPI runs on; a
  store not yet visible only delays the gate by one poll.

Each counter has a ring of RING time stamps (monotonic ns, one per call, at STAMPS + counter
* RING + count % RING), written by the gate before the count: after a blocking collective a
rank reads how late the last member arrived at that same call, which a peer overwrites only
RING calls later (it cannot complete those without this rank).
"""
from __future__ import annotations

import atexit
import sys
import time

import numpy as np
from mpi4py import MPI

from .mesh import AXES

SLOTS = 1 << len(AXES)     # one counter per set of mesh axes (bit i: AXES[i])
BLOCKS = 256               # engines sharing one window (a block of SLOTS counters each)
RING = 4                   # arrival stamps kept per counter
STAMPS = BLOCKS * SLOTS    # where the stamps start: counter i's ring at STAMPS + i * RING
READ_TIMEOUT = 1.0


def _zeros(n: int) -> memoryview:
    """n int64 zeros, to store into a slice of Arrivals.cells."""
    return memoryview(bytes(8 * n)).cast("q")


def _one_node(comm) -> bool:
    """Whether every rank of `comm` shares memory with every other (collective)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return comm.allreduce(node.Get_size(), op=MPI.MIN) == comm.Get_size()
    finally:
        node.Free()


class Arrivals:
    """Arrival counters and stamps of the ranks of one communicator (module docstring).

    Created collectively by the first Comm with a timeout on a communicator of these ranks;
    each later Comm takes the next block of SLOTS counters (engines are built collectively, in
    the same order on every rank). Freed collectively at exit, before MPI_Finalize, unless the
    process ends on an uncaught exception or after a timeout (a peer may never come to free
    it; the job is being aborted anyway).
    """

    SHARED: dict = {}     # members (COMM_WORLD ranks, in rank order) -> their Arrivals

    def __init__(self, comm):
        self.comm = comm
        size = BLOCKS * SLOTS * (1 + RING) * 8           # counters, then their stamp rings
        if _one_node(comm):
            self.win = MPI.Win.Allocate_shared(size, 8, comm=comm)
            self.peers = [self._view(self.win.Shared_query(r)[0])
                          for r in range(comm.Get_size())]
        else:
            self.win = MPI.Win.Allocate(size, 8, comm=comm)
            self.peers = None                            # no plain loads across nodes
        # the counters as a memoryview: a Python int store (0.26 us) instead of numpy's
        # scalar += (0.63 us), on every call
        self.cells = self._view(self.win.tomemory())
        self.cells[:] = _zeros(len(self.cells))
        self.win.Lock_all()
        self.blocks = 0
        self.broken = False                   # a timeout happened: never free collectively
        atexit.register(self.free)

    @staticmethod
    def _view(buffer) -> memoryview:
        return memoryview(buffer).cast("B").cast("q")

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
        """The offset of a fresh block of SLOTS counters, zeroed (and their stamps)."""
        base = (self.blocks % BLOCKS) * SLOTS
        self.blocks += 1
        self.cells[base:base + SLOTS] = _zeros(SLOTS)
        first = STAMPS + base * RING
        self.cells[first:first + SLOTS * RING] = _zeros(SLOTS * RING)
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
            for view in [self.cells] + (self.peers or []):
                view.release()
            self.win.Unlock_all()
            self.win.Free()
        self.win = None

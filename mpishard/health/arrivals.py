"""Arrival counters: which ranks have entered a collective, found without the stalled rank's help.

Entering a collective, a rank bumps its own counter for the group's set of active mesh axes
(one of SLOTS counters per engine): a plain store into its own window memory, no MPI call. A
peer whose count is below this rank's has not entered this collective yet.

The counters live in an MPI-3 RMA window, one per set of ranks engines are built on; each
engine takes a block of SLOTS counters and gives it back when it is closed. On a timeout the
waiting rank reads its peers' counters with passive-target `Rget` under a `Lock_all` epoch held
for the window's life: every read is issued at once and they are waited for together, until
one deadline (READ_TIMEOUT), so the report is late by at most that, whatever the group size.
A peer whose read has not completed by then is reported as not answering. On one node the
window is shared memory (`Allocate_shared`), which MPICH reads without the peer's help; across
nodes a peer busy outside MPI may not answer in time.
"""
from __future__ import annotations

import atexit
import logging
import sys
import time

import numpy as np
from mpi4py import MPI

from ..comm.mesh import AXES

SLOTS = 1 << len(AXES)     # one counter per set of mesh axes (bit i: AXES[i])
BLOCKS = 256               # engines open at once on one window (a block of SLOTS counters each)
READ_TIMEOUT = 1.0         # seconds all the reads of one report may take together

# Rget requests a deadline gave up on: MPI may still write their result, so their buffers
# stay referenced (mpi4py keeps a request's buffer alive with the request) for the process's life.
_UNANSWERED: list = []


def _one_node(comm) -> bool:
    """Whether every rank of `comm` shares memory with every other (collective)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return comm.allreduce(node.Get_size(), op=MPI.MIN) == comm.Get_size()
    finally:
        node.Free()


class Arrivals:
    """The arrival counters of the ranks of one communicator (module docstring).

    Created collectively by the first Comm with a timeout on a communicator of these ranks.
    Blocks are taken and given back in the same order on every rank (engines are built and
    closed collectively), so a block has the same offset everywhere. Freed at exit, before
    MPI_Finalize (collective), unless the process ends on an uncaught exception.
    """

    SHARED: dict = {}     # members (COMM_WORLD ranks, in rank order) -> their Arrivals

    def __init__(self, comm):
        size = BLOCKS * SLOTS * 8
        allocate = MPI.Win.Allocate_shared if _one_node(comm) else MPI.Win.Allocate
        self.win = allocate(size, 8, comm=comm)
        # a memoryview: a Python int store per call, cheaper than numpy's scalar +=
        self.cells = memoryview(self.win.tomemory()).cast("B").cast("q")
        self.cells[:] = memoryview(bytes(size)).cast("q")
        self.win.Lock_all()
        self.next_block = 0
        self.given_back: list = []            # offsets of blocks closed engines returned
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
        """The offset of a block of SLOTS zeroed counters: one given back, else the next one
        (past BLOCKS engines never closed, the oldest block is taken again)."""
        if self.given_back:
            base = self.given_back.pop()
        else:
            base = (self.next_block % BLOCKS) * SLOTS
            self.next_block += 1
            if self.next_block == BLOCKS + 1:
                logging.getLogger("mpishard").warning(
                    "more than %d engines were built and not closed: their arrival counters "
                    "are shared from now on, so a timeout may name the wrong late ranks "
                    "(close engines you are done with: engine.close() or `with`)", BLOCKS)
        self.cells[base:base + SLOTS] = memoryview(bytes(8 * SLOTS)).cast("q")
        return base

    def give_back(self, base: int) -> None:
        """A closed engine's block, to be taken by the next engine."""
        self.given_back.append(base)

    def read(self, ranks, index: int) -> list:
        """Counter `index` of each of `ranks`: all the reads issued at once, then waited for
        together for at most READ_TIMEOUT seconds; None for a rank whose read did not complete."""
        self.win.Sync()
        out = np.zeros(len(ranks), dtype=np.int64)
        requests = [self.win.Rget(out[i:i + 1], rank, target=(index, 1, MPI.INT64_T))
                    for i, rank in enumerate(ranks)]
        done = [False] * len(ranks)
        end = time.monotonic() + READ_TIMEOUT
        while True:
            for i, req in enumerate(requests):
                if not done[i]:
                    done[i] = req.Test()
            if all(done) or time.monotonic() > end:
                break
            time.sleep(1e-3)
        _UNANSWERED.extend(req for req, ok in zip(requests, done) if not ok)
        return [int(out[i]) if ok else None for i, ok in enumerate(done)]

    def free(self) -> None:
        """Collective: unlock and free the window (at exit, before MPI_Finalize)."""
        failed = getattr(sys, "last_value", None) is not None
        if self.win is not None and not failed and not MPI.Is_finalized():
            self.cells.release()
            self.win.Unlock_all()
            self.win.Free()
        self.win = None

"""The fallback for engines never closed: their communicators are freed later, at a safe point.

`engine.close()` (or `with make_engine(...) as engine:`) frees an engine's communicators
plainly. An engine dropped without it still holds some, and MPI has only a few thousand
communicator ids per process, so a program that builds engine after engine would run out. Its
finalizer (`__del__`) cannot free them: it runs whenever the garbage collector does, also
inside mpi4py while that holds the lock of its communicator-lock table, where MPI_Comm_free
(through mpi4py's attribute-delete callback) takes the same lock and hangs for good.

So a finalizer only `retire`s its communicators (a list append: no MPI call, no lock), and
`free_retired()` frees them from plain code where no MPI call is in progress: before a mesh
splits new communicators or a new duplicate is made (MPI_Comm_free is local: the ranks may
free theirs at different times). What is still retired at MPI_Finalize is MPI's to reclaim.

Requests given up on (a timeout, a rank leaving on an exception) are kept the same way
(`abandon`): MPI may still complete them and write into their buffers.
"""
from __future__ import annotations

from mpi4py import MPI

_RETIRED: list = []
_NEVER_FREED: list = []
_ABANDONED: list = []


def abandon(pending) -> None:
    """Keep requests (or Futures, which hold their buffers) that were given up on alive for
    the process's life: MPI may still complete them and write into their buffers."""
    _ABANDONED.extend(pending)


def keep_forever(comms) -> None:
    """Keep communicators that a message may still arrive on (a send or receive given up on,
    a peer's message never received) for the process's life: freed, their context id could
    go to a later communicator, whose receive would take that message instead."""
    _NEVER_FREED.extend(comms)


def retire(comms, _retired=_RETIRED) -> None:
    """Hand communicators over to be freed by the next `free_retired()` (safe in __del__, even
    at interpreter exit, when module globals may already be None: hence the bound list)."""
    _retired.extend(comms)


def free_retired() -> int:
    """Free every retired communicator (not from a finalizer); returns how many."""
    if MPI.Is_finalized():
        _RETIRED.clear()
        return 0
    freed = 0
    while _RETIRED:
        _RETIRED.pop().Free()        # pop is atomic: a finalizer may retire more meanwhile
        freed += 1
    return freed

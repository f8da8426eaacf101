"""Communicators that finalizers give up, freed later at a safe point.

A finalizer (`__del__`) runs whenever the garbage collector does, at any allocation: also
inside mpi4py while it holds the lock of its communicator-lock table (`PyMPI_Lock` allocates
a `Lock` for a lowercase collective such as `comm.allgather`). MPI_Comm_free there calls
mpi4py's attribute-delete callback (`commlock_free_fn`), which takes that same lock: the rank
hangs for good in Comm_free while its peers wait in the collective. Seen in CI at 4 ranks:
rank 0 stuck in `commlock_free_fn` under `Comm.allgather` -> gc -> DeviceMesh.__del__, ranks
1-3 spinning in MPI_Allgather.

So a finalizer only `retire`s its communicators (a list append: no MPI call, no lock), and
`free_retired()` frees them from plain code where no MPI call is in progress: before a mesh
splits new communicators or a new duplicate is made (MPI_Comm_free is local: the ranks may
free theirs at different times). What is still retired at MPI_Finalize is MPI's to reclaim.

The list is the process's, like the MPI library's own communicator table it stands for.
"""
from __future__ import annotations

from mpi4py import MPI

_RETIRED: list = []


def retire(comms) -> None:
    """Hand communicators over to be freed by the next `free_retired()` (safe in __del__)."""
    _RETIRED.extend(comms)


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

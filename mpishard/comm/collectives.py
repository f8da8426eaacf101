"""Collectives on one mpi4py communicator, and `agree`: the same error on every rank.

(The Comm class is being moved here from engine.py.)
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI


def agree(comm, error, exc=ValueError) -> None:
    """Collective over the mpi4py communicator `comm`: `error` is None on a rank that is fine,
    else a message; if any rank has one, every rank raises `exc` with the first failing rank's
    message, so no rank is left waiting alone in a later collective.

    One Allreduce of a flag when every rank is fine; the messages travel (pickled, small
    control data) only when one is not.
    """
    flag = np.array([0 if error is None else 1], dtype=np.int64)
    total = np.empty(1, dtype=np.int64)
    comm.Allreduce(flag, total, op=MPI.SUM)
    if total[0]:
        msgs = comm.allgather(None if error is None else str(error))
        raise exc(next(m for m in msgs if m is not None))

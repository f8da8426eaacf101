"""Debug mode's signature check: the group compares what each rank is about to call; `agree`,
the one "same error on every rank" helper.

Called before any check that depends on this rank's array (dtype, axis range, divisibility),
so such a mistake on one rank is reported on every rank, not raised on that rank alone while
the others wait in the collective.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .p2p import DTYPES

OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
         "all_to_all_v"]
_DIMS = 10


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group called a collective with different op, dtype or shape."""


def signature(kind, a, op="", axis=0, skip_axis=False) -> np.ndarray:
    """(kind, op, dtype, axis, shape...) as int64 words; `a=None`: no array (broadcast)."""
    shape = list(a.shape) if a is not None else []
    if -len(shape) <= axis < len(shape):
        axis %= len(shape)
    if skip_axis and 0 <= axis < len(shape):
        shape[axis] = -1  # all_gather may concatenate uneven lengths along `axis`
    sig = np.full(4 + _DIMS, -2, dtype=np.int64)
    sig[0] = KINDS.index(kind)
    sig[1] = list(OPS).index(op) if op in OPS else -1
    if a is not None:   # unsupported dtypes as -1 - ord(char): named, raised after the check
        sig[2] = DTYPES.index(a.dtype) if a.dtype in DTYPES else -1 - ord(a.dtype.char)
    sig[3] = axis
    sig[4:4 + min(_DIMS, len(shape))] = shape[:_DIMS]
    sig[4 + len(shape):] = -3
    return sig


def describe(sig) -> str:
    """One rank's signature in words."""
    dims = [int(d) for d in sig[4:] if d != -3]
    dtype = (DTYPES[sig[2]] if sig[2] >= 0 else "-" if sig[2] == -2
             else f"unsupported {np.dtype(chr(-1 - sig[2]))}")
    kind = KINDS[sig[0]]
    return (f"{kind}(op={list(OPS)[sig[1]] if sig[1] >= 0 else '-'}, dtype={dtype}, "
            f"shape={tuple(dims)}, {'root' if kind == 'broadcast' else 'axis'}={sig[3]})")


def check_signature(comm, kind, a, op="", axis=0, skip_axis=False, wait=None) -> None:
    """Collective over the mpi4py `comm`: every rank compares (kind, op, dtype, shape, axis)
    and raises CollectiveMismatchError on every rank if they differ. `wait`: how to wait for
    the Iallgather (the watchdog's bounded wait; default MPI Wait)."""
    sig = signature(kind, a, op, axis, skip_axis)
    allsig = np.empty((comm.Get_size(), sig.size), dtype=np.int64)
    (wait or MPI.Request.Wait)(comm.Iallgather(sig, allsig))
    if (allsig != allsig[0]).any():
        ranks = "; ".join(f"group rank {r}: {describe(s)}" for r, s in enumerate(allsig))
        raise CollectiveMismatchError(f"collective mismatch in {kind}: {ranks}")


def agree(comm, error, exc=ValueError, wait=None) -> None:
    """Collective over the mpi4py communicator `comm`: `error` is None on a rank that is fine,
    else a message; if any rank has one, every rank raises `exc` with the first failing rank's
    message, so no rank is left waiting alone in a later collective.

    One Allreduce of a flag when every rank is fine; the messages travel (their lengths, then
    their UTF-8 bytes) only when one is not. `wait`: how to wait for each request (a watchdog,
    so every round is bounded).
    """
    wait = wait or MPI.Request.Wait
    flag = np.array([0 if error is None else 1], dtype=np.int64)
    total = np.empty(1, dtype=np.int64)
    wait(comm.Iallreduce(flag, total, op=MPI.SUM))
    if total[0]:
        mine = np.frombuffer(b"" if error is None else str(error).encode(), dtype=np.uint8)
        lengths = np.empty(comm.Get_size(), dtype=np.int64)
        wait(comm.Iallgather(np.array([mine.size], dtype=np.int64), lengths))
        counts = lengths.tolist()
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1])).tolist()
        text = np.empty(sum(counts), dtype=np.uint8)
        wait(comm.Iallgatherv([mine, MPI.BYTE], [text, counts, starts, MPI.BYTE]))
        msgs = [bytes(text[a:a + n]).decode() for a, n in zip(starts, counts) if n]
        raise exc(msgs[0] if msgs else "a rank failed without a message")

"""Small control data between ranks (JSON bytes), every wait bounded by the engine's watchdog.

    agree(comm, error, exc=CheckpointError, what="checkpoint save")
    everything = gather_json(comm, mine, "checkpoint save")      # a list on rank 0, else None
    mine = scatter_json(comm, per_rank, "checkpoint save")       # per_rank: a list on rank 0
    same = broadcast_json(comm, obj, "serve step")               # rank 0's obj everywhere

`comm` is an engine's Comm (`engine.comm`): its whole group takes part. The checkpoint code
exchanges names, regions, file hashes and error messages this way. mpi4py's lowercase calls
(`gather`, `scatter`) would pickle them and wait without a deadline; here each exchange is
the uppercase non-blocking calls, lengths first and then the bytes, and each request is waited
by the watchdog's polled wait: past the engine's timeout it raises CollectiveTimeout naming
the ranks that have not arrived (health/watchdog.py). Arrays never travel here.

`agree_mpi` is the same check over a plain mpi4py communicator, waited by a function given
(the Comm's debug mode and `Comm.agree` pass their watchdog's wait; the CLI's usage check none).
"""
from __future__ import annotations

import json

import numpy as np
from mpi4py import MPI


def agree_mpi(comm, error, exc=ValueError, wait=None) -> None:
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


def wait(comm, request, what: str) -> None:
    """Wait for `request`, a non-blocking collective on `comm.mpi`, at most the timeout."""
    comm.watchdog.wait_collective([request], what, comm.mpi)


def agree(comm, error, exc=ValueError, what: str = "agree") -> None:
    """Collective: `error` is None where this rank is fine, else a message; when any rank has
    one, every rank raises `exc` with the first failing rank's message (agree_mpi)."""
    agree_mpi(comm.mpi, error, exc, wait=lambda request: wait(comm, request, what))


def _plain(o):
    """json.dumps(default=): numpy scalars as Python numbers; anything else is refused."""
    if isinstance(o, np.generic):
        return o.item()
    raise TypeError(f"{type(o).__name__} is not control data (JSON)")


def _encode(obj) -> np.ndarray:
    return np.frombuffer(json.dumps(obj, default=_plain).encode(), dtype=np.uint8)


def _decode(data) -> object:
    return json.loads(bytes(data).decode())


def gather_json(comm, obj, what: str, root: int = 0):
    """Collective: every rank's JSON-able `obj` as a list on `root` (None elsewhere)."""
    mpi = comm.mpi
    rank, size = mpi.Get_rank(), mpi.Get_size()
    data = _encode(obj)
    counts = np.zeros(size, dtype=np.int64) if rank == root else None
    wait(comm, mpi.Igather(np.array([data.size], dtype=np.int64),
                           [counts, MPI.INT64_T] if rank == root else None, root), what)
    if rank != root:
        wait(comm, mpi.Igatherv([data, MPI.BYTE], None, root), what)
        return None
    received = np.empty(int(counts.sum()), dtype=np.uint8)
    wait(comm, mpi.Igatherv([data, MPI.BYTE], [received, counts, MPI.BYTE], root), what)
    ends = np.cumsum(counts)
    return [_decode(received[end - n:end]) for n, end in zip(counts, ends)]


def scatter_json(comm, objs, what: str, root: int = 0):
    """Collective: rank r receives `objs[r]` (a list of JSON-able values given on `root`)."""
    mpi = comm.mpi
    rank, size = mpi.Get_rank(), mpi.Get_size()
    count = np.zeros(1, dtype=np.int64)
    parts = counts = None
    if rank == root:
        assert len(objs) == size, f"{len(objs)} values for {size} ranks"
        parts = [_encode(o) for o in objs]
        counts = np.array([p.size for p in parts], dtype=np.int64)
    wait(comm, mpi.Iscatter([counts, MPI.INT64_T] if rank == root else None, count, root),
         what)
    received = np.empty(int(count[0]), dtype=np.uint8)
    send = [np.concatenate(parts), counts, MPI.BYTE] if rank == root else None
    wait(comm, mpi.Iscatterv(send, [received, MPI.BYTE], root), what)
    return _decode(received)


def broadcast_json(comm, obj, what: str, root: int = 0):
    """Collective: `root`'s JSON-able `obj` on every rank (its length, then its bytes)."""
    mpi = comm.mpi
    mine = mpi.Get_rank() == root
    data = _encode(obj) if mine else None
    count = np.array([data.size if mine else 0], dtype=np.int64)
    wait(comm, mpi.Ibcast([count, MPI.INT64_T], root), what)
    buf = data if mine else np.empty(int(count[0]), dtype=np.uint8)
    wait(comm, mpi.Ibcast([buf, MPI.BYTE], root), what)
    return obj if mine else _decode(buf)

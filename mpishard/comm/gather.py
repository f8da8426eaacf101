"""all_gather: the group's arrays concatenated along an axis, blocking and non-blocking.

    all_gather(axis)       forward  <->  reduce_scatter(axis)   backward

The blocking call may gather different lengths along the axis, so it takes two rounds: the
lengths (an Allgather of one int64 per rank), then the rows (Allgather, or Allgatherv when the
lengths differ). Under the guard (health/guard.py) both rounds run as one call with one deadline and
one arrival count. The result is a fresh array.
all_gather_async (FSDP's prefetch) needs equal shapes and exchanges no lengths.

`Gather` is a mixin of collectives.Comm: it uses the host's `_mpi`, `_check`, `_norm_axis`,
`_moved`, `_back`, `xp`, `backend`, `stats` and `watchdog`.
"""
from __future__ import annotations

import math
import time

import numpy as np

from .alltoallv import blocks, mpi_type
from .p2p import Future
from .recorded import recorded


def _plain(blocking, nonblocking, args, what, comm):
    """A collective's blocking call as it is (inside a call the guard already watches)."""
    return blocking(*args)


class Gather:
    """all_gather and all_gather_async (module docstring)."""

    def _gather_args(self, arr, axis, group, uneven=False):
        """(arr with `axis` moved first, contiguous; the axis normalised; communicator; group
        size) for all_gather(_async); a 0-d array gathers as shape (1,). `uneven`: lengths
        along `axis` may differ, so debug mode leaves them out of the comparison."""
        a = self.xp.asarray(arr)
        if a.ndim == 0:
            a = a.reshape(1)
        comm = self._mpi(group)
        self._check(comm, "all_gather", a, axis=axis, skip_axis=uneven)
        axis = self._norm_axis(a, axis)
        return self._moved(a, axis), axis, comm, comm.Get_size()

    @recorded
    def all_gather(self, arr, axis: int = 0, group=None):
        """Concatenate the group's arrays along `axis` (MPI Allgather / Allgatherv).

        Lengths along `axis` may differ between ranks (they are exchanged first); the other
        dimensions must agree. Adjoint: reduce_scatter(sum) along the same axis.
        """
        t0 = time.perf_counter()
        moved, axis, comm, n = self._gather_args(arr, axis, group, uneven=True)  # (len_i, ...)
        if self.watchdog.guard is not None:     # both rounds as one call under the guard:
            out = self.watchdog.run(self._gathered, None, (moved, comm, n, _plain),
                                    "all_gather", comm)     # one deadline, counted once
        else:                                   # each round bounded on its own
            out = self._gathered(moved, comm, n, self.watchdog.run)
        self.stats.count("all_gather", (n - 1) / n * out.nbytes, t0)
        return self._back(out, axis)

    def _gathered(self, moved, comm, n, run):
        """all_gather's two rounds, each a collective made by `run(blocking, nonblocking, args,
        what, comm)`: the lengths along the axis, then the rows (Allgather when the lengths
        are equal, else Allgatherv). Returns the gathered (sum of lengths, ...) array."""
        dtype, backend = moved.dtype, self.backend
        length, rest = moved.shape[0], moved.shape[1:]
        lengths = np.empty(n, np.int64)
        run(comm.Allgather, comm.Iallgather, (np.array([length], np.int64), lengths),
            "all_gather", comm)
        lens = lengths.tolist()
        out = self.xp.empty((sum(lens),) + rest, dtype=dtype)
        nccl = self._nccl(moved)
        if nccl is not None and lens.count(length) == n:     # NCCL's (nccl.py)
            nccl.all_gather(moved, out, comm, self.watchdog)
            return out
        sbuf = backend.mpi_buffer(moved)
        rbuf = backend.mpi_buffer(out, slot="recv", read=False)
        if lens.count(length) == n:
            run(comm.Allgather, comm.Iallgather, (sbuf, rbuf), "all_gather", comm)
        else:
            run(comm.Allgatherv, comm.Iallgatherv, (sbuf, [rbuf, *blocks(lens, math.prod(rest)),
                mpi_type(dtype)]), "all_gather", comm)
        backend.mpi_finish(rbuf, out)
        return out

    @recorded
    def all_gather_async(self, arr, axis: int = 0, group=None) -> Future:
        """Non-blocking all_gather (MPI Iallgather); `result()` waits and returns the array.

        Every rank must pass the same shape (equal lengths along `axis`: no lengths are
        exchanged; debug mode checks it); `arr` must not be modified until the Future
        completes, which keeps the send and receive buffers alive. FSDP's prefetch gathers the
        next layer's weight with it while the current layer computes. Adjoint:
        reduce_scatter(sum) along the same axis. Bytes are counted when the call is issued.
        """
        t0 = time.perf_counter()
        moved, axis, comm, n = self._gather_args(arr, axis, group)  # (len, ...rest), same on all
        out = self.xp.empty((n * moved.shape[0],) + moved.shape[1:], dtype=moved.dtype)
        nccl = self._nccl(moved)
        if nccl is not None:                    # on NCCL's side stream (nccl.py)
            pending = nccl.all_gather(moved, out, comm, self.watchdog, "all_gather_async",
                                      wait=False)
            self.stats.count("all_gather", (n - 1) / n * out.nbytes, t0)
            return Future([], lambda: self._back(out, axis), keep=(moved, out),
                          wait=lambda _: pending.wait(), test=lambda _: pending.done())
        sbuf = self.backend.mpi_buffer(moved, slot=None)    # this request's own staging
        rbuf = self.backend.mpi_buffer(out, slot=None, read=False)
        req, ticket = comm.Iallgather(sbuf, rbuf), self.watchdog.arrive(comm)

        def finish():
            self.backend.mpi_finish(rbuf, out)
            return self._back(out, axis)
        self.stats.count("all_gather", (n - 1) / n * out.nbytes, t0)
        return Future([req], finish, keep=(moved, sbuf, out, rbuf), wait=self.watchdog.waiter(
            "all_gather_async", comm, ticket), release=lambda: self.backend.release(sbuf, rbuf))

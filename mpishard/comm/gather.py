"""all_gather: the group's arrays concatenated along an axis, blocking and non-blocking.

    all_gather(axis)       forward  <->  reduce_scatter(axis)   backward

The blocking call may gather different lengths along the axis, so it takes two rounds: the
lengths (an Allgather of one int64 per rank, into buffers kept per group), then the rows
(Allgather, or Allgatherv when the lengths differ). Under the guard (guard.py) both rounds are
one guarded call: counted in, gated and watched once. Its result buffer for equal lengths is
taken before the first round, so that between the two rounds a rank only looks at the
lengths: at 4 ranks on 2 cores every microsecond a rank spends there delays its peers'
second round (measured, 1 MiB at 4 ranks: with the buffers made and the rows prepared
between the rounds 1.17-1.26x raw Allgather, after it 1.05-1.22x, median 1.14 over 3 trials;
raw Allgather after a raw lengths round 1.02-1.04x: the engine's Python is what is left).
all_gather_async (FSDP's prefetch) needs equal shapes and exchanges no lengths.

`Gather` is a mixin of collectives.Comm: it uses the host's `_mpi`, `_sized`, `_check`,
`_norm_axis`, `_moved`, `_back`, `host_array`, `pool`, `backend`, `stats`, `watchdog` and
`_lengths` (a dict).
"""
from __future__ import annotations

import math
import time

import numpy as np

from .alltoallv import blocks, mpi_type
from .p2p import Future, dtype_code


def _plain(blocking, nonblocking, args, what, comm):
    """A collective's blocking call as it is (inside a call the guard already watches)."""
    return blocking(*args)


class Gather:
    """all_gather and all_gather_async (module docstring)."""

    def _gather_args(self, arr, axis, group, uneven=False):
        """(arr with `axis` moved first, contiguous; the axis normalised; communicator; group
        size) for all_gather(_async); a 0-d array gathers as shape (1,). `uneven`: lengths
        along `axis` may differ, so debug mode leaves them out of the comparison."""
        if not axis and type(arr) is self.host_array and arr.ndim and arr.flags.c_contiguous:
            comm, n = self._sized(group)        # the usual call, as is (Comm._sized)
            if self.debug:
                self._check(comm, "all_gather", arr, skip_axis=uneven)
            dtype_code(arr.dtype)
            return arr, 0, comm, n
        a = self.xp.asarray(arr)
        if a.ndim == 0:
            a = a.reshape(1)
        comm = self._mpi(group)
        self._check(comm, "all_gather", a, axis=axis, skip_axis=uneven)
        axis = self._norm_axis(a, axis)
        return self._moved(a, axis), axis, comm, comm.Get_size()

    def all_gather(self, arr, axis: int = 0, group=None, pooled: bool = True):
        """Concatenate the group's arrays along `axis` (MPI Allgather / Allgatherv).

        Lengths along `axis` may differ between ranks (they are exchanged first); the other
        dimensions must agree. Adjoint: reduce_scatter(sum) along the same axis. The result
        comes from the pool (pool.py) unless `pooled=False` (FSDP's weights, really freed).
        """
        t0 = time.perf_counter()
        moved, axis, comm, n = self._gather_args(arr, axis, group, uneven=True)  # (len_i, ...)
        if self.watchdog.guard is not None:     # both rounds as one call under the guard:
            out = self.watchdog.run(self._gathered, None, (moved, comm, n, pooled, _plain),
                                    "all_gather", comm)     # counted and gated once
        else:                                   # each round bounded on its own
            out = self._gathered(moved, comm, n, pooled, self.watchdog.run)
        self.stats.count("all_gather", (n - 1) / n * out.nbytes, t0)
        return self._back(out, axis) if axis else out

    def _gathered(self, moved, comm, n, pooled, run):
        """all_gather's two rounds, each a collective made by `run(blocking, nonblocking, args,
        what, comm)`: the lengths along the axis, then the rows (Allgather when the lengths
        are equal, else Allgatherv; the equal case's buffers made before the first round:
        module docstring). Returns the gathered (sum of lengths, ...) array."""
        shape, dtype, backend = moved.shape, moved.dtype, self.backend
        length, rest = shape[0], shape[1:]
        shape = (n * length,) + rest
        out = self.pool.get(shape, dtype, moved, pooled)
        sbuf = backend.mpi_buffer(moved)
        rbuf = backend.mpi_buffer(out, slot="recv", read=False)
        try:                                    # this group's length buffers, made once
            mine, lengths = self._lengths[comm.py2f()]
        except KeyError:
            mine, lengths = self._lengths[comm.py2f()] = (np.empty(1, np.int64),
                                                          np.empty(n, np.int64))
        mine[0] = length
        run(comm.Allgather, comm.Iallgather, (mine, lengths), "all_gather", comm)
        lens = lengths.tolist()                 # plain ints: numpy on n numbers costs more
        if lens.count(length) == n:
            run(comm.Allgather, comm.Iallgather, (sbuf, rbuf), "all_gather", comm)
        else:
            shape = (sum(lens),) + rest
            out = self.pool.get(shape, dtype, moved, pooled)
            rbuf = backend.mpi_buffer(out, slot="recv", read=False)
            run(comm.Allgatherv, comm.Iallgatherv, (sbuf, [rbuf, *blocks(lens, math.prod(rest)),
                mpi_type(dtype)]), "all_gather", comm)
        backend.mpi_finish(rbuf, out)
        return out

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
        out = self.pool.new((n * moved.shape[0],) + moved.shape[1:], moved.dtype, moved)
        sbuf = self.backend.mpi_buffer(moved, slot=None)    # this request's own staging
        rbuf = self.backend.mpi_buffer(out, slot=None, read=False)
        req, ticket = comm.Iallgather(sbuf, rbuf), self.watchdog.arrive(comm)

        def finish():
            self.backend.mpi_finish(rbuf, out)
            return self._back(out, axis)
        self.stats.count("all_gather", (n - 1) / n * out.nbytes, t0)
        return Future([req], finish, keep=(moved, sbuf, out, rbuf), wait=self.watchdog.waiter(
            "all_gather_async", comm, ticket), release=lambda: self.backend.release(sbuf, rbuf))

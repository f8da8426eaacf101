"""reduce_scatter as one round of point-to-point messages and a local sum.

    reduce_scatter(axis)   forward  <->  all_gather(axis)       backward

The engine does the pairwise exchange of MPI's own long-message algorithm itself: block j of
the rows goes to rank j as one message, each rank receives its block from every peer into a
scratch buffer, then adds the n contributions in rank order (xp.add in place: rank 0's first,
the same order on every run). Under the guard (health/guard.py) the messages are waited by MPI's own
Waitall, bounded like a blocking collective; below MPI_THREAD_MULTIPLE they are polled.
Why not Reduce_scatter_block: it was chosen against when every wait had to be pollable
(MPICH's Ireduce_scatter_block polled to completion is slower than its blocking form), and
the exchange has stayed faster than the blocking call at most sizes (`make bench`,
benchmarks/results.md).

The messages go over all_to_all_v's private duplicate of the group's communicator
(alltoallv.py): every call sends one message to each peer and takes one from each, so
consecutive calls never mix and no user send or receive can match them. Waits are bounded by
the watchdog, whose timeout names the members that have not entered the call.

`ScatterReduce` is a mixin of collectives.Comm, like VariableExchange.
"""
from __future__ import annotations

from .alltoallv import TAG, mpi_type, offsets


class ScatterReduce:
    """reduce_scatter's transport (module docstring)."""

    def _pairwise_reduce_scatter(self, moved, comm, lens: list):
        """Rank i's block (`lens[i]` rows of `moved`, blocks consecutive in rank order) summed
        over the group of `comm` (2 or more members)."""
        what, xp, wd = "reduce_scatter", self.xp, self.watchdog
        private = self.private.of(comm, lambda req: self._wait(req, what, comm))
        n, me = comm.Get_size(), comm.Get_rank()
        at, mtype = offsets(lens), mpi_type(moved.dtype)
        mine = (lens[me],) + moved.shape[1:]
        scratch = xp.empty((n - 1,) + mine, dtype=moved.dtype)   # slot k-1: from (me - k) % n
        sbuf = self.backend.mpi_buffer(moved)
        rbuf = self.backend.mpi_buffer(scratch, slot="recv", read=False)
        requests = [private.Isend([sbuf[at[j]:at[j + 1]], mtype], dest=j, tag=TAG)
                    for j in ((me + k) % n for k in range(1, n))]
        requests += [private.Irecv([rbuf[k - 1], mtype], source=(me - k) % n, tag=TAG)
                     for k in range(1, n)]
        wd.wait_for_requests(requests, what, comm)     # bounded; traced as blocked time
        self.backend.mpi_finish(rbuf, scratch)
        parts = [moved[at[me]:at[me + 1]] if j == me else scratch[(me - j) % n - 1]
                 for j in range(n)]
        out = xp.empty(mine, dtype=moved.dtype)
        xp.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            xp.add(out, part, out=out)
        return out

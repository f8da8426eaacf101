"""reduce_scatter as one round of point-to-point messages and a local sum.

    reduce_scatter(axis)   forward  <->  all_gather(axis)       backward

The watchdog needs a non-blocking call (a blocking one cannot time out), and MPICH's
Ireduce_scatter_block ran 1.35-1.4x its own blocking Reduce_scatter_block at 1 MiB on 2 and 4
ranks here (an Ireduce_scatter_block polled to completion against the blocking call, 9 samples
each): the engine's reduce_scatter was 1.86-1.87x raw at 1 MiB in `make bench`. So the
engine does the pairwise exchange of MPI's own long-message algorithm itself: block j of the
rows goes to rank j as one message, each rank receives its block from every peer into a
scratch buffer, then adds the n contributions in rank order (xp.add in place: rank 0's first,
the same order on every run). In one micro-benchmark (21 alternating samples) that was
0.76-0.85x Reduce_scatter_block at 1 and 4 MiB on 2 and 4 ranks; `make bench` has the
engine's own figures.

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
        ticket = wd.arrive(comm)
        at, mtype = offsets(lens), mpi_type(moved.dtype)
        mine = (lens[me],) + moved.shape[1:]
        scratch = self.pool.get((n - 1,) + mine, moved.dtype)   # slot k-1: from (me - k) % n
        sbuf = self.backend.mpi_buffer(moved)
        rbuf = self.backend.mpi_buffer(scratch, slot="recv", read=False)
        requests = [private.Isend([sbuf[at[j]:at[j + 1]], mtype], dest=j, tag=TAG)
                    for j in ((me + k) % n for k in range(1, n))]
        requests += [private.Irecv([rbuf[k - 1], mtype], source=(me - k) % n, tag=TAG)
                     for k in range(1, n)]
        wd.collective(requests, what, comm, ticket)      # bounded; traced as blocked time
        self.backend.mpi_finish(rbuf, scratch)
        parts = [moved[at[me]:at[me + 1]] if j == me else scratch[(me - j) % n - 1]
                 for j in range(n)]
        out = self.pool.get(mine, moved.dtype)
        xp.add(parts[0], parts[1], out=out)
        for part in parts[2:]:
            xp.add(out, part, out=out)
        return out

"""all_to_all_v: the variable-count exchange along axis 0, in one round.

    all_to_all_v(counts)   forward  <->  all_to_all_v(counts swapped)   backward

MPI's Alltoallv wants every rank's receive counts up front, so a caller that knows only what
it sends first exchanges the counts (an Alltoall of n ints), then the rows: two rounds, in
each of which every rank waits for the others. On a machine with more runnable processes than
cores each such wait costs a trip through the OS scheduler, so the counts round alone can cost
as much as the rows.

Here the messages carry their own counts. Each rank sends block j of its rows to rank j as
one message (an empty block too), then takes a matched probe (MPI_Improbe) of the message
from each peer: its size gives the count. The result is allocated once at the summed length
and each message is received (MPI_Imrecv of the probed message) straight into its rows; the
rank's own block is a local copy. When the caller passes `recv_counts` (the reverse of an
earlier exchange) the receives are posted at once. Results are bit for bit those of
Alltoallv: the same rows in the same order.

Order and isolation: the messages go over a private duplicate of the group's communicator
(MPI_Comm_idup on the first call on that group, waited by the watchdog), so no user send or
receive (p2p.py) can match them; between two ranks on one communicator and tag, messages
match in the order sent, and every call takes exactly one message from each peer, so
consecutive calls never mix. Waits are bounded by the watchdog; a timeout names the members
that have not entered the call (its arrival counters).

`VariableExchange` is a mixin of collectives.Comm: it uses the host's `_mpi(group)`,
`prepare(arr)`, `_check`, `_wait`, `debug`, `xp`, `backend`, `stats`, `watchdog` and
`private` (a PrivateComms).
"""
from __future__ import annotations

import math
import time

import numpy as np
from mpi4py import MPI
from mpi4py.util.dtlib import from_numpy_dtype

from .objects import agree_mpi
from .recorded import recorded
from .retired import free_retired, keep_forever, retire
from .staging import BF16

TAG = 0                       # on the private communicator, which carries nothing else
_MPI_TYPES: dict = {}


def mpi_type(dtype):
    """The MPI datatype of a numpy dtype, made once per dtype: the predefined one
    (`Datatype.fromcode`), else mpi4py's `from_numpy_dtype` (which returns a new duplicate on
    every call, never freed: once per dtype here)."""
    dtype = np.dtype(dtype)
    if dtype == BF16:                        # moved as its words (backend.as_words)
        dtype = np.dtype(np.float16)
    found = _MPI_TYPES.get(dtype.str)
    if found is None:
        try:
            found = MPI.Datatype.fromcode(dtype.char)
        except (KeyError, ValueError):
            found = from_numpy_dtype(dtype)
        _MPI_TYPES[dtype.str] = found
    return found


def blocks(counts, row: int) -> tuple:
    """([c * row], [displacement]) of consecutive blocks of `counts` rows of `row` elements:
    the counts and displacements of a v-collective, as Python lists (n is small)."""
    sizes, displs, at = [], [], 0
    for c in counts:
        sizes.append(c * row)
        displs.append(at)
        at += c * row
    return sizes, displs


def offsets(counts) -> list:
    """The first row of each block of `counts` rows (and the total, last)."""
    out, at = [0], 0
    for c in counts:
        at += c
        out.append(at)
    return out


class PrivateComms:
    """A duplicate of each group communicator all_to_all_v ran on, shared by a Comm's group
    views; freed when the last of them is collected (MPI_Comm_free is local)."""

    def __init__(self):
        self.dups: dict = {}

    def of(self, comm, wait):
        """The duplicate of `comm`, made on first use (collective over its members, every
        one of which is entering the same all_to_all_v); `wait(request)` bounds the wait."""
        dup = self.dups.get(comm.py2f())
        if dup is None:
            free_retired()
            dup, req = comm.Idup()
            wait(req)
            self.dups[comm.py2f()] = dup
        return dup

    def close(self) -> None:
        """Free the duplicates (Comm.close)."""
        dups, self.dups = self.dups, {}
        for dup in dups.values():
            dup.Free()

    def keep(self) -> None:
        """Never free the duplicates (retired.keep_forever: a message may still arrive)."""
        dups, self.dups = self.dups, {}
        keep_forever(dups.values())

    def __del__(self, retire=retire):               # bound: globals may be None at exit
        dups, self.dups = getattr(self, "dups", {}), {}
        retire(dups.values())                       # freed later: comm/retired.py


class VariableExchange:
    """all_to_all_v (module docstring)."""

    @recorded
    def all_to_all_v(self, arr, send_counts, group=None, recv_counts=None):
        """Variable-count exchange along axis 0 (the result of MPI Alltoallv).

        `send_counts[j]` rows of `arr` (consecutive, in rank order) go to rank j. The receive
        counts come with the messages, unless the caller already knows `recv_counts`; returns
        (received rows concatenated in source-rank order, recv_counts as int64). Adjoint:
        all_to_all_v of the gradient with send and receive counts swapped.
        """
        t0 = time.perf_counter()
        comm = self._mpi(group)
        n, me = comm.Get_size(), comm.Get_rank()
        if self.debug:
            self._check(comm, "all_to_all_v", self.xp.asarray(arr), axis=0, skip_axis=True)
        a = self.prepare(arr)
        sc = np.ascontiguousarray(send_counts, dtype=np.int64)
        send = sc.tolist() if sc.ndim == 1 else []
        bad = None
        if len(send) != n or sum(send) != a.shape[0] or min(send) < 0:
            bad = (f"all_to_all_v: send_counts {sc.tolist()} must be {n} non-negative "
                   f"counts summing to the {a.shape[0]} rows given")
        if self.debug:          # counts are this rank's own: agree, so no rank waits alone
            agree_mpi(comm, None if bad is None else f"group rank {me}: {bad}",
                      wait=lambda req: self._wait(req, "all_to_all_v (debug check)", comm))
        elif bad is not None:
            raise ValueError(bad)
        wd, what = self.watchdog, "all_to_all_v"
        private = self.private.of(comm, lambda req: self._wait(req, what, comm))
        ticket = wd.arrive(comm)
        t_wait, row, mtype = time.perf_counter(), math.prod(a.shape[1:]), mpi_type(a.dtype)
        sbuf = self.backend.mpi_buffer(a)
        at = offsets(send)
        peers = [(me + k) % n for k in range(1, n)]     # rotated, as MPICH's own algorithms
        requests = [private.Isend([sbuf[at[j]:at[j + 1]], mtype], dest=j, tag=TAG)
                    for j in peers]
        if recv_counts is not None:
            recv, messages = np.ascontiguousarray(recv_counts, dtype=np.int64).tolist(), None
        elif row == 0:                  # empty rows carry no length: exchange the counts
            rc = np.empty(n, dtype=np.int64)
            self._wait(comm.Ialltoall(sc, rc), what, comm)
            recv, messages = rc.tolist(), None
        else:
            recv, messages = self._probe(private, comm, send[me], row, mtype, ticket)
        blocked = time.perf_counter() - t_wait
        out = self.xp.empty((sum(recv),) + a.shape[1:], dtype=a.dtype)
        rbuf = self.backend.mpi_buffer(out, slot="recv", read=False)
        into = offsets(recv)
        for j in reversed(peers):               # the peer that sends to this rank first
            buf = [rbuf[into[j]:into[j + 1]], mtype]
            requests.append(private.Irecv(buf, source=j, tag=TAG) if messages is None
                            else messages[j].Irecv(buf))
        rbuf[into[me]:into[me + 1]] = sbuf[at[me]:at[me + 1]]        # the own block
        t_wait = time.perf_counter()
        wd.wait_for_requests(requests, what, comm, ticket)
        if wd.tracer is not None:            # both waits, as one collective's blocked time
            wd.tracer.blocked(wd.group(comm)[2], blocked + time.perf_counter() - t_wait)
        self.backend.mpi_finish(rbuf, out)
        self.stats.count("all_to_all", (a.shape[0] - send[me]) * row * a.itemsize, t0)
        return out, np.array(recv, dtype=np.int64)

    def _probe(self, private, comm, own: int, row: int, mtype, ticket) -> tuple:
        """(rows from each source, {source: its matched message}): one matched probe per
        peer; `own` is this rank's block to itself."""
        n, me = comm.Get_size(), comm.Get_rank()
        recv, messages = [0] * n, {}
        recv[me] = own
        status = MPI.Status()
        missing = [(me - k) % n for k in range(1, n)]

        def arrived() -> bool:
            for j in list(missing):
                message = private.Improbe(source=j, tag=TAG, status=status)
                if message is not None:
                    messages[j] = message
                    recv[j] = status.Get_count(mtype) // row
                    missing.remove(j)
            return not missing

        self.watchdog.wait_until(arrived, "all_to_all_v", comm, ticket)
        return recv, messages

"""Comm: the collectives (and, through PointToPoint, send/receive) of one device mesh.

Every collective maps onto mpi4py buffer (uppercase) calls, so arrays never go through pickle:
one collective call, or one point-to-point message per peer where that is one round instead of
two or measured faster (all_to_all_v: alltoallv.py; reduce_scatter: reduce_scatter.py;
all_gather lives in gather.py), bounded by the stall watchdog (health/watchdog.py: at most
`timeout` seconds, then CollectiveTimeout naming the late ranks): a collective call is MPI's
blocking one under the guard thread's deadline (health/guard.py), and so is the Waitall of a
collective made of point-to-point messages; send/receive and the `*_async` Futures are polled.
`group=` names a mesh axis ("tp"), a tuple of axes (("dp", "fsdp")), or None for the Comm's own
group (the whole world for the engine's Comm; `comm.group("tp")` is a Comm whose calls default
to the tp group). Each call documents its adjoint, because the strategies use them in pairs:

    all_reduce(sum)        forward  <->  all_reduce(sum)        backward (of a sum over copies)
    all_gather(axis)       forward  <->  reduce_scatter(axis)   backward
    reduce_scatter(axis)   forward  <->  all_gather(axis)       backward
    all_to_all(axis)       forward  <->  all_to_all(axis)       backward (the inverse exchange)
    all_to_all_v(counts)   forward  <->  all_to_all_v(counts swapped) backward
    send(dest)             forward  <->  receive(dest)          backward

`stats` counts the bytes each rank sends per collective kind, using what a bandwidth-optimal
(ring) algorithm sends: all_reduce 2(n-1)/n * size, all_gather and reduce_scatter (n-1)/n *
full size, all_to_all (n-1)/n * size, send the message size.

What keeps a job from hanging silently is passed in by whoever builds the Comm (the engine,
from health/): `watchdog`, the bounded waits (without one, waits.Waits: unbounded); `flight`, a
recorder of the calls (recorded.py: each entry point tells it of its calls; None: no record);
`check`, debug mode's signature check.

Results are fresh arrays of the backend (the caller owns them); all_reduce takes `out=` for a
buffer the caller reuses (the gradient buckets reduce in place). No bfloat16 sums (p2p.py).

Debug mode (a `check` given): before each collective the group compares op, dtype and shape
(health/debug.py) and raises `CollectiveMismatchError` on every rank naming the difference,
instead of corrupting data or hanging.
"""
from __future__ import annotations

import copy
import time

import numpy as np
from mpi4py import MPI

from .alltoallv import PrivateComms, VariableExchange
from .gather import Gather
from .objects import agree_mpi
from .p2p import HEADER_WORDS, Future, PointToPoint, dtype_code, header, header_shape, no_bf16_sum
from .recorded import recorded
from .reduce_scatter import ScatterReduce
from .retired import abandon
from .stats import CommStats
from .waits import Waits

__all__ = ["Comm", "OPS"]

OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}


class Comm(PointToPoint, Gather, VariableExchange, ScatterReduce):
    """The collectives of `mesh` (a DeviceMesh) on arrays of `backend` (numpy or cupy).

    `watchdog`, `flight` and `check`: the waits, the recorder and debug mode's check (module
    docstring). Group views made by `group(axis)` share the statistics, the pending receives
    and all_to_all_v's private communicators with the Comm they came from.
    """

    def __init__(self, mesh, backend, watchdog=None, flight=None, check=None):
        self.mesh = mesh
        self.backend = backend
        self.xp = backend.xp
        self.check = check                 # (comm, kind, arr, op, axis, skip_axis, wait)
        self.stats = CommStats()
        self.watchdog = Waits() if watchdog is None else watchdog   # every wait (waits.py)
        self.default_group = None
        self._groups: dict = {}
        self._by_group: dict = {}          # group argument -> communicator (shared by views)
        self.pending_receives: dict = {}   # (comm, src, tag) -> pending receives, in order
        self.sends_in_flight: list = []    # send Futures kept alive until done (p2p.py)
        self.private = PrivateComms()      # all_to_all_v's communicators (alltoallv.py)
        self.watchdog.keep_on_timeout.append(self.private)
        self.flight = flight               # hears every call (recorded.py)

    @property
    def debug(self) -> bool:
        """Debug mode: each collective's signature is checked first (a `check` is set)."""
        return self.check is not None

    # -- groups ------------------------------------------------------------------------------
    def group(self, axes) -> "Comm":
        """This Comm bound to the group over `axes`: its calls default to that group."""
        key = axes if axes is None or isinstance(axes, str) else tuple(axes)
        view = self._groups.get(key)
        if view is None:
            view = copy.copy(self)          # shallow: stats and queues are shared
            view.default_group = key
            self._groups[key] = view
        return view

    def _mpi(self, group=None):
        """The mpi4py communicator of `group` (None: this Comm's own group), looked up once
        per spelling of the group (every collective call starts here). After close() or a
        timeout it raises CommUnusable (waits.py)."""
        self.watchdog.check_usable()
        key = self.default_group if group is None else group
        try:
            return self._by_group[key]
        except (KeyError, TypeError):               # TypeError: a list of axes
            comm = self.mesh.comm(key)
            if isinstance(key, (str, tuple)) or key is None:
                self._by_group[key] = comm
            return comm

    @property
    def mpi(self):
        """The mpi4py communicator of this Comm's own group."""
        return self._mpi()

    def size(self, group=None) -> int:
        return self._mpi(group).Get_size()

    def rank(self, group=None) -> int:
        return self._mpi(group).Get_rank()

    @recorded
    def barrier(self, group=None) -> None:
        """Blocks until every device of the group reaches this line."""
        comm = self._mpi(group)
        self.watchdog.run(comm.Barrier, comm.Ibarrier, (), "barrier", comm)

    def _wait(self, req, what, comm):
        """Wait for a collective's request, at most the timeout (CollectiveTimeout)."""
        self.watchdog.wait_collective([req], what, comm)

    def context(self, **where) -> None:
        """Where the job is (step=, microbatch=; None forgets one), for timeout messages."""
        self.watchdog.where.update(where)

    def close(self, collective: bool = True) -> None:
        """What engine.close() gives back: the sends still in flight are completed (bounded by
        the timeout; not after a timeout), the receives never waited for are cancelled, and
        all_to_all_v's communicators freed; every later call raises CommUnusable.
        collective=False (this rank alone, leaving a `with` block on an exception): nothing is
        waited for, sends in flight are kept alive (retired.abandon), and the communicators
        and the arrival block are kept too: a freed communicator's context id can be reused by
        a later one, where a peer's message that was never received would then match a
        receive and silently overwrite its data."""
        try:
            if collective and self.watchdog.unusable is None:
                for fut in self.sends_in_flight:
                    fut.result()
        finally:
            for queue in self.pending_receives.values():
                for fut in queue:
                    for req in fut._requests:
                        if req:                # a completed header request is null already
                            req.Cancel()
                            req.Wait()
            self.pending_receives.clear()
            abandon(fut for fut in self.sends_in_flight if not fut.done())
            self.sends_in_flight.clear()
            self._by_group.clear()             # every view's next lookup: the closed mesh
            self.private.close() if collective else self.private.keep()
            if self.backend.device_transport is not None and collective:
                self.backend.device_transport.close()      # NCCL's communicators
            self.watchdog.close("this engine was closed (engine.close()): build a new engine",
                                give_back=collective)

    # -- helpers -----------------------------------------------------------------------------
    def prepare(self, arr):
        """`arr` as a C-contiguous array of the backend with a transferable dtype."""
        xp = self.xp
        if type(arr) is xp.ndarray and arr.flags.c_contiguous:     # the usual case, as is
            dtype_code(arr.dtype)
            return arr
        a = xp.asarray(arr)
        a = xp.ascontiguousarray(a).reshape(a.shape)   # ascontiguousarray makes 0-d 1-d
        dtype_code(a.dtype)
        return a

    def _check(self, comm, kind, a, op="", axis=0, skip_axis=False):
        if self.check is not None:
            self.check(comm, kind, a, op, axis, skip_axis,
                       wait=lambda req: self._wait(req, f"{kind} (debug check)", comm))

    @staticmethod
    def _norm_axis(a, axis):
        if axis == 0:                                   # the usual case, checked cheaply
            return 0
        if not -a.ndim <= axis < max(a.ndim, 1):
            raise ValueError(f"axis {axis} out of range for an array of shape {a.shape}")
        return axis % max(a.ndim, 1)

    def _moved(self, a, axis):
        """`a` with `axis` first, contiguous (the layout MPI concatenates along)."""
        return self.prepare(self.xp.moveaxis(a, axis, 0) if axis else a)

    def _back(self, out, axis):
        return self.xp.moveaxis(out, 0, axis) if axis != 0 else out

    # -- all_reduce --------------------------------------------------------------------------
    @recorded
    def all_reduce(self, arr, op: str = "sum", group=None, out=None):
        """Element-wise reduction over the group, result on every rank (MPI Allreduce).

        op: 'sum', 'avg' (sum / group size), 'max', 'min'. Adjoint of a sum over replicas:
        all_reduce(sum) backward; adjoint of 'avg' is 'avg'.
        out: a reused result buffer (no allocation per call); `out=arr` reduces in place
        (MPI_IN_PLACE, no second buffer).
        """
        t0 = time.perf_counter()
        a, out, comm, n = self._all_reduce_args(arr, op, group, out)
        backend, nccl = self.backend, self._nccl(a)
        if nccl is not None:                     # NCCL's device collective (nccl.py)
            nccl.all_reduce(a, out, op, comm, self.watchdog)
        elif backend.pipeline is not None and backend.pipeline.applies(a):  # staging.py
            backend.pipeline.all_reduce(a, out, OPS[op], comm, self.watchdog, backend.staged)
        else:
            sbuf = MPI.IN_PLACE if out is a else backend.mpi_buffer(a)
            rbuf = backend.mpi_buffer(out, slot="recv", read=out is a)
            self.watchdog.run(comm.Allreduce, comm.Iallreduce, (sbuf, rbuf, OPS[op]),
                              "all_reduce", comm)
            backend.mpi_finish(rbuf, out)
        if op == "avg" and n > 1:
            out /= n
        self.stats.count("all_reduce", 2 * (n - 1) / n * a.nbytes, t0)
        return out

    def _all_reduce_args(self, arr, op, group, out):
        """(input, result buffer, communicator, group size); the result `is` the input when
        reducing in place (`out=arr`, which must then be C-contiguous)."""
        comm = self._mpi(group)
        if self.debug:
            self._check(comm, "all_reduce", self.xp.asarray(arr), op)
        if op not in OPS:
            raise ValueError(f"all_reduce op must be one of {list(OPS)}, got {op!r}")
        a = arr if out is not None and out is arr else self.prepare(arr)   # dtype checked
        no_bf16_sum(a.dtype, "all_reduce")
        if op == "avg" and a.dtype.kind not in "fc":
            raise TypeError(f"all_reduce(op='avg') needs a floating dtype, got {a.dtype}")
        if out is None:
            out = self.xp.empty(a.shape, dtype=a.dtype)
        elif out.shape != a.shape or out.dtype != a.dtype or not out.flags.c_contiguous:
            raise ValueError(f"all_reduce: out= must be C-contiguous with shape {a.shape} and "
                             f"dtype {a.dtype}, got shape {out.shape} and dtype {out.dtype}")
        elif out is a:
            dtype_code(a.dtype)                 # in place: not through prepare
        return a, out, comm, comm.Get_size()

    @recorded
    def all_reduce_async(self, arr, op: str = "sum", group=None, out=None) -> Future:
        """Non-blocking all_reduce (MPI Iallreduce); `result()` waits and returns the array.

        Same ops and adjoint as all_reduce; `out=arr` reduces in place. Neither `arr` nor `out`
        may be touched until the Future completes. The gradient sync issues one per bucket
        while the backward of earlier layers runs. Bytes are counted when the call is issued
        (the all_reduce formula, under 'all_reduce'); the time counts the issue only.
        """
        t0 = time.perf_counter()
        a, out, comm, n = self._all_reduce_args(arr, op, group, out)
        nccl = self._nccl(a)
        if nccl is not None:                     # on NCCL's side stream (nccl.py)
            pending = nccl.all_reduce(a, out, op, comm, self.watchdog, "all_reduce_async",
                                      wait=False)
            self.stats.count("all_reduce", 2 * (n - 1) / n * a.nbytes, t0)
            def averaged():
                if op == "avg" and n > 1:
                    self.xp.divide(out, n, out=out)
                return out
            return Future([], averaged, keep=(a, out), wait=lambda _: pending.wait(),
                          test=lambda _: pending.done())
        # device staging without CUDA-aware MPI: host buffers of this request's own
        sbuf = MPI.IN_PLACE if out is a else self.backend.mpi_buffer(a, slot=None)
        rbuf = self.backend.mpi_buffer(out, slot=None, read=out is a)
        req, ticket = comm.Iallreduce(sbuf, rbuf, op=OPS[op]), self.watchdog.arrive(comm)

        def finish():
            self.backend.mpi_finish(rbuf, out)
            if op == "avg" and n > 1:
                self.xp.divide(out, n, out=out)
            return out
        self.stats.count("all_reduce", 2 * (n - 1) / n * a.nbytes, t0)
        return Future([req], finish, keep=(a, sbuf, rbuf), wait=self.watchdog.waiter(
            "all_reduce_async", comm, ticket), release=lambda: self.backend.release(sbuf, rbuf))

    # -- reduce_scatter, all_to_all ----------------------------------------------------------
    @recorded
    def reduce_scatter(self, arr, op: str = "sum", axis: int = 0, group=None):
        """Reduce over the group, then rank i keeps block i along `axis` (Reduce_scatter).

        Blocks follow numpy.array_split, so a length not divisible by the group size is
        allowed (the first blocks are one longer). Adjoint: all_gather along the same axis.
        """
        t0 = time.perf_counter()
        a = self.xp.asarray(arr)
        comm = self._mpi(group)
        self._check(comm, "reduce_scatter", a, op, axis=axis)
        no_bf16_sum(a.dtype, "reduce_scatter")
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter op must be 'sum' or 'avg', got {op!r}")
        if op == "avg" and a.dtype.kind not in "fc":
            raise TypeError(f"reduce_scatter(op='avg') needs a floating dtype, got {a.dtype}")
        axis = self._norm_axis(a, axis)
        n = comm.Get_size()
        moved = self._moved(a, axis)
        length = moved.shape[0]
        lens = [length // n + (1 if i < length % n else 0) for i in range(n)]
        nccl = self._nccl(moved)
        if n == 1:
            out = moved.copy()                  # never the caller's own array
        elif nccl is not None and length % n == 0:      # NCCL's (nccl.py)
            out = self.xp.empty((length // n,) + moved.shape[1:], dtype=moved.dtype)
            nccl.reduce_scatter(moved, out, comm, self.watchdog)
        else:                     # pairwise exchange, rank-order sum (reduce_scatter.py)
            out = self._pairwise_reduce_scatter(moved, comm, lens)
        if op == "avg" and n > 1:
            out /= n
        self.stats.count("reduce_scatter", (n - 1) / n * moved.nbytes, t0)
        return self._back(out, axis)

    @recorded
    def all_to_all(self, arr, axis: int = 0, group=None):
        """Split `arr` into group-size blocks along `axis`; block j goes to rank j, and the
        received blocks are concatenated along `axis` in rank order (MPI Alltoall).
        Adjoint: all_to_all along the same axis (the exchange undoes itself).
        """
        t0 = time.perf_counter()
        a = self.xp.asarray(arr)
        comm = self._mpi(group)
        self._check(comm, "all_to_all", a, axis=axis)
        axis = self._norm_axis(a, axis)
        n = comm.Get_size()
        moved = self._moved(a, axis)
        if moved.shape[0] % n:
            raise ValueError(f"all_to_all: length {moved.shape[0]} along axis {axis} is not "
                             f"divisible by the group size {n}")
        out = self.xp.empty(moved.shape, dtype=moved.dtype)
        backend, nccl = self.backend, self._nccl(moved)
        if nccl is not None:                     # one NCCL group of pairs (nccl.py)
            nccl.all_to_all(moved, out, comm, self.watchdog)
        else:
            sbuf = backend.mpi_buffer(moved)
            rbuf = backend.mpi_buffer(out, slot="recv", read=False)
            self.watchdog.run(comm.Alltoall, comm.Ialltoall, (sbuf, rbuf), "all_to_all", comm)
            backend.mpi_finish(rbuf, out)
        self.stats.count("all_to_all", (n - 1) / n * moved.nbytes, t0)
        return self._back(out, axis)

    # -- broadcast, agree --------------------------------------------------------------------
    @recorded
    def broadcast(self, arr, root: int = 0, group=None):
        """Every rank gets root's array (MPI Bcast). Non-root ranks may pass None: shape and
        dtype come from root. Adjoint: reduce(sum) to root.
        """
        t0 = time.perf_counter()
        comm = self._mpi(group)
        self._check(comm, "broadcast", None, axis=root)
        a, h = self._broadcast_header(comm, arr, root)
        if comm.Get_rank() != root:
            shape, dtype = header_shape(h)
            a = self.xp.empty(shape, dtype=dtype)
        nccl = self._nccl(a)
        if nccl is not None:                     # NCCL's (nccl.py); the header went by MPI
            nccl.broadcast(a, root, comm, self.watchdog)
        else:
            buf = self.backend.mpi_buffer(a, slot="bcast", read=comm.Get_rank() == root)
            self.watchdog.run(comm.Bcast, comm.Ibcast, (buf, root), "broadcast", comm)
            self.backend.mpi_finish(buf, a)
        n = comm.Get_size()
        self.stats.count("broadcast", (n - 1) / n * a.nbytes if comm.Get_rank() == root else 0,
                         t0)
        return a

    def _broadcast_header(self, comm, arr, root):
        """Root's (array, header) sent to every rank; root's bad array raises on every rank."""
        error, a = None, None
        if comm.Get_rank() == root:
            try:
                a = self.prepare(arr)
                h = header(a)
            except (TypeError, ValueError) as exc:   # root's mistake: raised on every rank
                error = exc
                h = np.full(HEADER_WORDS, -1 if isinstance(exc, TypeError) else -2,
                            dtype=np.int64)
        else:
            h = np.empty(HEADER_WORDS, dtype=np.int64)
        self.watchdog.run(comm.Bcast, comm.Ibcast, (h, root), "broadcast", comm)
        if h[0] < 0:
            msg = comm.bcast(str(error) if error is not None else None, root=root)
            raise (TypeError if h[0] == -1 else ValueError)(f"broadcast from group rank "
                                                              f"{root}: {msg}")
        return a, h

    @recorded
    def agree(self, ok: bool, message: str = "", group=None) -> None:
        """Collective error check: if `ok` is False on any rank, every rank raises ValueError
        with the first failing rank's message (no rank is left waiting in a collective)."""
        comm = self._mpi(group)
        agree_mpi(comm, None if ok else message,
                  wait=lambda req: self._wait(req, "agree", comm))

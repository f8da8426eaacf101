"""ShardedEngine: the chapter's pseudo-API made real on an mpi4py communicator.

Every collective maps onto one mpi4py buffer (uppercase) call, so arrays never go through
pickle. `group=` names a mesh axis ("tp"), a tuple of axes (("dp", "fsdp")), or None for the
whole world. Each call documents its adjoint, because the strategies use them in pairs:

    all_reduce(sum)        forward  <->  all_reduce(sum)        backward (of a sum over copies)
    all_gather(axis)       forward  <->  reduce_scatter(axis)   backward
    reduce_scatter(axis)   forward  <->  all_gather(axis)       backward
    all_to_all(axis)       forward  <->  all_to_all(axis)       backward (the inverse exchange)
    send(dest)             forward  <->  receive(dest)          backward

The engine counts the bytes each rank sends per collective kind (`comm_bytes`), using what a
bandwidth-optimal (ring) algorithm sends: all_reduce 2(n-1)/n * size, all_gather and
reduce_scatter (n-1)/n * full size, all_to_all (n-1)/n * size, send the message size.

Debug mode (`MPISHARD_DEBUG=1` or `debug=True`): before each collective the group compares op,
dtype and shape and raises `CollectiveMismatchError` on every rank naming the difference,
instead of corrupting data or hanging.
"""
from __future__ import annotations

import os
import sys
import time
from abc import ABC, abstractmethod
from collections import Counter

import numpy as np
from mpi4py import MPI

from .comm.backend import Backend
from .comm.mesh import DeviceMesh, parse_layout

_DTYPES = [np.dtype(t) for t in ("float64", "float32", "int64", "int32", "float16", "uint8",
                                 "bool", "complex128", "complex64")]
_KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
          "all_to_all_v"]
_OPS = {"sum": MPI.SUM, "avg": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN}
_HEADER = 12  # int64 words: dtype code, ndim, up to 10 dims
_TAG_HEADER, _TAG_DATA, _TAG_RAW = 0, 1, 2


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group called a collective with different op, dtype or shape."""


def _dtype_code(dtype) -> int:
    dtype = np.dtype(dtype)
    if dtype not in _DTYPES:
        raise TypeError(f"dtype {dtype} is not supported for MPI transfer; use one of "
                        f"{[str(d) for d in _DTYPES]}")
    return _DTYPES.index(dtype)


class Future:
    """A pending non-blocking transfer (Isend/Irecv). `result()` waits, `done()` polls."""

    def __init__(self, requests, finish=None, keep=()):
        self._requests = list(requests)
        self._finish = finish
        self._keep = keep  # buffers that must stay alive until completion
        self._value = None
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        if MPI.Request.Testall(self._requests):
            self._complete()
        return self._done

    def result(self):
        if not self._done:
            MPI.Request.Waitall(self._requests)
            self._complete()
        return self._value

    wait = result

    def _complete(self):
        self._done = True
        self._value = self._finish() if self._finish is not None else None
        self._keep = ()


class ShardedEngine(ABC):
    """Base class: device identity, point-to-point and collective calls, inference loop.

    Subclasses implement `load_checkpoint`, `forward` and `backward` (the chapter's contract).
    """

    def __init__(self, layout="single", comm=None, dtype=np.float64, device="cpu", debug=None):
        self.comm = MPI.COMM_WORLD if comm is None else comm
        self.layout = parse_layout(layout)
        self.mesh = DeviceMesh(self.comm, self.layout)  # raises on a world-size mismatch
        self.backend = Backend(device, self.comm)
        self.xp = self.backend.xp
        self.dtype = np.dtype(dtype)
        if debug is None:
            debug = os.environ.get("MPISHARD_DEBUG", "0") not in ("", "0")
        self.debug = bool(debug)
        self.comm_bytes: Counter = Counter()
        self.comm_calls: Counter = Counter()
        self.comm_time: Counter = Counter()
        # receive-buffer reuse for all_reduce / reduce_scatter / all_to_all results (see
        # _result_buffer); False allocates a fresh result every call
        self.reuse_buffers = True
        self._result_pool: dict = {}
        self._header_recvs: dict = {}   # (comm, src, tag) -> pending receives, in order

    # -- identity ------------------------------------------------------------------------------
    @property
    def mpi_comm(self):
        """The engine's mpi4py communicator (world of this engine), for control data."""
        return self.comm

    @property
    def device_id(self) -> int:
        """The rank of this device in the engine's communicator."""
        return self.comm.Get_rank()

    @property
    def num_devices(self) -> int:
        """World size."""
        return self.comm.Get_size()

    def group_size(self, group=None) -> int:
        return self.mesh.size(group) if group is not None else self.num_devices

    def group_rank(self, group=None) -> int:
        return self.mesh.coord(group) if group is not None else self.device_id

    def barrier(self, group=None) -> None:
        """Blocks until every device of the group reaches this line."""
        self.mesh.comm(group).Barrier()

    def reset_comm_stats(self) -> None:
        self.comm_bytes.clear()
        self.comm_calls.clear()
        self.comm_time.clear()

    # -- helpers -------------------------------------------------------------------------------
    def _prepare(self, arr):
        xp = self.xp
        a = xp.asarray(arr)
        a = xp.ascontiguousarray(a).reshape(a.shape)   # ascontiguousarray makes 0-d 1-d
        _dtype_code(a.dtype)
        return a

    _POOL_SHAPES, _POOL_PER_SHAPE = 8, 2

    def _result_buffer(self, shape, dtype):
        """A result array for a collective: a reused one that nobody holds any more, or new.

        Up to two results per shape and dtype (for the last few shapes) are kept, so the loop
        `y = engine.all_reduce(x)` alternates between two buffers; one is handed out again
        only when no other reference to it, or to a view of it, remains (CPython reference
        counts of the array and of the memory's owner), so a result the caller still holds is
        never overwritten. This saves the page faults of a fresh large allocation per call
        (15-40% of a 16 MiB all_reduce here). all_gather results are not pooled: gathered
        weights (FSDP) must really be freed.
        """
        if not self.reuse_buffers:
            return self.xp.empty(shape, dtype=dtype)
        key = (tuple(shape), np.dtype(dtype).str)
        bufs = self._result_pool.pop(key, [])
        self._result_pool[key] = bufs                   # most recently used shape last
        if len(self._result_pool) > self._POOL_SHAPES:
            self._result_pool.pop(next(iter(self._result_pool)))
        for i in range(len(bufs)):          # indexed: a loop variable would add a reference
            # 2 = the list's reference + getrefcount's argument; every view of a pooled
            # array (the moveaxis of a result, a slice of it) holds one more, as its .base
            if sys.getrefcount(bufs[i]) == 2:
                return bufs[i]
        buf = self.xp.empty(shape, dtype=dtype)
        bufs.append(buf)
        if len(bufs) > self._POOL_PER_SHAPE:
            bufs.pop(0)                                 # the oldest stays with its holder
        return buf

    def _count(self, kind, nbytes, t0):
        self.comm_calls[kind] += 1
        self.comm_bytes[kind] += int(nbytes)
        self.comm_time[kind] += time.perf_counter() - t0

    def _check(self, comm, kind, a, op="", axis=0, skip_axis=False):
        """Debug mode: every rank of the group compares (kind, op, dtype, shape, axis).

        Called before any check that depends on this rank's array (dtype, axis range,
        divisibility), so such a mistake on one rank is reported on every rank, not raised on
        that rank alone while the others wait. `a=None`: no array (broadcast)."""
        if not self.debug:
            return
        shape = list(a.shape) if a is not None else []
        if -len(shape) <= axis < len(shape):
            axis %= len(shape)
        if skip_axis and 0 <= axis < len(shape):
            shape[axis] = -1  # all_gather may concatenate uneven lengths along `axis`
        sig = np.full(4 + 10, -2, dtype=np.int64)
        sig[0] = _KINDS.index(kind)
        sig[1] = list(_OPS).index(op) if op in _OPS else -1
        if a is not None:   # unsupported dtypes as -1 - ord(char): named, raised after the check
            sig[2] = _DTYPES.index(a.dtype) if a.dtype in _DTYPES else -1 - ord(a.dtype.char)
        sig[3] = axis
        sig[4:4 + min(10, len(shape))] = shape[:10]
        sig[4 + len(shape):] = -3
        allsig = np.empty((comm.Get_size(), sig.size), dtype=np.int64)
        comm.Allgather(sig, allsig)
        if (allsig != allsig[0]).any():
            def show(s):
                dims = [int(d) for d in s[4:] if d != -3]
                dtype = (_DTYPES[s[2]] if s[2] >= 0 else "-" if s[2] == -2
                         else f"unsupported {np.dtype(chr(-1 - s[2]))}")
                return (f"{_KINDS[s[0]]}(op={list(_OPS)[s[1]] if s[1] >= 0 else '-'}, "
                        f"dtype={dtype}, shape={tuple(dims)}, "
                        f"{'root' if _KINDS[s[0]] == 'broadcast' else 'axis'}={s[3]})")
            ranks = "; ".join(f"group rank {r}: {show(s)}" for r, s in enumerate(allsig))
            raise CollectiveMismatchError(f"collective mismatch in {kind}: {ranks}")

    def _norm_axis(self, a, axis):
        if not -a.ndim <= axis < max(a.ndim, 1):
            raise ValueError(f"axis {axis} out of range for an array of shape {a.shape}")
        return axis % max(a.ndim, 1)

    # -- point to point ------------------------------------------------------------------------
    def _header(self, a):
        h = np.zeros(_HEADER, dtype=np.int64)
        if a.ndim > _HEADER - 2:
            raise ValueError(f"send supports up to {_HEADER - 2} dims, got {a.ndim}")
        h[0], h[1] = _dtype_code(a.dtype), a.ndim
        h[2:2 + a.ndim] = a.shape
        return h

    def _tag(self, tag, kind):
        # a negative tag would map onto MPI_ANY_TAG (-1) or an invalid tag
        if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 0:
            raise ValueError(f"tag must be an integer >= 0, got {tag!r}")
        return 3 * int(tag) + kind

    def send(self, dest_id: int, arr, tag: int = 0, group=None) -> None:
        """Blocking send of `arr` (any shape/dtype) to `dest_id`; adjoint: receive."""
        t0 = time.perf_counter()
        a = self._prepare(arr)
        comm = self.mesh.comm(group)
        comm.Send(self._header(a), dest=dest_id, tag=self._tag(tag, _TAG_HEADER))
        buf = self.backend.mpi_buffer(a)
        comm.Send(buf, dest=dest_id, tag=self._tag(tag, _TAG_DATA))
        self._count("send", a.nbytes, t0)

    def receive(self, src_id: int, tag: int = 0, group=None):
        """Blocking receive of an array sent with `send`; shape and dtype travel with it."""
        return self.receive_async(src_id, tag=tag, group=group).result()

    def send_async(self, arr, dst=None, target_device_id=None, *, dest=None, tag: int = 0,
                   group=None) -> Future:
        """Non-blocking send (Isend); returns a Future.

        Two forms: `send_async(arr, dest)` (the receiver calls `receive_async(src)` and learns
        shape and dtype from a header), and the seed's `send_async(src, dst, target_device_id)`
        where `dst` is the buffer the target receives into (`receive_async(src, out=dst)`), so
        no header is sent and the message lands without an extra copy.
        """
        t0 = time.perf_counter()
        a = self._prepare(arr)
        comm = self.mesh.comm(group)
        if target_device_id is not None:         # seed form: (src, dst_buffer, target)
            buf = self.backend.mpi_buffer(a, slot=None)  # fresh: many in flight
            req = comm.Isend(buf, dest=target_device_id, tag=self._tag(tag, _TAG_RAW))
            self._count("send", a.nbytes, t0)
            return Future([req], keep=(a, buf))
        dest = dst if dest is None else dest
        if dest is None or not isinstance(dest, (int, np.integer)):
            raise TypeError("send_async(arr, dest) needs an integer destination rank")
        h = self._header(a)
        buf = self.backend.mpi_buffer(a, slot=None)  # fresh: many in flight
        reqs = [comm.Isend(h, dest=int(dest), tag=self._tag(tag, _TAG_HEADER)),
                comm.Isend(buf, dest=int(dest), tag=self._tag(tag, _TAG_DATA))]
        self._count("send", a.nbytes, t0)
        return Future(reqs, keep=(a, buf, h))

    def receive_async(self, src_id: int, out=None, tag: int = 0, group=None) -> Future:
        """Non-blocking receive (Irecv); `result()` returns the array.

        With `out=` the message (sent by the seed form of send_async) lands in that buffer.
        """
        comm = self.mesh.comm(group)
        if out is not None:
            if not out.flags.c_contiguous:
                raise ValueError("receive_async(out=...) needs a C-contiguous buffer")
            buf = self.backend.mpi_buffer(out, slot="irecv") if self.backend.is_gpu else out
            req = comm.Irecv(buf, source=src_id, tag=self._tag(tag, _TAG_RAW))

            def finish():
                self.backend.mpi_finish(buf, out)
                return out
            return Future([req], finish, keep=(buf,))
        h = np.empty(_HEADER, dtype=np.int64)
        req = comm.Irecv(h, source=src_id, tag=self._tag(tag, _TAG_HEADER))
        # Headers match the receives in posting order, and so must the data messages (the
        # blocking Recv below): a later receive from the same source and tag finishes the
        # earlier ones first, whatever order result()/done() are called in.
        key = (comm.py2f(), src_id, int(tag))
        queue = self._header_recvs.setdefault(key, [])
        fut = Future([req], keep=(h,))
        queue.append(fut)

        def finish_header():
            while queue[0] is not fut:
                queue[0].result()
            queue.pop(0)
            if not queue:        # the last pending receive of this key: forget the key
                del self._header_recvs[key]
            dtype, ndim = _DTYPES[int(h[0])], int(h[1])
            shape = tuple(int(d) for d in h[2:2 + ndim])
            out_arr = self.xp.empty(shape, dtype=dtype)
            buf = self.backend.mpi_buffer(out_arr, slot="recv") if self.backend.is_gpu else out_arr
            comm.Recv(buf, source=src_id, tag=self._tag(tag, _TAG_DATA))
            self.backend.mpi_finish(buf, out_arr)
            return out_arr
        fut._finish = finish_header
        return fut

    # -- collectives ---------------------------------------------------------------------------
    def all_reduce(self, arr, op: str = "sum", group=None, out=None):
        """Element-wise reduction over the group, result on every rank (MPI Allreduce).

        op: 'sum', 'avg' (sum / group size), 'max', 'min'. Adjoint of a sum over replicas:
        all_reduce(sum) backward; adjoint of 'avg' is 'avg'.
        out: a reused result buffer (no allocation per call); `out=arr` reduces in place
        (MPI_IN_PLACE, no second buffer).
        """
        t0 = time.perf_counter()
        a, out, comm, n = self._all_reduce_args(arr, op, group, out, pooled=True)
        sbuf = MPI.IN_PLACE if out is a else self.backend.mpi_buffer(a)
        rbuf = self.backend.mpi_buffer(out, slot="recv")
        comm.Allreduce(sbuf, rbuf, op=_OPS[op])
        self.backend.mpi_finish(rbuf, out)
        if op == "avg" and n > 1:
            out /= n
        self._count("all_reduce", 2 * (n - 1) / n * a.nbytes, t0)
        return out

    def _all_reduce_args(self, arr, op, group, out, pooled=False):
        """(input, result buffer, communicator, group size); the result `is` the input when
        reducing in place (`out=arr`, which must then be C-contiguous)."""
        comm = self.mesh.comm(group)
        if self.debug:
            self._check(comm, "all_reduce", self.xp.asarray(arr), op)
        if op not in _OPS:
            raise ValueError(f"all_reduce op must be one of {list(_OPS)}, got {op!r}")
        a = arr if out is not None and out is arr else self._prepare(arr)
        if op == "avg" and a.dtype.kind not in "fc":
            raise TypeError(f"all_reduce(op='avg') needs a floating dtype, got {a.dtype}")
        if out is None:
            out = self._result_buffer(a.shape, a.dtype) if pooled else self.xp.empty_like(a)
        elif out.shape != a.shape or out.dtype != a.dtype or not out.flags.c_contiguous:
            raise ValueError(f"all_reduce: out= must be C-contiguous with shape {a.shape} and "
                             f"dtype {a.dtype}, got shape {out.shape} and dtype {out.dtype}")
        _dtype_code(a.dtype)
        return a, out, comm, comm.Get_size()

    def all_reduce_async(self, arr, op: str = "sum", group=None, out=None) -> Future:
        """Non-blocking all_reduce (MPI Iallreduce); `result()` waits and returns the array.

        Same ops and adjoint as all_reduce; `out=arr` reduces in place. Neither `arr` nor `out`
        may be touched until the Future completes. The gradient sync issues one per bucket
        while the backward of earlier layers runs. Bytes are counted when the call is issued
        (the all_reduce formula, under 'all_reduce'); comm_time counts the issue only.
        """
        t0 = time.perf_counter()
        reused = out is not None               # a caller's buffer: its staging copy is kept
        a, out, comm, n = self._all_reduce_args(arr, op, group, out)
        # GPU staging without CUDA-aware MPI: one kept host buffer per caller-owned result;
        # a fresh one otherwise, so the staging dict does not grow with every call
        slot = f"iallreduce-{id(out)}" if reused else None
        sbuf = MPI.IN_PLACE if out is a else self.backend.mpi_buffer(a, slot=None)
        rbuf = self.backend.mpi_buffer(out, slot=slot)
        req = comm.Iallreduce(sbuf, rbuf, op=_OPS[op])

        def finish():
            self.backend.mpi_finish(rbuf, out)
            if op == "avg" and n > 1:
                self.xp.divide(out, n, out=out)
            return out
        self._count("all_reduce", 2 * (n - 1) / n * a.nbytes, t0)
        return Future([req], finish, keep=(a, sbuf, rbuf))

    def _gather_args(self, arr, axis, group, uneven=False):
        """(arr with `axis` moved first, contiguous; the axis normalised; communicator; group
        size) for all_gather(_async); a 0-d array gathers as shape (1,). `uneven`: lengths
        along `axis` may differ, so debug mode leaves them out of the comparison."""
        a = self.xp.asarray(arr)
        if a.ndim == 0:
            a = a.reshape(1)
        comm = self.mesh.comm(group)
        self._check(comm, "all_gather", a, axis=axis, skip_axis=uneven)
        axis = self._norm_axis(a, axis)
        return self._prepare(self.xp.moveaxis(a, axis, 0)), axis, comm, comm.Get_size()

    def all_gather(self, arr, axis: int = 0, group=None):
        """Concatenate the group's arrays along `axis` (MPI Allgather / Allgatherv).

        Lengths along `axis` may differ between ranks (they are exchanged first); the other
        dimensions must agree. Adjoint: reduce_scatter(sum) along the same axis.
        """
        t0 = time.perf_counter()
        xp = self.xp
        moved, axis, comm, n = self._gather_args(arr, axis, group, uneven=True)  # (len_i, ...rest)
        rest = moved.shape[1:]
        row = int(np.prod(rest, dtype=np.int64))
        lens = np.empty(n, dtype=np.int64)
        comm.Allgather(np.array([moved.shape[0]], dtype=np.int64), lens)
        out = xp.empty((int(lens.sum()),) + rest, dtype=moved.dtype)
        sbuf = self.backend.mpi_buffer(moved)
        rbuf = self.backend.mpi_buffer(out, slot="recv")
        if (lens == lens[0]).all():
            comm.Allgather(sbuf, rbuf)
        else:
            counts = lens * row
            displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
            comm.Allgatherv(sbuf, [rbuf, counts, displs, MPI._typedict[moved.dtype.char]])
        self.backend.mpi_finish(rbuf, out)
        self._count("all_gather", (n - 1) / n * out.nbytes, t0)
        return xp.moveaxis(out, 0, axis) if axis != 0 else out

    def all_gather_async(self, arr, axis: int = 0, group=None) -> Future:
        """Non-blocking all_gather (MPI Iallgather); `result()` waits and returns the array.

        Every rank must pass the same shape (equal lengths along `axis`: no lengths are
        exchanged; debug mode checks it); `arr` must not be modified until the Future
        completes, which keeps the send and receive buffers alive. FSDP's prefetch gathers the
        next layer's weight with it while the current layer computes. Adjoint:
        reduce_scatter(sum) along the same axis. Bytes are counted when the call is issued
        (the all_gather formula, under 'all_gather'); comm_time counts the issue only.
        """
        t0 = time.perf_counter()
        xp = self.xp
        moved, axis, comm, n = self._gather_args(arr, axis, group)  # (len, ...rest), same on all
        out = xp.empty((n * moved.shape[0],) + moved.shape[1:], dtype=moved.dtype)
        sbuf = self.backend.mpi_buffer(moved, slot=None)    # fresh staging: several in flight
        rbuf = self.backend.mpi_buffer(out, slot=None)
        req = comm.Iallgather(sbuf, rbuf)

        def finish():
            self.backend.mpi_finish(rbuf, out)
            return xp.moveaxis(out, 0, axis) if axis != 0 else out
        self._count("all_gather", (n - 1) / n * out.nbytes, t0)
        return Future([req], finish, keep=(moved, sbuf, out, rbuf))

    def reduce_scatter(self, arr, op: str = "sum", axis: int = 0, group=None):
        """Reduce over the group, then rank i keeps block i along `axis` (Reduce_scatter).

        Blocks follow numpy.array_split, so a length not divisible by the group size is
        allowed (the first blocks are one longer). Adjoint: all_gather along the same axis.
        """
        t0 = time.perf_counter()
        xp = self.xp
        a = xp.asarray(arr)
        comm = self.mesh.comm(group)
        self._check(comm, "reduce_scatter", a, op, axis=axis)
        if op not in ("sum", "avg"):
            raise ValueError(f"reduce_scatter op must be 'sum' or 'avg', got {op!r}")
        axis = self._norm_axis(a, axis)
        n, r = comm.Get_size(), comm.Get_rank()
        moved = self._prepare(xp.moveaxis(a, axis, 0))
        length, rest = moved.shape[0], moved.shape[1:]
        row = int(np.prod(rest, dtype=np.int64))
        lens = [length // n + (1 if i < length % n else 0) for i in range(n)]
        out = self._result_buffer((lens[r],) + rest, moved.dtype)
        sbuf = self.backend.mpi_buffer(moved)
        rbuf = self.backend.mpi_buffer(out, slot="recv")
        if length % n == 0:
            comm.Reduce_scatter_block(sbuf, rbuf, op=MPI.SUM)
        else:
            comm.Reduce_scatter(sbuf, rbuf, [c * row for c in lens], op=MPI.SUM)
        self.backend.mpi_finish(rbuf, out)
        if op == "avg" and n > 1:
            if out.dtype.kind not in "fc":
                raise TypeError(f"reduce_scatter(op='avg') needs a floating dtype, got {out.dtype}")
            out /= n
        self._count("reduce_scatter", (n - 1) / n * moved.nbytes, t0)
        return xp.moveaxis(out, 0, axis) if axis != 0 else out

    def all_to_all(self, arr, axis: int = 0, group=None):
        """Split `arr` into group-size blocks along `axis`; block j goes to rank j, and the
        received blocks are concatenated along `axis` in rank order (MPI Alltoall).
        Adjoint: all_to_all along the same axis (the exchange undoes itself).
        """
        t0 = time.perf_counter()
        xp = self.xp
        a = xp.asarray(arr)
        comm = self.mesh.comm(group)
        self._check(comm, "all_to_all", a, axis=axis)
        axis = self._norm_axis(a, axis)
        n = comm.Get_size()
        if a.shape[axis] % n:
            raise ValueError(f"all_to_all: length {a.shape[axis]} along axis {axis} is not "
                             f"divisible by the group size {n}")
        moved = self._prepare(xp.moveaxis(a, axis, 0))
        out = self._result_buffer(moved.shape, moved.dtype)
        sbuf = self.backend.mpi_buffer(moved)
        rbuf = self.backend.mpi_buffer(out, slot="recv")
        comm.Alltoall(sbuf, rbuf)
        self.backend.mpi_finish(rbuf, out)
        self._count("all_to_all", (n - 1) / n * moved.nbytes, t0)
        return xp.moveaxis(out, 0, axis) if axis != 0 else out

    def all_to_all_v(self, arr, send_counts, group=None, recv_counts=None):
        """Variable-count exchange along axis 0 (MPI Alltoallv).

        `send_counts[j]` rows of `arr` (consecutive, in rank order) go to rank j. The counts are
        exchanged first, unless the caller already knows `recv_counts` (e.g. the reverse of an
        earlier exchange); returns (received rows concatenated in source-rank order,
        recv_counts). Adjoint: all_to_all_v of the gradient with send and receive counts
        swapped.
        """
        t0 = time.perf_counter()
        xp = self.xp
        comm = self.mesh.comm(group)
        n = comm.Get_size()
        if self.debug:
            self._check(comm, "all_to_all_v", xp.asarray(arr), axis=0, skip_axis=True)
        a = self._prepare(arr)
        sc = np.ascontiguousarray(np.asarray(send_counts, dtype=np.int64))
        bad = None
        if sc.shape != (n,) or sc.sum() != a.shape[0] or (sc < 0).any():
            bad = (f"all_to_all_v: send_counts {sc.tolist()} must be {n} non-negative "
                   f"counts summing to the {a.shape[0]} rows given")
        if self.debug:          # counts are this rank's own: agree, so no rank waits alone
            self.agree(bad is None, f"group rank {comm.Get_rank()}: {bad}", group=group)
        elif bad is not None:
            raise ValueError(bad)
        if recv_counts is None:
            rc = np.empty(n, dtype=np.int64)
            comm.Alltoall(sc, rc)
        else:
            rc = np.ascontiguousarray(np.asarray(recv_counts, dtype=np.int64))
        rest = a.shape[1:]
        row = int(np.prod(rest, dtype=np.int64))
        out = xp.empty((int(rc.sum()),) + rest, dtype=a.dtype)
        sdis = np.concatenate([[0], np.cumsum(sc)[:-1]]) * row
        rdis = np.concatenate([[0], np.cumsum(rc)[:-1]]) * row
        mtype = MPI._typedict[a.dtype.char]
        sbuf = self.backend.mpi_buffer(a)
        rbuf = self.backend.mpi_buffer(out, slot="recv")
        comm.Alltoallv([sbuf, sc * row, sdis, mtype], [rbuf, rc * row, rdis, mtype])
        self.backend.mpi_finish(rbuf, out)
        me = comm.Get_rank()
        self._count("all_to_all", (sc.sum() - sc[me]) * row * a.itemsize, t0)
        return out, rc

    def broadcast(self, arr, root: int = 0, group=None):
        """Every rank gets root's array (MPI Bcast). Non-root ranks may pass None: shape and
        dtype come from root. Adjoint: reduce(sum) to root.
        """
        t0 = time.perf_counter()
        comm = self.mesh.comm(group)
        self._check(comm, "broadcast", None, axis=root)
        error = None
        if comm.Get_rank() == root:
            try:
                a = self._prepare(arr)
                h = self._header(a)
            except (TypeError, ValueError) as exc:   # root's mistake: raised on every rank
                error = exc
                h = np.full(_HEADER, -1 if isinstance(exc, TypeError) else -2, dtype=np.int64)
        else:
            h = np.empty(_HEADER, dtype=np.int64)
        comm.Bcast(h, root=root)
        if h[0] < 0:
            msg = comm.bcast(str(error) if error is not None else None, root=root)
            raise (TypeError if h[0] == -1 else ValueError)(f"broadcast from group rank "
                                                              f"{root}: {msg}")
        if comm.Get_rank() != root:
            shape = tuple(int(d) for d in h[2:2 + int(h[1])])
            a = self.xp.empty(shape, dtype=_DTYPES[int(h[0])])
        buf = self.backend.mpi_buffer(a, slot="bcast")
        comm.Bcast(buf, root=root)
        self.backend.mpi_finish(buf, a)
        n = comm.Get_size()
        self._count("broadcast", (n - 1) / n * a.nbytes if comm.Get_rank() == root else 0, t0)
        return a

    def agree(self, ok: bool, message: str = "", group=None) -> None:
        """Collective error check: if `ok` is False on any rank, every rank raises ValueError
        with the first failing rank's message (no rank is left waiting in a collective)."""
        comm = self.mesh.comm(group)
        flag = np.array([0 if ok else 1], dtype=np.int64)
        total = np.empty(1, dtype=np.int64)
        comm.Allreduce(flag, total, op=MPI.SUM)
        if total[0]:
            msgs = comm.allgather(None if ok else message)   # small control data only
            first = next(m for m in msgs if m is not None)
            raise ValueError(first)

    # -- model lifecycle -----------------------------------------------------------------------
    @abstractmethod
    def load_checkpoint(self, params: dict) -> None:
        ...

    @abstractmethod
    def forward(self, x):
        ...

    @abstractmethod
    def backward(self, grads) -> dict:
        ...

    def inference_loop(self, input_stream, output_stream) -> None:
        """Forward every array of `input_stream`, writing results to `output_stream`; returns
        on every rank when the input is exhausted (pipelines override this)."""
        for x in iter(input_stream):
            output_stream.write(self.predict(x) if hasattr(self, "predict") else self.forward(x))

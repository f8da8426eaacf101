"""Point-to-point transfers (Send/Recv, Isend/Irecv) of arrays of any shape and dtype.

A message is a header (dtype code, ndim, shape: 12 int64 words) followed by the data, both
with mpi4py's buffer methods, so arrays never go through pickle. The three-argument form
`send_async(src, dst, target)` sends no header: the receiver names the buffer it fills.

    send(dest)   forward  <->  receive(dest)   backward (the gradient travels the other way)

`PointToPoint` is a mixin of `collectives.Comm`: it uses the host's `_mpi(group)`,
`prepare(arr)`, `backend` (device staging), `xp`, `stats` and `watchdog` (every wait, blocking
send and receive included: waits.py; the engine's watchdog gives up after the timeout).
"""
from __future__ import annotations

import functools
import time

import numpy as np
from mpi4py import MPI

from .recorded import recorded
from .staging import BF16


DTYPES = [np.dtype(t) for t in ("float64", "float32", "int64", "int32", "float16", "uint8",
                                "bool", "complex128", "complex64")] + [BF16]
HEADER_WORDS = 12            # int64 words: dtype code, ndim, up to 10 dims
MAX_DIMS = HEADER_WORDS - 2
_TAG_HEADER, _TAG_DATA, _TAG_RAW = 0, 1, 2


CODES = {dtype: code for code, dtype in enumerate(DTYPES)}


def dtype_code(dtype) -> int:
    """Index of `dtype` in DTYPES (the wire code); TypeError naming the supported ones."""
    code = CODES.get(dtype)                 # a numpy dtype: one dict look-up per call
    if code is None:
        code = CODES.get(np.dtype(dtype))   # a name or type ('float32', np.float32)
    if code is None:
        raise TypeError(f"dtype {np.dtype(dtype)} is not supported for MPI transfer; use one "
                        f"of {[str(d) for d in DTYPES]}")
    return code


def no_bf16_sum(dtype, what: str) -> None:
    """TypeError for a reduction of bfloat16 (MPI would sum its words as float16): the same
    on every rank, before any communication. 16-bit gradients reduce through
    parallel/precision.py's LowPrecisionComm (an all_to_all of the words, a float32 sum)."""
    if dtype == BF16:
        raise TypeError(f"{what} of a bfloat16 array: MPI has no bfloat16 sum; reduce it in "
                        f"float32 (LowPrecisionComm does)")


def header(a) -> np.ndarray:
    """The header that travels before `a`: dtype code, ndim, shape."""
    ndim = a.ndim
    if ndim > MAX_DIMS:
        raise ValueError(f"send supports up to {MAX_DIMS} dims, got {ndim}")
    words = [dtype_code(a.dtype), ndim, *a.shape] + [0] * (MAX_DIMS - ndim)
    return np.array(words, dtype=np.int64)


def header_shape(h) -> tuple:
    """(shape, dtype) described by a received header."""
    words = h.tolist()
    return tuple(words[2:2 + words[1]]), DTYPES[words[0]]


def wire_tag(tag, kind) -> int:
    """The MPI tag of a user tag's header, data or raw message (3 per user tag)."""
    # a negative tag would map onto MPI_ANY_TAG (-1) or an invalid tag
    if isinstance(tag, bool) or not isinstance(tag, (int, np.integer)) or tag < 0:
        raise ValueError(f"tag must be an integer >= 0, got {tag!r}")
    return 3 * int(tag) + kind


class Future:
    """A pending non-blocking transfer (Isend/Irecv). `result()` waits, `done()` polls.

    finish: run once on completion, its value is the result. release: run after it, e.g. to
    hand this request's host staging buffers back to the Backend's pool. wait: how `result()`
    waits for the requests (the Comm's watchdog: bounded; default MPI Waitall); test: how
    `done()` polls them (default MPI Testall; an NCCL operation's event: nccl.py).
    `Future.in_flight` counts the Futures of this process not yet completed (the soak test,
    benchmarks/soak.py, checks it returns to 0: no request left pending).
    """

    in_flight = 0

    def __init__(self, requests, finish=None, keep=(), release=None, wait=None, test=None):
        Future.in_flight += 1
        self._requests = list(requests)
        self._wait = wait or MPI.Request.Waitall
        self._test = test or MPI.Request.Testall
        self._finish = finish
        self._release = release
        self._keep = keep  # buffers that must stay alive until completion
        self._value = None
        self._done = False

    def done(self) -> bool:
        if self._done:
            return True
        if self._test(self._requests):
            self._complete()
        return self._done

    def result(self):
        if not self._done:
            self._wait(self._requests)
            self._complete()
        return self._value

    wait = result

    def _complete(self):
        self._done = True
        Future.in_flight -= 1
        finish, release = self._finish, self._release
        # let go of the callables: a finish that names its own Future (receive_async's) is a
        # reference cycle, and it held every received array until the garbage collector ran
        # (receives in a loop then each took a fresh heap block instead of reusing one)
        self._finish = self._release = self._wait = self._test = None
        self._value = finish() if finish is not None else None
        if release is not None:
            release()
        self._keep = ()


class PointToPoint:
    """send / receive / send_async / receive_async, with `group=` naming a mesh axis."""

    @recorded
    def send(self, dest_id: int, arr, tag: int = 0, group=None) -> None:
        """Blocking send of `arr` (any shape/dtype) to `dest_id`; adjoint: receive."""
        t0 = time.perf_counter()
        a = self.prepare(arr)
        comm = self._mpi(group)
        nccl = self._nccl(a)
        if nccl is not None:                         # the header over MPI, the data NCCL's
            h, message = header(a), nccl.queue("send", a, comm, dest_id)
            h[-1] = message.seq
            self.watchdog.wait_peer([comm.Isend(h, dest=dest_id, tag=wire_tag(tag, _TAG_HEADER))],
                                    "send", comm, dest_id)
            nccl.wait_message(message, self.watchdog, "send")
            self.stats.count("send", a.nbytes, t0)
            return
        buf = self.backend.mpi_buffer(a)
        h = header(a)
        self.watchdog.wait_peer([comm.Isend(h, dest=dest_id, tag=wire_tag(tag, _TAG_HEADER)),
                                 comm.Isend(buf, dest=dest_id, tag=wire_tag(tag, _TAG_DATA))],
                                "send", comm, dest_id)
        self.stats.count("send", a.nbytes, t0)

    def make_device_comms(self, groups) -> None:
        """Make the NCCL communicators of `groups` (mesh axes) now, at a line every rank
        reaches (parallel/compose.py); without NCCL, or for a group of one, nothing."""
        transport = self.backend.device_transport
        for group in groups if transport is not None else ():
            comm = self._mpi(group)
            if comm.Get_size() > 1:
                transport.communicator(comm, self.watchdog)

    def _nccl(self, a):
        """The Backend's NCCL transport when it moves `a`, else None (MPI does: nccl.py)."""
        transport = self.backend.device_transport
        return transport if transport is not None and transport.handles(a) else None

    def _nccl_future(self, nccl, message, what, finish=None, requests=(), keep=()):
        """A Future of an NCCL send or receive (after `requests`, its MPI header's)."""
        wd = self.watchdog

        def wait(reqs):
            if reqs:
                wd.wait_peer(reqs, what, message.comm, message.peer)
            nccl.wait_message(message, wd, what)
        return Future(requests, finish, keep=keep, wait=wait,
                      test=lambda reqs: MPI.Request.Testall(reqs) and message.done())

    @recorded
    def receive(self, src_id: int, tag: int = 0, group=None):
        """Blocking receive of an array sent with `send`; shape and dtype travel with it."""
        return self.receive_async(src_id, tag=tag, group=group).result()

    @recorded
    def send_async(self, arr, dst=None, target_device_id=None, *, dest=None, tag: int = 0,
                   group=None) -> Future:
        """Non-blocking send (Isend); returns a Future.

        Two forms: `send_async(arr, dest)` (the receiver calls `receive_async(src)` and learns
        shape and dtype from a header), and the three-argument form `send_async(src, dst,
        target_device_id)` where `dst` is the buffer the target receives into
        (`receive_async(src, out=dst)`), so no header is sent and the message lands without an
        extra copy.
        """
        t0 = time.perf_counter()
        a = self.prepare(arr)
        comm = self._mpi(group)
        nccl = self._nccl(a)
        if nccl is not None:
            return self._hold(self._nccl_send_async(nccl, a, comm, dst, target_device_id,
                                                    dest, tag, t0))
        buf = self.backend.mpi_buffer(a, slot=None)      # this request's own staging
        release = functools.partial(self.backend.release, buf)
        if target_device_id is not None:                 # (src, dst_buffer, target) form
            req = comm.Isend(buf, dest=target_device_id, tag=wire_tag(tag, _TAG_RAW))
            self.stats.count("send", a.nbytes, t0)
            return self._hold(Future([req], keep=(a, buf), release=release,
                                     wait=self.watchdog.waiter("send", comm,
                                                               rank=target_device_id)))
        dest = dst if dest is None else dest
        if dest is None or not isinstance(dest, (int, np.integer)):
            raise TypeError("send_async(arr, dest) needs an integer destination rank")
        h = header(a)
        reqs = [comm.Isend(h, dest=int(dest), tag=wire_tag(tag, _TAG_HEADER)),
                comm.Isend(buf, dest=int(dest), tag=wire_tag(tag, _TAG_DATA))]
        self.stats.count("send", a.nbytes, t0)
        return self._hold(Future(reqs, keep=(a, buf, h), release=release,
                                 wait=self.watchdog.waiter("send", comm, rank=int(dest))))

    def _nccl_send_async(self, nccl, a, comm, dst, target, dest, tag, t0) -> Future:
        """send_async's two forms through NCCL: a header over MPI unless a buffer is named."""
        self.stats.count("send", a.nbytes, t0)
        if target is not None:
            message = nccl.queue("send", a, comm, target)
            nccl.issue_send(message, self.watchdog)
            return self._nccl_future(nccl, message, "send", keep=(a,))
        dest = dst if dest is None else dest
        if dest is None or not isinstance(dest, (int, np.integer)):
            raise TypeError("send_async(arr, dest) needs an integer destination rank")
        h, message = header(a), nccl.queue("send", a, comm, int(dest))
        h[-1] = message.seq                               # its number, checked at the receiver
        req = comm.Isend(h, dest=int(dest), tag=wire_tag(tag, _TAG_HEADER))
        nccl.issue_send(message, self.watchdog)           # the header first, then the data
        return self._nccl_future(nccl, message, "send", requests=[req], keep=(a, h))

    def _hold(self, fut: Future) -> Future:
        """Keep a send's Future (and so its buffers) alive until MPI has completed it, even
        if the caller drops it: a dropped Future would free the send buffer while MPI still
        reads it (caught at one rank: a send to self whose buffer's memory was reused by the
        matching receive). Completed ones are let go at the next send."""
        self.sends_in_flight[:] = [f for f in self.sends_in_flight if not f.done()]
        self.sends_in_flight.append(fut)
        return fut

    @recorded
    def receive_async(self, src_id: int, out=None, tag: int = 0, group=None) -> Future:
        """Non-blocking receive (Irecv); `result()` returns the array.

        With `out=` the message (sent by the three-argument send_async) lands in that buffer.
        """
        comm = self._mpi(group)
        if out is not None:
            return self._receive_into(comm, src_id, out, tag)
        if self.backend.device_transport is not None:
            return self._nccl_receive(self.backend.device_transport, comm, src_id, tag)
        h = np.empty(HEADER_WORDS, dtype=np.int64)
        req = comm.Irecv(h, source=src_id, tag=wire_tag(tag, _TAG_HEADER))
        # Headers match the receives in posting order, and so must the data messages (the
        # blocking Recv below): a later receive from the same source and tag finishes the
        # earlier ones first, whatever order result()/done() are called in.
        key = (comm.py2f(), src_id, int(tag))
        queue = self.pending_receives.setdefault(key, [])
        fut = Future([req], keep=(h,), wait=self.watchdog.waiter("receive", comm, rank=src_id))
        queue.append(fut)

        def finish_header():
            while queue[0] is not fut:
                queue[0].result()
            queue.pop(0)
            if not queue:        # the last pending receive of this key: forget the key
                del self.pending_receives[key]
            shape, dtype = header_shape(h)
            out_arr = self.xp.empty(shape, dtype=dtype)
            buf = self.backend.mpi_buffer(out_arr, slot="recv", read=False)
            self.watchdog.wait_peer(
                [comm.Irecv(buf, source=src_id, tag=wire_tag(tag, _TAG_DATA))],
                "receive", comm, src_id)
            self.backend.mpi_finish(buf, out_arr)
            return out_arr
        fut._finish = finish_header
        return fut

    def _nccl_receive(self, nccl, comm, src_id, tag) -> Future:
        """receive_async on the NCCL path: the header over MPI, the data queued in posting
        order (nccl.py); the data goes by MPI when NCCL lacks the header's dtype."""
        h = np.empty(HEADER_WORDS, dtype=np.int64)
        req = comm.Irecv(h, source=src_id, tag=wire_tag(tag, _TAG_HEADER))
        got = []

        def resolve(block):
            if not block:
                return bool(got) or req.Test()
            if got:
                return got[0] if nccl.handles(got[0]) else None
            self.watchdog.wait_peer([req], "receive", comm, src_id)
            shape, dtype = header_shape(h)
            message.seq = int(h[-1])
            got.append(self.xp.empty(shape, dtype=dtype))
            return got[0] if nccl.handles(got[0]) else None
        message = nccl.queue("recv", None, comm, src_id, resolve=resolve)
        message.header = req                    # cancelled if a wait for it times out

        def finish():
            if not message.by_mpi:
                return got[0]
            buf = self.backend.mpi_buffer(got[0], slot="recv", read=False)
            self.watchdog.wait_peer([comm.Irecv(buf, source=src_id, tag=wire_tag(tag, _TAG_DATA))],
                                    "receive", comm, src_id)
            self.backend.mpi_finish(buf, got[0])
            return got[0]
        return self._nccl_future(nccl, message, "receive", finish=finish, keep=(h,))

    def _receive_into(self, comm, src_id, out, tag) -> Future:
        """The three-argument form's receive: no header, the data lands in `out`."""
        if not out.flags.c_contiguous:
            raise ValueError("receive_async(out=...) needs a C-contiguous buffer")
        nccl = self._nccl(out)
        if nccl is not None:
            return self._nccl_future(nccl, nccl.queue("recv", out, comm, src_id), "receive",
                                     finish=lambda: out, keep=(out,))
        # a host buffer of this request's own: two receives in flight never share one
        buf = self.backend.mpi_buffer(out, slot=None, read=False)
        req = comm.Irecv(buf, source=src_id, tag=wire_tag(tag, _TAG_RAW))

        def finish():
            self.backend.mpi_finish(buf, out)
            return out
        return Future([req], finish, keep=(buf,), wait=self.watchdog.waiter(
            "receive", comm, rank=src_id), release=functools.partial(self.backend.release, buf))

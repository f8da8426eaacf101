"""NCCL: a mesh group's device collectives and point-to-point messages through NCCL.

When the Backend's GPU communication path is "nccl" (backend.py says how it is chosen), the
Comm hands device arrays of a dtype NCCL has to `NcclTransport` instead of MPI: all_reduce
(sum, avg, max, min), all_gather and reduce_scatter (equal blocks), all_to_all, broadcast, and
send/receive. MPI stays the control plane: it launched the job, bootstraps each NCCL
communicator, carries the headers of messages, the lengths all_gather exchanges, agreement,
the watchdog's arrival counters, checkpoints and host arrays; uneven blocks, all_to_all_v and
dtypes NCCL lacks (bool, complex) keep going through MPI.

- Three NCCL communicators per MPI group, made on the group's first device call: the
  group's rank 0 makes three unique ids, MPI broadcasts them, every member builds
  `NcclCommunicator(size, id, rank)` for each: the collectives' and the two lanes' below.
  The engine makes them up front for every mesh axis (parallel/compose.py, at a line every
  rank reaches: on first use a later pipeline stage would join only once a message came
  that needs them). Elsewhere (a Comm of one's own) a member's first call makes them: a
  collective, a send_async, or a wait for a receive (before its header is polled for); the
  members must reach it without waiting for each other through other messages.
- NCCL works on a stream: a collective is queued on the current stream (a message on its
  lane's), then the host waits for an event recorded after it, polled under the engine's
  timeout (health/watchdog.py). Past the timeout the group's communicators are aborted and
  the same CollectiveTimeout as MPI's is raised, naming the late ranks from the watchdog's
  arrival counters (a peer's name for a message).
- Non-blocking all_reduce and all_gather run on a side stream, so the backward's kernels,
  queued on the current stream meanwhile, overlap them; the next operation on the current
  stream first waits for the side stream's last one (one order per communicator, as NCCL needs).
- Sends and receives go through the group's two lane communicators: "up" carries the
  messages to a higher group rank (and to itself), "down" those to a lower one, each on a
  stream of its own that first waits for the compute stream's work so far. NCCL runs a
  stream's operations one after the other and a send completes only once its receive runs,
  so on one stream two ranks that each issue a send before the receive of the other's
  message wait for each other forever (a pipeline's activation and gradient crossing; a
  ring's exchange). On a lane a link carries messages one way, matched in issue order, so
  two linked ranks' first unfinished groups never wait for each other: either both hold the
  link's next message and run together, or the receiver's holds nothing from the sender.
  Waits then follow the lane's links one way each, and where each lane's links form a
  forest they cannot close a cycle, however the messages fall into groups: a pipeline's
  (a chain each way) and a ring's ("up" a chain, "down" the one wrap-around link). Not
  covered: lanes whose links close a cycle (an interleaved pipeline of 3+ stages adds its
  wrap-around links, last to first stage on "down" and first to last on "up", beside the
  neighbours'); a message to itself sent in a group without its receive (NCCL needs both in
  one group: the engine sends none). NCCL's documentation asks that operations on several
  communicators be issued in the same order on every rank or fit on the GPU side by side;
  the lanes rely on the latter (a few thread blocks each), and a device-wide
  synchronization meanwhile (a lazy connection set-up, a cudaFree) could still stall them.
- Queued sends and receives go to NCCL when a send_async is posted (unless to itself),
  a message is waited for or another NCCL operation is issued: every send, and the
  receives whose header came (a pair's in posting order), as one group per lane. A wait
  for a message whose receive lacks its header polls (one bound, the watchdog's) and
  issues every receive whose header comes meanwhile, so a peer waiting for one of them is
  not kept waiting. NCCL matches a pair's messages in issue order, not by tag: each header
  carries the send's number, and a receive that would take another send's data raises.

The module is cupy's `cupy.cuda.nccl`, or a stand-in given to the Backend (the test suite's
tests/nccl_double.py, which is strict about all of the above).
"""
from __future__ import annotations

import numpy as np

from .p2p import MAX_DIMS

UID_BYTES = 128
NCCL_TYPES = {"float64": "NCCL_FLOAT64", "float32": "NCCL_FLOAT32", "float16": "NCCL_FLOAT16",
              "int64": "NCCL_INT64", "int32": "NCCL_INT32", "uint8": "NCCL_UINT8",
              "int8": "NCCL_INT8"}


def try_import_nccl():
    """cupy's NCCL module when cupy is installed and finds a libnccl, else None."""
    try:
        from cupy.cuda import nccl

        if not getattr(nccl, "available", True):
            return None
        nccl.get_version()
        return nccl
    except Exception:  # ImportError, no libnccl, a broken CUDA install
        return None


def ptr(a) -> int:
    """The device address of a contiguous device array."""
    return a.data.ptr


class Message:
    """A queued send or receive: done once the event recorded after its group happened.

    resolve: a receive whose shape and dtype come in a header: `resolve(block=False)` says
    whether the header is here; `resolve(block=True)` waits for it (bounded) and returns the
    array to receive into, or None when NCCL lacks the dtype (then the data travels by MPI
    and the message is left out of NCCL's group).
    seq: a send's number among this rank's NCCL sends to the peer (it travels in the header);
    a receive's, the number its header carried (None without a header)."""

    def __init__(self, kind, comm, array, peer, resolve=None):
        self.kind, self.comm, self.array, self.peer = kind, comm, array, peer
        self.resolve = resolve
        self.seq = None
        self.header = None                # a receive's MPI request of its header
        self.event = None                 # set when its group is issued
        self.by_mpi = False               # resolved to a dtype NCCL lacks

    def ready(self) -> bool:
        """Can it be issued now (its size known)?"""
        return self.resolve is None or self.resolve(block=False)

    def done(self) -> bool:
        return self.by_mpi or (self.event is not None and self.event.done)


class Pending:
    """A queued NCCL operation: `done()` polls, `wait()` waits (bounded by the watchdog)."""

    def __init__(self, event, wait):
        self.event, self.wait = event, wait

    def done(self) -> bool:
        return self.event.done


class NcclTransport:
    """The device collectives of one Backend through NCCL (module docstring)."""

    def __init__(self, nccl, xp):
        self.nccl, self.xp = nccl, xp
        self.types = {np.dtype(k): getattr(nccl, v) for k, v in NCCL_TYPES.items()
                      if hasattr(nccl, v)}
        self.ops = {"sum": nccl.NCCL_SUM, "avg": nccl.NCCL_SUM, "max": nccl.NCCL_MAX,
                    "min": nccl.NCCL_MIN}
        self._comms: dict = {}            # id(mpi comm) -> (NcclCommunicator, mpi comm, lanes)
        self.queued: list = []            # Messages not yet issued
        self.counts: dict = {}            # (kind, id(comm), peer) -> messages so far
        self._side = None                 # the side stream of non-blocking collectives
        self._side_event = None           # its last operation

    def handles(self, a) -> bool:
        """Can NCCL move `a` (a device array of a dtype NCCL has)?"""
        return (a.dtype in self.types and isinstance(a, self.xp.ndarray)
                and a.ndim < MAX_DIMS)            # a header word left for the send's number

    # -- communicators ---------------------------------------------------------------------
    def communicator(self, comm, watchdog, lane=None):
        """The NCCL communicator of the MPI group `comm` (with `lane` "up" or "down": that
        lane's (communicator, stream)), all three bootstrapped on the group's first use."""
        entry = self._comms.get(id(comm))
        if entry is None:
            # cupy's unique id: 128 chars as a tuple of ints (signed or not by platform) up
            # to cupy 13, bytes in cupy 14 (seen on the H200); the last column says which
            uid = np.zeros((3, UID_BYTES + 1), np.int16)
            if comm.Get_rank() == 0:
                for row in uid:
                    made = self.nccl.get_unique_id()
                    raw = isinstance(made, (bytes, bytearray))
                    row[:-1] = np.frombuffer(bytes(made), np.uint8) if raw else made
                    row[-1] = raw
            watchdog.run(comm.Bcast, comm.Ibcast, (uid, 0), "nccl bootstrap", comm)

            def as_id(row):
                return (row[:-1].astype(np.uint8).tobytes() if row[-1]
                        else tuple(row[:-1].tolist()))

            def make():
                return [self.nccl.NcclCommunicator(comm.Get_size(), as_id(row),
                                                   comm.Get_rank()) for row in uid]
            made = (make() if watchdog.guard is None else       # init waits for every member
                    watchdog.call_with_deadline(make, (), "nccl init", comm))
            lanes = {name: (nc, self.xp.cuda.Stream(non_blocking=True))
                     for name, nc in zip(("up", "down"), made[1:])}
            entry = self._comms[id(comm)] = (made[0], comm, lanes)
        return entry[0] if lane is None else entry[2][lane]

    def close(self) -> None:
        """Destroy the communicators (engine.close()); a later call bootstraps new ones."""
        for entry in self._comms.values():
            for c in members(entry):
                c.destroy()
        self._comms.clear()
        self.queued.clear()

    def _abort(self, comm) -> None:
        entry = self._comms.pop(id(comm), None)
        for c in members(entry) if entry is not None else ():
            c.abort()

    def _stream(self):
        """The current stream, after the side stream's last operation (one order)."""
        stream = self.xp.cuda.get_current_stream()
        if self._side_event is not None:
            stream.wait_event(self._side_event)
            self._side_event = None
        return stream

    # -- waits -----------------------------------------------------------------------------
    def wait(self, event, comm, watchdog, what, ticket=None, peer=None) -> None:
        """Until `event` happened: at most the watchdog's timeout, then abort the group's
        communicators and raise CollectiveTimeout naming the late ranks (or the peer)."""
        watchdog.check_usable()
        if not watchdog.timeout:
            event.synchronize()
            return
        if watchdog.poll_until(lambda: event.done):
            return
        self._abort(comm)
        late = watchdog.late(comm, ticket) if peer is None else watchdog.peer_text(comm, peer)
        watchdog.timed_out(what, comm, late, [])

    def _run(self, comm, watchdog, what, call, side=False) -> Pending:
        """Issue `call(nccl_comm, stream_ptr)`; the side stream's when `side`."""
        self.flush(watchdog)
        nc = self.communicator(comm, watchdog)
        ticket = watchdog.arrive(comm)
        if side:
            if self._side is None:
                self._side = self.xp.cuda.Stream(non_blocking=True)
            self._side.wait_event(self.xp.cuda.get_current_stream().record())
            stream = self._side
        else:
            stream = self._stream()
        call(nc, stream.ptr)
        event = self.xp.cuda.Event()
        event.record(stream)
        if side:
            self._side_event = event
        return Pending(event, lambda: self.wait(event, comm, watchdog, what, ticket))

    # -- collectives -----------------------------------------------------------------------
    def all_reduce(self, a, out, op, comm, watchdog, what="all_reduce", wait=True):
        """`out` = the group's reduction of `a` (may be `a` itself); with wait=False its
        Pending is returned (a side-stream operation)."""
        pending = self._run(comm, watchdog, what, lambda nc, s: nc.allReduce(
            ptr(a), ptr(out), a.size, self.types[a.dtype], self.ops[op], s), side=not wait)
        return pending.wait() if wait else pending

    def all_gather(self, moved, out, comm, watchdog, what="all_gather", wait=True):
        """`out` = the group's equal-length blocks `moved`, in rank order."""
        pending = self._run(comm, watchdog, what, lambda nc, s: nc.allGather(
            ptr(moved), ptr(out), moved.size, self.types[moved.dtype], s), side=not wait)
        return pending.wait() if wait else pending

    def reduce_scatter(self, moved, out, comm, watchdog):
        """`out` = this rank's block of the group's sum of `moved` (equal blocks)."""
        self._run(comm, watchdog, "reduce_scatter", lambda nc, s: nc.reduceScatter(
            ptr(moved), ptr(out), out.size, self.types[moved.dtype], self.nccl.NCCL_SUM,
            s)).wait()

    def broadcast(self, a, root, comm, watchdog) -> None:
        """Root's `a` into every rank's `a`."""
        self._run(comm, watchdog, "broadcast", lambda nc, s: nc.bcast(
            ptr(a), a.size, self.types[a.dtype], root, s)).wait()

    def all_to_all(self, moved, out, comm, watchdog) -> None:
        """Block j of `moved` to rank j; block i of `out` from rank i (one group of pairs)."""
        n, dtype = comm.Get_size(), self.types[moved.dtype]
        count = moved.size // n

        def exchange(nc, s):
            self.nccl.groupStart()
            try:
                for j in range(n):
                    nc.send(ptr(moved) + j * count * moved.itemsize, count, dtype, j, s)
                    nc.recv(ptr(out) + j * count * out.itemsize, count, dtype, j, s)
            finally:
                self.nccl.groupEnd()
        self._run(comm, watchdog, "all_to_all", exchange).wait()

    # -- point to point --------------------------------------------------------------------
    def queue(self, kind, array, comm, peer, resolve=None) -> Message:
        """Queue a send of `array` to (or a receive into it from) group rank `peer`."""
        message = Message(kind, comm, array, peer, resolve)
        if kind == "send":
            message.seq = self._count(kind, comm, peer)
        self.queued.append(message)
        return message

    def flush(self, watchdog, upto=None) -> None:
        """Issue the queued messages that are ready, in queue order, as one group per lane:
        every send, and the receives whose header is here and whose pair's earlier receives
        are ready too (NCCL matches a pair's messages in issue order). `upto`: a queued
        message to issue now; until it is, poll (bounded) for headers, issuing each receive
        whose header comes; past the timeout the group's communicators are aborted and
        CollectiveTimeout names the peer."""
        self._issue_or_requeue(self._take_ready(), watchdog)
        if upto is None or issued(upto):
            return
        self.communicator(upto.comm, watchdog)    # made before waiting (the sender may be in it)

        def step():
            for _, _, lanes in self._comms.values():    # a GPU runs its streams anyway
                for _, stream in lanes.values():
                    stream.done
            self._issue_or_requeue(self._take_ready(), watchdog)
            if not issued(upto) and all(m is not upto for m in self.queued):
                raise RuntimeError(f"an NCCL {upto.kind} with group rank {upto.peer} left the "
                                   "queue without being issued (an earlier error)")
            return issued(upto)
        if not watchdog.poll_peer_until(step, upto.comm):
            first = next((m for m in self.queued if m.kind == "recv" and m.comm is upto.comm
                          and m.peer == upto.peer and not m.ready()), upto)
            self._abort(upto.comm)
            watchdog.timed_out("receive", first.comm, watchdog.peer_text(first.comm, first.peer),
                               [first.header] if first.header is not None else [])

    def _issue_or_requeue(self, ready, watchdog) -> None:
        """_issue(ready); if it raises, what it did not issue goes back to the queue's head."""
        try:
            self._issue(ready, watchdog)
        except BaseException:
            self.queued = [m for m in ready if not issued(m)] + self.queued
            raise

    def issue_send(self, message, watchdog) -> None:
        """A send_async's data goes to NCCL at once (with what else is ready), so its receiver
        never waits for this rank's next NCCL call. A send to itself is left in the queue
        (NCCL needs its receive in the same group; a later flush may still issue it alone:
        the engine sends none)."""
        if message.peer != message.comm.Get_rank():
            self.flush(watchdog)

    def _take_ready(self) -> list:
        """The queued messages that can be issued now, taken off the queue."""
        ready, kept, blocked = [], [], set()
        for m in self.queued:
            pair = (id(m.comm), m.peer)
            if m.kind == "recv" and (pair in blocked or not m.ready()):
                blocked.add(pair)
                kept.append(m)
            else:
                ready.append(m)
        self.queued = kept
        return ready

    def _count(self, kind, comm, peer) -> int:
        key = (kind, id(comm), peer)
        self.counts[key] = self.counts.get(key, -1) + 1
        return self.counts[key]

    def _issue(self, exchange, watchdog) -> None:
        for m in exchange:
            if m.resolve is not None:
                m.array, m.resolve = m.resolve(block=True), None
            m.by_mpi = m.array is None
        exchange = [m for m in exchange if not m.by_mpi]
        for m in exchange:
            if m.kind == "recv":
                k = self._count("recv", m.comm, m.peer)
                if m.seq is not None and m.seq != k:
                    raise RuntimeError(
                        f"NCCL messages out of order: this rank's receive number {k} from group "
                        f"rank {m.peer} would take that rank's send number {k}, but its header "
                        f"is send number {m.seq}'s (NCCL matches a pair's messages in the order "
                        "they are issued, not by tag: post the receives in the sending order)")
        after = None                      # the compute stream's work so far, once
        while exchange:
            key = (exchange[0].comm, lane_of(exchange[0]))
            batch = [m for m in exchange if (m.comm, lane_of(m)) == key]
            exchange = [m for m in exchange if (m.comm, lane_of(m)) != key]
            nc, stream = self.communicator(key[0], watchdog, key[1])
            after = after or self.xp.cuda.get_current_stream().record()
            stream.wait_event(after)      # sends read what the compute stream wrote
            self.nccl.groupStart()
            try:
                for m in batch:
                    call = nc.send if m.kind == "send" else nc.recv
                    call(ptr(m.array), m.array.size, self.types[m.array.dtype], m.peer,
                         stream.ptr)
            finally:
                self.nccl.groupEnd()
            event = self.xp.cuda.Event()
            event.record(stream)
            for m in batch:
                m.event = event

    def wait_message(self, message, watchdog, what) -> None:
        """Until `message` completed (its group issued first if it is still queued)."""
        if message.event is None and not message.by_mpi:
            self.flush(watchdog, upto=message)
        if not message.by_mpi:
            self.wait(message.event, message.comm, watchdog, what, peer=message.peer)


def lane_of(m) -> str:
    """The lane of a message: "up" to a higher group rank (or to itself), else "down"."""
    me = m.comm.Get_rank()
    src, dst = (me, m.peer) if m.kind == "send" else (m.peer, me)
    return "up" if dst >= src else "down"


def members(entry) -> list:
    """The three NCCL communicators of a group's entry: the collectives' and the lanes'."""
    return [entry[0]] + [c for c, _ in entry[2].values()]


def issued(m) -> bool:
    """Has the message gone to NCCL (or to MPI: a dtype NCCL lacks)?"""
    return m.event is not None or m.by_mpi

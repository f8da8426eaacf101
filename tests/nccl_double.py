"""A strict CPU stand-in for `cupy.cuda.nccl`, built on mpi4py and the device double.

NCCL refuses two ranks on one GPU, so the test suite proves the NCCL code path
(mpishard/comm/nccl.py) on this module: `NcclModule(xp)` is injected as
`Backend(..., array_module=xp, nccl_module=NcclModule(xp))`, the way the device double stands
in for cupy. It offers the subset of cupy's API the engine uses (`get_unique_id`,
`NcclCommunicator(nranks, uid, rank)`, `groupStart`/`groupEnd`, the NCCL_* constants; a
communicator's allReduce, reduce, bcast, broadcast, reduceScatter, allGather, send, recv, abort,
destroy, rank_id, size, device_id), and is stricter than NCCL where NCCL would fail late:

- buffers are device pointers (`d.data.ptr`) read and written as raw memory, at the time the
  operation runs on its stream, not when it is issued;
- operations run on the stream they are given (tests/device_double.py's Stream): in order, one
  after the other finished, so a program whose ranks order their operations differently
  deadlocks here as it would on GPUs (the engine's watchdog then names the late ranks);
- sends are synchronous (MPI Issend: complete only once the receiver took the message), and
  send/recv outside a groupStart/groupEnd pair raise: the pairs a rank exchanges must be in one
  group, or the ordering deadlocks NCCL has are hidden;
- a receive whose size differs from the message's raises;
- communicators are bootstrapped from the unique id alone, as NCCL's are: the id names the
  rank that made it, which gathers the members over a private duplicate of COMM_WORLD;
- `calls` counts every call by name (the tests check the NCCL path was really taken).

Building an NcclModule is collective over COMM_WORLD (its bootstrap network).
"""
from __future__ import annotations

import collections
import ctypes

import numpy as np
from mpi4py import MPI

UID_BYTES = 128
BOOT_TAG = 30000              # + the id's serial number modulo 1000


class NcclError(RuntimeError):
    """What NCCL would report as an invalid usage or a failed operation."""


class NcclModule:
    """The stand-in for `cupy.cuda.nccl` over the device double `xp`."""

    NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_INT64 = 0, 1, 2, 4
    NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
    NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
    DTYPES = {0: np.int8, 1: np.uint8, 2: np.int32, 4: np.int64, 6: np.float16, 7: np.float32,
              8: np.float64}
    OPS = {0: MPI.SUM, 1: MPI.PROD, 2: MPI.MAX, 3: MPI.MIN}
    available = True

    def __init__(self, xp, world=None):
        self.xp = xp
        self.calls: collections.Counter = collections.Counter()
        self.boot = (world or MPI.COMM_WORLD).Dup()
        self._serial = 0
        self._group = None            # the operations of the open group: [(stream, op, owner)]
        self._depth = 0

    def get_version(self) -> int:
        return 22000

    id_as_bytes = True      # cupy 14 returns bytes (seen on the H200); cupy 13 a tuple

    def get_unique_id(self):
        """128 chars naming this rank (in the bootstrap network) and a serial number: bytes,
        or with id_as_bytes False a tuple of signed ints, as cupy 13 gave them."""
        self.calls["get_unique_id"] += 1
        self._serial += 1
        words = np.zeros(UID_BYTES // 8, np.int64)
        words[:2] = self.boot.Get_rank(), self._serial
        if self.id_as_bytes:
            return words.tobytes()
        return tuple(int(v) for v in words.view(np.int8))

    def groupStart(self) -> None:
        self.calls["groupStart"] += 1
        if self._depth == 0:
            self._group = []
        self._depth += 1

    def groupEnd(self) -> None:
        self.calls["groupEnd"] += 1
        if self._depth == 0:
            raise NcclError("groupEnd without groupStart")
        self._depth -= 1
        if self._depth:
            return
        ops, self._group = self._group, None
        if not ops:
            return
        streams = {id(stream) for stream, _, _ in ops}
        if len(streams) != 1:
            raise NcclError("the operations of one group must share a stream here")
        owners = {owner for _, _, owner in ops}
        ops[0][0].enqueue(_launch_all([op for _, op, _ in ops]),
                          owner=owners.pop() if len(owners) == 1 else None)

    def NcclCommunicator(self, ndev, commId, rank):      # noqa: N802 (cupy's name)
        return Communicator(self, ndev, commId, rank)

    def submit(self, comm, stream_ptr, op, p2p=False) -> None:
        """Queue `op` (launch -> (requests, on_done)) on its stream, or into the open group."""
        stream = self.xp.streams[stream_ptr]
        if self._group is not None:
            self._group.append((stream, op, comm))
        elif p2p:
            raise NcclError("send/recv outside a groupStart/groupEnd pair (the stand-in refuses "
                            "it: a lone blocking send hides NCCL's ordering deadlocks)")
        else:
            stream.enqueue(_launch_all([op]), owner=comm)


def _launch_all(ops):
    """One stream item: start every op at once, finished when all their requests are."""
    def launch():
        started = [op() for op in ops]
        requests = [req for reqs, _ in started for req in reqs]
        statuses = [MPI.Status() for _ in requests]

        def test():
            if not MPI.Request.Testall(requests, statuses):
                return False
            at = 0
            for reqs, on_done in started:
                on_done(statuses[at:at + len(reqs)])
                at += len(reqs)
            return True
        return test
    return launch


def memory(ptr: int, count: int, dtype) -> np.ndarray:
    """The `count` elements of `dtype` at device address `ptr` (the double's host memory)."""
    dtype = np.dtype(dtype)
    raw = (ctypes.c_char * (count * dtype.itemsize)).from_address(ptr)
    return np.frombuffer(raw, dtype=dtype, count=count)


class Communicator:
    """The stand-in for `cupy.cuda.nccl.NcclCommunicator` (module docstring)."""

    def __init__(self, module, ndev, uid, rank):
        module.calls["NcclCommunicator"] += 1
        self.module, self.ndev, self.rank = module, int(ndev), int(rank)
        if not 0 <= self.rank < self.ndev:
            raise NcclError(f"rank {rank} out of range for {ndev} ranks")
        raw = (np.frombuffer(uid, np.int8) if isinstance(uid, bytes)
               else np.array(uid, np.int8))
        root, serial = raw.view(np.int64)[:2].tolist()
        boot, tag = module.boot, BOOT_TAG + serial % 1000
        if self.rank == 0 and boot.Get_rank() != root:
            raise NcclError("rank 0 must be the rank that made the unique id")
        if self.ndev == 1:
            members = [boot.Get_rank()]
        elif self.rank == 0:
            members = [boot.Get_rank()] + [0] * (self.ndev - 1)
            for _ in range(self.ndev - 1):
                hello = np.empty(2, np.int64)
                boot.Recv(hello, source=MPI.ANY_SOURCE, tag=tag)
                members[int(hello[0])] = int(hello[1])
            for world_rank in members[1:]:
                boot.Ssend(np.array(members, np.int64), dest=world_rank, tag=tag)
        else:
            boot.Ssend(np.array([self.rank, boot.Get_rank()], np.int64), dest=root, tag=tag)
            got = np.empty(self.ndev, np.int64)
            boot.Recv(got, source=root, tag=tag)
            members = got.tolist()
        self.mpi = boot.Create_group(boot.Get_group().Incl(members), tag)
        self.aborted = False

    def rank_id(self) -> int:
        return self.rank

    def size(self) -> int:
        return self.ndev

    def device_id(self) -> int:
        return 0

    def check_async_error(self) -> None:
        self._usable("check_async_error")

    def abort(self) -> None:
        """Give up: the queued operations of this communicator are dropped, every later call
        raises (the MPI requests already started are left to complete or not)."""
        self.module.calls["abort"] += 1
        self.aborted = True
        for stream in self.module.xp.streams.values():
            stream.drop(self)

    def destroy(self) -> None:
        self.module.calls["destroy"] += 1
        self.aborted = True

    def _usable(self, name):
        self.module.calls[name] += 1
        if self.aborted:
            raise NcclError(f"{name} on an aborted or destroyed communicator")

    def _submit(self, name, stream, op, p2p=False):
        self._usable(name)
        self.module.submit(self, stream, op, p2p=p2p)

    def _type(self, datatype):
        return self.module.DTYPES[datatype]

    # -- collectives: each a non-blocking MPI collective on this communicator's own group ----
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):  # noqa: N802
        self._reduce_like("allReduce", sendbuf, recvbuf, count, count, datatype, stream,
                          lambda s, r: self.mpi.Iallreduce(s, r, op=self.module.OPS[op]))

    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        self._reduce_like("reduce", sendbuf, recvbuf, count, count, datatype, stream,
                          lambda s, r: self.mpi.Ireduce(s, r, op=self.module.OPS[op], root=root),
                          keep=self.rank == root)

    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):  # noqa: N802
        self._reduce_like("reduceScatter", sendbuf, recvbuf, recvcount * self.ndev, recvcount,
                          datatype, stream, lambda s, r: self.mpi.Ireduce_scatter_block(
                              s, r, op=self.module.OPS[op]))

    def allGather(self, sendbuf, recvbuf, count, datatype, stream):  # noqa: N802
        self._reduce_like("allGather", sendbuf, recvbuf, count, count * self.ndev, datatype,
                          stream, lambda s, r: self.mpi.Iallgather(s, r))

    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream, name="broadcast"):
        def start(s, r):
            if self.rank == root:
                r[...] = s
            return self.mpi.Ibcast(r, root=root)
        self._reduce_like(name, sendbuff, recvbuff, count, count, datatype, stream, start)

    def bcast(self, buff, count, datatype, root, stream):
        self.broadcast(buff, buff, count, datatype, root, stream, name="bcast")

    def _reduce_like(self, name, sendbuf, recvbuf, n_in, n_out, datatype, stream, start,
                     keep=True):
        dtype = self._type(datatype)

        def op():
            send = memory(sendbuf, n_in, dtype).copy()       # read when it runs
            recv = np.empty(n_out, dtype)
            req = start(send, recv)

            def on_done(_):
                if keep:
                    memory(recvbuf, n_out, dtype)[...] = recv
            return [req], lambda statuses: (on_done(statuses), send)
        self._submit(name, stream, op)

    # -- point to point: only inside a group, synchronous ------------------------------------
    def send(self, sendbuf, count, datatype, peer, stream):
        dtype = self._type(datatype)

        def op():
            data = memory(sendbuf, count, dtype).copy()
            return [self.mpi.Issend(data, dest=peer, tag=0)], lambda _: data
        self._submit("send", stream, op, p2p=True)

    def recv(self, recvbuf, count, datatype, peer, stream):
        dtype = self._type(datatype)

        def op():
            data = np.empty(count, dtype)
            req = self.mpi.Irecv(data, source=peer, tag=0)

            def on_done(statuses):
                got = statuses[0].Get_count(MPI.BYTE)
                if got != data.nbytes:
                    raise NcclError(f"recv of {data.nbytes} bytes from rank {peer} matched a "
                                    f"send of {got}")
                memory(recvbuf, count, dtype)[...] = data
            return [req], on_done
        self._submit("recv", stream, op, p2p=True)

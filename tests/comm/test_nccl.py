"""The NCCL path (mpishard/comm/nccl.py) on the strict CPU stand-in for cupy's NCCL.

`Backend("gpu", gpu_comm="nccl", array_module=DeviceModule(...), nccl_module=NcclModule(xp))`:
the device double (tests/device_double.py) and the NCCL stand-in (tests/nccl_double.py), which
runs each operation on its stream in order, sends synchronously and refuses a send outside a
group. Each Comm call must equal MPI's (float64, exact or rtol 1e-9) and be counted on the
stand-in, so the NCCL path was really taken; the path's choice and its refusals are checked.
MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_nccl.py`
for N in 2, 4.
"""
import ml_dtypes
import numpy as np
import pytest
from conftest import group_comm
from device_double import DeviceModule
from mpi4py import MPI
from nccl_double import NcclError, NcclModule

from mpishard.comm.backend import Backend
from mpishard.comm.collectives import Comm
from mpishard.comm.mesh import DeviceMesh, parse_layout
from mpishard.health.watchdog import CollectiveTimeout, Watchdog


def nccl_backend(comm, n_devices=None, **kw):
    """A Backend on the NCCL path over the device and NCCL stand-ins: (backend, xp, nccl)."""
    xp = DeviceModule(n_devices=n_devices or comm.Get_size())
    nccl = NcclModule(xp)
    kw.setdefault("gpu_comm", "nccl")
    return Backend("gpu", comm, array_module=xp, nccl_module=nccl, **kw), xp, nccl


def test_memory_pointers_and_streams_of_the_double():
    xp = DeviceModule()
    d = xp.asarray(np.arange(4.0))
    assert d.data.ptr == d._data.ctypes.data
    stream, ran = xp.cuda.get_current_stream(), []
    stream.enqueue(lambda: lambda: bool(ran.append(1)) or len(ran) >= 3)   # polled once
    event = xp.cuda.Event()
    event.record(stream)
    assert not event.done                             # polled a second time
    assert event.done and ran == [1, 1, 1]            # the third poll finishes it


def test_path_choice_and_refusals():
    xp = DeviceModule(n_devices=1)
    assert Backend("gpu", MPI.COMM_SELF, array_module=xp).comm_path in ("staged", "mpi")
    backend, _, _ = nccl_backend(MPI.COMM_SELF, gpu_comm="auto")     # NCCL is opt-in
    assert backend.comm_path in ("staged", "mpi") and "opt-in" in backend.comm_path_reason
    backend, _, _ = nccl_backend(MPI.COMM_SELF, gpu_comm="nccl")
    assert backend.comm_path == "nccl" and "libnccl" in backend.comm_path_reason
    for kw, path in (({"cuda_aware": False}, "staged"), ({"cuda_aware": True}, "mpi"),
                     ({"gpu_comm": "staged"}, "staged"), ({"gpu_comm": "mpi",
                                                           "cuda_aware": True}, "mpi")):
        backend, _, _ = nccl_backend(MPI.COMM_SELF, **{"gpu_comm": "auto", **kw})
        assert backend.comm_path == path and backend.device_transport is None, kw
    with pytest.raises(ValueError, match="not possible here: no NCCL"):
        Backend("gpu", MPI.COMM_SELF, array_module=DeviceModule(), gpu_comm="nccl")
    with pytest.raises(ValueError, match="contradicts"):
        nccl_backend(MPI.COMM_SELF, gpu_comm="staged", cuda_aware=True)
    assert Backend("cpu", gpu_comm="nccl").comm_path == "host"


def test_stand_in_refuses_a_send_outside_a_group():
    xp = DeviceModule()
    nccl = NcclModule(xp, world=MPI.COMM_SELF)
    nc = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    d = xp.zeros(3)
    with pytest.raises(NcclError, match="outside a groupStart"):
        nc.send(d.data.ptr, 3, nccl.NCCL_FLOAT64, 0, 0)
    out = xp.zeros(3)
    nccl.groupStart()
    nc.send(xp.asarray(np.arange(3.0)).data.ptr, 3, nccl.NCCL_FLOAT64, 0, 0)
    nc.recv(out.data.ptr, 3, nccl.NCCL_FLOAT64, 0, 0)
    nccl.groupEnd()
    xp.cuda.get_current_stream().synchronize()
    assert xp.asnumpy(out).tolist() == [0.0, 1.0, 2.0]
    nc.abort()
    with pytest.raises(NcclError, match="aborted"):
        nc.allReduce(d.data.ptr, d.data.ptr, 3, nccl.NCCL_FLOAT64, nccl.NCCL_SUM, 0)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,id_bytes", [(2, True), (4, True), (2, False)])
def test_every_collective_through_nccl_equals_mpi(n, id_bytes):
    """... with the unique id as cupy 14 gives it (bytes) and as cupy 13 did (a tuple)."""
    comm = group_comm(n)
    backend, xp, nccl = nccl_backend(comm)
    nccl.id_as_bytes = id_bytes
    mesh = DeviceMesh(comm, parse_layout(f"dp={n}"))
    engine = Comm(mesh, backend, watchdog=Watchdog(mesh, 30))
    me, rng = comm.Get_rank(), np.random.default_rng(comm.Get_rank())
    host = rng.standard_normal((4 * n, 3))
    every = comm.allgather(host)
    d = xp.asarray(host)
    for op, want in (("sum", sum(every)), ("avg", sum(every) / n),
                     ("max", np.max(every, axis=0))):
        np.testing.assert_allclose(xp.asnumpy(engine.all_reduce(d, op)), want, rtol=1e-12)
    np.testing.assert_allclose(xp.asnumpy(engine.all_reduce_async(d, "avg").result()),
                               sum(every) / n, rtol=1e-12)
    np.testing.assert_array_equal(xp.asnumpy(engine.all_gather(d, axis=1)),
                                  np.concatenate(every, axis=1))
    np.testing.assert_array_equal(xp.asnumpy(engine.all_gather_async(d).result()),
                                  np.concatenate(every))
    np.testing.assert_allclose(xp.asnumpy(engine.reduce_scatter(d)),
                               np.split(sum(every), n)[me], rtol=1e-12)
    np.testing.assert_array_equal(xp.asnumpy(engine.all_to_all(d)),
                                  np.concatenate([np.split(e, n)[me] for e in every]))
    np.testing.assert_array_equal(xp.asnumpy(engine.broadcast(d if me == 1 else None, root=1)),
                                  every[1])
    right, left = (me + 1) % n, (me - 1) % n
    sent = engine.send_async(d * 2, right, tag=5)
    np.testing.assert_array_equal(xp.asnumpy(engine.receive(left, tag=5)), every[left] * 2)
    sent.result()
    into = xp.zeros((2, 2), dtype=np.int64)
    sent = engine.send_async(xp.asarray(np.full((2, 2), me)), into, right)
    assert engine.receive_async(left, out=into).result() is into
    sent.result()
    assert xp.asnumpy(into).tolist() == [[left] * 2] * 2
    low = d.astype(ml_dtypes.bfloat16)                   # no NCCL bfloat16 here: MPI's words
    sent = engine.send_async(low, right, tag=6)
    got = engine.receive(left, tag=6)
    sent.result()
    assert got.dtype == low.dtype
    np.testing.assert_array_equal(xp.asnumpy(got.astype(np.float32)),
                                  every[left].astype(ml_dtypes.bfloat16).astype(np.float32))
    total = engine.all_reduce(xp.asarray(np.array([1j * me])))       # complex: MPI's
    assert xp.asnumpy(total).tolist() == [1j * sum(range(n))]
    print(f"rank {me} of {n}: NCCL calls {dict(nccl.calls)}")
    for name in ("allReduce", "allGather", "reduceScatter", "bcast", "send", "recv"):
        assert nccl.calls[name] > 0, name
    assert nccl.calls["NcclCommunicator"] == 3           # the group's and its two lanes', once
    engine.close()
    assert nccl.calls["destroy"] == 3


@pytest.mark.mpi(min_size=2)
def test_a_late_rank_is_named_and_the_communicator_aborted():
    comm = group_comm(2)
    backend, xp, nccl = nccl_backend(comm)
    mesh = DeviceMesh(comm, parse_layout("dp=2"))
    engine = Comm(mesh, backend, watchdog=Watchdog(mesh, 1.0))
    d = xp.ones(4)
    engine.all_reduce(d)                                  # bootstrapped, both ranks in
    if comm.Get_rank() == 0:
        with pytest.raises(CollectiveTimeout, match=r"late ranks: \[1\]"):
            engine.all_reduce(d)
        assert nccl.calls["abort"] == 3                   # the group's and its lanes'
    comm.Barrier()
    if comm.Get_rank() == 1:                              # the late one joins after all
        try:
            engine.all_reduce(d)
        except CollectiveTimeout:
            pass                                          # rank 0 gave up: its op is gone


@pytest.mark.mpi(min_size=2)
def test_messages_received_out_of_sending_order_raise():
    """NCCL matches a pair's messages in issue order, not by tag: two same-shape messages
    received in the other order would swap silently; the header's send number catches it."""
    comm = group_comm(2)
    backend, xp, _ = nccl_backend(comm)
    engine = Comm(DeviceMesh(comm, parse_layout("dp=2")), backend)
    engine.all_reduce(xp.ones(1))                     # the NCCL communicator, made
    if comm.Get_rank() == 0:
        for tag in (1, 2):
            engine.send_async(xp.asarray(np.full(3, float(tag))), 1, tag=tag)
    else:
        second, first = engine.receive_async(0, tag=2), engine.receive_async(0, tag=1)
        with pytest.raises(RuntimeError, match="out of order"):
            second.result()
        del first
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_pair_s_receives_are_issued_in_posting_order():
    """Receives posted in the sending order are issued in that order even when a later
    one's header came first (it waits for the earlier one's)."""
    comm = group_comm(2)
    backend, xp, _ = nccl_backend(comm)
    engine = Comm(DeviceMesh(comm, parse_layout("dp=2")), backend)
    if comm.Get_rank() == 0:
        sent = [engine.send_async(xp.asarray(np.full(3, float(tag))), 1, tag=tag)
                for tag in (1, 2)]
        for fut in sent:
            fut.result()
        engine.all_reduce(xp.ones(1))
    else:
        first, second = engine.receive_async(0, tag=1), engine.receive_async(0, tag=2)
        assert xp.asnumpy(second.result()).tolist() == [2.0] * 3
        assert xp.asnumpy(first.result()).tolist() == [1.0] * 3
        engine.all_reduce(xp.ones(1))


@pytest.mark.mpi(min_size=2)
def test_crossing_sends_do_not_wait_for_each_other():
    """Each rank sends, has the send issued alone, then receives the other's message: on one
    NCCL stream each send would wait for a receive queued behind the other rank's send (the
    pipeline's activation and gradient crossing). The lanes carry the two directions apart."""
    comm = group_comm(2)
    backend, xp, nccl = nccl_backend(comm)
    mesh = DeviceMesh(comm, parse_layout("dp=2"))
    engine = Comm(mesh, backend, watchdog=Watchdog(mesh, 20))
    me, other = comm.Get_rank(), 1 - comm.Get_rank()
    sent = engine.send_async(xp.asarray(np.full(5, float(me))), other, tag=3)
    backend.device_transport.flush(engine.watchdog)          # the send's group, issued alone
    assert nccl.calls["groupEnd"] == 1 and nccl.calls["recv"] == 0
    got = engine.receive_async(other, tag=3).result()
    assert xp.asnumpy(got).tolist() == [float(other)] * 5
    sent.result()
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_receive_whose_header_never_comes_names_the_peer():
    """Waiting for a receive polls for its header at most the timeout: then the group's three
    communicators are aborted and the CollectiveTimeout names the peer that never sent."""
    comm = group_comm(2)
    backend, xp, nccl = nccl_backend(comm)
    mesh = DeviceMesh(comm, parse_layout("dp=2"))
    engine = Comm(mesh, backend, watchdog=Watchdog(mesh, 1.0))
    engine.all_reduce(xp.ones(1))                     # the communicators, made
    if comm.Get_rank() == 0:
        waiting = engine.receive_async(1, tag=4)
        with pytest.raises(CollectiveTimeout, match=r"receive .* late ranks: \[1\] \(the peer\)"):
            waiting.result()
        assert nccl.calls["abort"] == 3
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
def test_a_send_async_goes_out_before_the_next_nccl_call():
    """The sender posts a send_async and then blocks in plain MPI on a reply the receiver
    sends only after its NCCL receive: the send must go to NCCL when it is posted."""
    comm = group_comm(2)
    backend, xp, _ = nccl_backend(comm)
    mesh = DeviceMesh(comm, parse_layout("dp=2"))
    engine = Comm(mesh, backend, watchdog=Watchdog(mesh, 20))
    reply = np.zeros(1)
    if comm.Get_rank() == 0:
        sent = engine.send_async(xp.asarray(np.arange(3.0)), 1, tag=6)
        comm.Recv(reply, source=1, tag=77)                   # MPI only: no NCCL call here
        sent.result()
        assert reply.tolist() == [1.0]
    else:
        got = engine.receive(0, tag=6)
        comm.Send(np.ones(1), dest=0, tag=77)
        assert xp.asnumpy(got).tolist() == [0.0, 1.0, 2.0]
    comm.Barrier()

"""The GPU code path on a strict CPU stand-in for cupy (tests/device_double.py).

Every engine here runs on `Backend("gpu", array_module=DeviceModule(...))`, in both modes:

- staged (MPI not CUDA-aware): device arrays reach MPI only through host staging; a device
  array handed to mpi4py unstaged has no buffer and raises. The host<->device copies of a
  training step are exactly the staged bytes (one copy each way per message, none for a
  buffer MPI only writes);
- cuda_aware: device arrays go to MPI as they are: zero host<->device copies of arrays.

A stray `np.` call on a device array raises TypeError, so these tests catch it. Results are
compared with the numpy single-device reference (float64, rtol 1e-9).
"""
import numpy as np
import pytest
from conftest import RTOL64, assert_close, group_comm
from device_double import DeviceArray, DeviceModule
from mpi4py import MPI

import mpishard as ms
from mpishard.comm.backend import Backend
from mpishard.comm.collectives import Comm
from mpishard.comm.mesh import DeviceMesh, parse_layout
from mpishard.comm.gpu import query_cuda_support

MODES = ["staged", "cuda_aware"]


def device_backend(comm, mode):
    xp = DeviceModule(cuda_aware=mode == "cuda_aware")
    return Backend("gpu", comm, cuda_aware=mode == "cuda_aware", array_module=xp), xp


# -- the double itself (serial) -----------------------------------------------------------------
def test_double_is_strict():
    xp = DeviceModule()
    d = xp.asarray(np.arange(6.0).reshape(2, 3))
    assert not isinstance(d, np.ndarray)
    with pytest.raises(TypeError, match="Implicit conversion"):
        np.asarray(d)
    with pytest.raises(TypeError):
        np.einsum("ij->j", d)                  # a stray np. call on a device array
    with pytest.raises(TypeError):
        _ = d + np.ones(3)                     # mixing with a host array
    with pytest.raises(TypeError):
        _ = np.ones(3) + d
    with pytest.raises(TypeError):
        memoryview(d)                          # no buffer protocol
    with pytest.raises(AttributeError):
        _ = d.__cuda_array_interface__         # not CUDA-aware
    assert isinstance(d.sum(axis=0), DeviceArray) and isinstance(d.sum(), DeviceArray)
    assert xp.copies.calls == {"to_host": 0, "to_device": 1}
    assert np.array_equal(xp.asnumpy(d * 2 + 1), np.arange(6.0).reshape(2, 3) * 2 + 1)
    assert xp.copies.bytes == {"to_host": 48, "to_device": 48}


def test_mpi_refuses_unstaged_device_arrays():
    d = DeviceModule(cuda_aware=False).zeros(4)
    with pytest.raises((TypeError, BufferError)):
        MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, d)
    aware = DeviceModule(cuda_aware=True)
    d = aware.asarray(np.arange(4.0))
    MPI.COMM_SELF.Allreduce(MPI.IN_PLACE, d)   # through __cuda_array_interface__
    assert np.array_equal(aware.asnumpy(d), np.arange(4.0))


def test_cuda_aware_detection_and_override():
    aware, why = query_cuda_support()
    print(f"this MPI: CUDA-aware {aware}: {why}")
    assert isinstance(aware, bool) and why
    if "MPICH" in MPI.Get_library_version():   # the MPICH wheel here is built without CUDA
        assert not aware and "= 0" in why
    for override in (True, False):
        backend, _ = device_backend(MPI.COMM_SELF, "cuda_aware" if override else "staged")
        assert backend.cuda_aware is override and "set by the caller" in backend.cuda_aware_reason
    backend = Backend("gpu", MPI.COMM_SELF, array_module=DeviceModule())
    assert (backend.cuda_aware, backend.cuda_aware_reason) == (aware, why)
    assert not Backend("cpu", cuda_aware=True).cuda_aware
    with pytest.raises(TypeError, match="cuda_aware"):
        Backend("cpu", cuda_aware="yes")


# -- collectives and point-to-point on device arrays (MPI) -------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_two_receives_in_flight_do_not_alias(mode):
    """Two receive_async(out=) of the same shape in flight: each lands in its own buffer
    (one shared staging buffer gave [[2,2,2],[2,2,2]])."""
    comm = group_comm(2)
    backend, xp = device_backend(comm, mode)
    engine = Comm(DeviceMesh(comm, parse_layout("dp=2")), backend)
    if comm.Get_rank() == 0:
        for v in (1.0, 2.0):
            engine.send_async(xp.full(3, v), xp.empty(3), 1).result()
    else:
        out = xp.zeros((2, 3))
        futures = [engine.receive_async(0, out=out[i]) for i in range(2)]
        for f in reversed(futures):
            f.result()
        got = backend.to_host(out)
        print("received", got.tolist())
        assert got.tolist() == [[1, 1, 1], [2, 2, 2]]
    comm.Barrier()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
def test_all_reduce_copies_exactly_one_each_way(mode):
    comm = group_comm(2)
    backend, xp = device_backend(comm, mode)
    engine = Comm(DeviceMesh(comm, parse_layout("dp=2")), backend)
    a = xp.asarray(np.arange(1000.0) * (comm.Get_rank() + 1))
    xp.copies.reset()
    out = engine.all_reduce(a)
    inplace = engine.all_reduce_async(xp.ones(1000), out=None).result()
    per_way = {"staged": 2 * a.nbytes, "cuda_aware": 0}[mode]
    print(mode, "copies", xp.copies.bytes, "syncs", xp.copies.syncs)
    assert xp.copies.bytes == {"to_host": per_way, "to_device": per_way}
    assert xp.copies.syncs >= 2                  # before each MPI call that reads the device
    assert np.array_equal(backend.to_host(out), np.arange(1000.0) * 3)
    assert np.array_equal(backend.to_host(inplace), np.full(1000, 2.0))


# -- the strategies on device arrays (MPI) ------------------------------------------------------
def check_staged(layout, mode, size, staged, grads):
    """The bytes the Backend staged in one step: none CUDA-aware or on one rank; under dp=2
    the gradients, then the 8-byte loss, each way; some under every other layout."""
    none = {"to_host": 0, "to_device": 0}
    if mode == "cuda_aware" or size == 1:
        assert staged == none
    elif layout == "dp=2":
        both = sum(g.nbytes for g in grads.values()) + 8
        assert staged == {"to_host": both, "to_device": both}
    else:
        assert min(staged.values()) > 0


def _model(kind):
    if kind == "moe":
        return ms.MoE(8, 16, 4, top_k=2, capacity_factor=2.0)
    return ms.MLP(dims=[8, 16, 16, 4])


LAYOUTS = [("mlp", "single", 1), ("mlp", "dp=2", 2), ("mlp", "tp=2", 2),
           ("mlp", "fsdp=2", 2), ("mlp", "pp=2,microbatches=2", 2), ("moe", "ep=2", 2)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("kind,layout,n", LAYOUTS, ids=[f"{k}-{v}" for k, v, _ in LAYOUTS])
def test_train_step_on_device_arrays(kind, layout, n, mode):
    comm = group_comm(n)
    backend, xp = device_backend(comm, mode)
    model = _model(kind)
    params = model.init(seed=0)
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((8, 8)), rng.standard_normal((8, model.d_out))
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    want_loss, want = ref.train_step(x, t, ms.losses.MSE())

    engine = ms.make_engine(model, layout, comm=comm, device=backend)
    engine.load_checkpoint(params)
    x_dev, t_dev = engine.shard_batch(x), engine.shard_batch(t)    # inputs on the device
    xp.copies.reset()
    backend.staged.update(to_host=0, to_device=0)
    loss, grads = engine.train_step(x_dev, t_dev, ms.losses.MSE())
    c, staged = xp.copies, dict(backend.staged)
    print(f"{layout} {mode}: host<->device bytes per step {c.bytes} in {c.calls} copies: "
          f"staging {c.staging} (Backend: {staged}), other arrays {c.other_arrays}; "
          f"MPI bytes sent {dict(engine.comm_bytes)}")
    none = {"to_host": 0, "to_device": 0}
    if kind != "moe":         # MoE routes on the host: probs down, counts/indices back up
        assert c.other_arrays == none         # no array crosses but for MPI staging
    assert c.staging == staged                # every staged byte is one copy, and no more
    check_staged(layout, mode, comm.Get_size(), staged, grads)
    full = {k: backend.to_host(v) for k, v in engine.gather_grads(grads).items()}
    assert_close(loss, want_loss, rtol=RTOL64, what=f"{layout} {mode} loss")
    for name in want:
        assert_close(full[name], want[name], rtol=RTOL64, what=f"{layout} {mode} {name}")


# -- the command line (serial) -----------------------------------------------------------------
def test_inspect_env_and_cuda_aware_flag(capsys):
    from mpishard.cli import main

    assert main(["inspect", "--env"]) == 0
    out = capsys.readouterr().out
    print(out)
    aware, why = query_cuda_support()
    assert f"CUDA-aware       {'yes' if aware else 'no'}: {why}" in out
    assert "GPU comm         host: arrays are on the host (numpy)" in out     # no GPU here
    assert "MPI library" in out and "cupy" in out and "visible GPUs" in out
    assert main(["inspect", "--env", "--layout", "dp=2"]) == 2
    assert main(["bench", "--model", "8,16,4", "--steps", "1", "--warmup", "0",
                 "--device", "cpu", "--cuda-aware", "no"]) == 0
    assert main(["bench", "--model", "8,16,4", "--cuda-aware", "maybe"]) == 2

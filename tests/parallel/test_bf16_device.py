"""bfloat16 mixed precision on a device (uint16 words, parallel/bf16.py) equals the host's
(ml_dtypes.bfloat16) bit for bit, on the strict CPU stand-in for cupy (tests/device_double.py,
which refuses ml_dtypes' dtype as cupy does, so every bf16 array there is words).

For an MLP and a GPT under single, dp=2, fsdp=2 (zero=1 and zero=3), tp=2 and pp=2: four
AdamW steps of `param_dtype=comm_dtype="bfloat16"` on the double (staged; dp=2 and fsdp=2 also
CUDA-aware) and on numpy give
- the same loss every step (float equality), and every rank's parameter blocks bit for bit
  (the device's uint16 words against the host's bfloat16 bits) and fp32 masters bit for bit;
- the same bytes through MPI, call by call (engine.comm_bytes): bf16 travels as 2-byte words;
  and under dp=2 / fsdp=2 half of a float32 device run's (but the 8-byte float64 loss).
The GPT's batches use each token id once: the embedding's scatter-add of repeated ids sums
in another order on numpy (sorted add.reduceat, nn/functional.py) than on a device (add.at),
a float32 difference of the compute path itself, not of bf16 (a float32 run differs there
too; measured with 8 rows of random ids: after 4 steps the losses and words still agree, and
82 of the 256 fp32 masters of embed/tokens differ, by up to 3072 float32 ulps).
The low-precision all_reduce on the device follows precision.py's rule, checked against its
definition computed on the host: c(sum_r c(x_r)) with the sum in fp32, in rank order.

A checkpoint saved by a device bf16 engine (words widened to fp32 on the way out) restores
into a host bf16 engine and into a device one with the same bits and fp32 masters.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/parallel/test_bf16_device.py` for N in 1, 2, 4.
"""
import ml_dtypes
import numpy as np
import pytest
from conftest import group_comm, world
from device_double import DeviceModule
from mpi4py import MPI

import mpishard as ms
from mpishard.checkpoint.restorer import restore
from mpishard.checkpoint.writer import save
from mpishard.comm.backend import Backend
from mpishard.parallel.bf16 import WORD
from mpishard.parallel.precision import LowPrecisionComm

BF16, F32 = np.dtype(ml_dtypes.bfloat16), np.dtype(np.float32)
LOSS_BYTES = 8                      # engine.global_mean: one float64 all_reduce, 2 ranks
MLP = ms.MLP(dims=[8, 16, 16, 4], activation="gelu")
GPT = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
LAYOUTS = [("single", 1, "staged"), ("dp=2", 2, "staged"), ("dp=2", 2, "cuda_aware"),
           ("fsdp=2,zero=1", 2, "staged"), ("fsdp=2", 2, "staged"),
           ("fsdp=2", 2, "cuda_aware"), ("tp=2", 2, "staged"),
           ("pp=2,microbatches=2", 2, "staged")]


def batches(model, steps=4):
    """MLP: 8 rows; GPT: 2 rows of 8 tokens, each of the 16 ids once (module docstring)."""
    rng = np.random.default_rng(3)
    if model is GPT:
        return [(rng.permutation(16).reshape(2, 8), rng.integers(0, 16, (2, 8)))
                for _ in range(steps)]
    return [(rng.normal(size=(8, 8)), rng.normal(size=(8, 4))) for _ in range(steps)]


def run(model, layout, comm, device, low="bfloat16"):
    """(losses, {name: local block bits}, {name: master bits}, comm bytes of step 1)."""
    e = ms.make_engine(model, layout, comm=comm, device=device, dtype=np.float32,
                       param_dtype=low, comm_dtype=low)
    e.load_checkpoint(model.init(seed=0))
    opt = ms.optim.AdamW(e, lr=1e-2, weight_decay=0.1)
    loss_fn = ms.losses.CrossEntropy() if model is GPT else ms.losses.MSE()
    losses, sent = [], None
    for x, t in batches(model):
        e.reset_comm_stats()
        loss, _ = e.train_step(e.shard_batch(x), e.shard_batch(t), loss_fn)
        sent = sent if sent is not None else dict(e.comm_bytes)
        opt.step()
        losses.append(loss)
    host = e.backend.to_host
    blocks = {n: host(p) for n, p in e.params.items()}
    masters = {n: host(s["master"]) for n, s in opt.state.items() if "master" in s}
    return losses, blocks, masters, sent


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["mlp", "gpt"])
@pytest.mark.parametrize("layout,n,mode", LAYOUTS, ids=[f"{v}-{m}" for v, _, m in LAYOUTS])
def test_device_bf16_equals_host_bf16_bit_for_bit(kind, layout, n, mode, monkeypatch):
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")    # the host on numpy's ops, as the device
    comm = group_comm(n)                             # is (numba's LayerNorm sums in its order)
    model = GPT if kind == "gpt" else MLP
    aware = mode == "cuda_aware"

    def device():
        return Backend("gpu", comm, cuda_aware=aware, array_module=DeviceModule(aware))
    host_losses, host_blocks, host_masters, host_sent = run(model, layout, comm, "cpu")
    dev_losses, dev_blocks, dev_masters, dev_sent = run(model, layout, comm, device())
    print(f"{kind} {layout} {mode}: losses host {host_losses} device {dev_losses}; bytes per "
          f"step {sum(dev_sent.values()):g} ({dev_sent})")
    assert dev_losses == host_losses
    assert host_blocks.keys() == dev_blocks.keys() and host_masters.keys() == dev_masters.keys()
    assert host_masters, "no fp32 masters: the parameters were not stored in 16 bits"
    for name, block in host_blocks.items():
        assert block.dtype == BF16 and dev_blocks[name].dtype == WORD, name
        assert np.array_equal(dev_blocks[name], block.view(WORD)), f"{kind} {layout} {name}"
    for name, master in host_masters.items():
        assert np.array_equal(dev_masters[name].view(np.uint32), master.view(np.uint32)), name
    assert dev_sent == host_sent
    if layout.startswith(("dp", "fsdp")):
        f32_sent = run(model, layout, comm, device(), low=None)[3]
        assert sum(dev_sent.values()) - LOSS_BYTES == (sum(f32_sent.values()) - LOSS_BYTES) / 2


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", ["staged", "cuda_aware"])
def test_device_low_all_reduce_is_fp32_sum_of_rounded_values(mode):
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    xp = DeviceModule(mode == "cuda_aware")
    backend = Backend("gpu", comm, cuda_aware=mode == "cuda_aware", array_module=xp)
    e = ms.make_engine(MLP, f"dp={n}", dtype=np.float32, comm=comm, device=backend,
                       comm_dtype="bfloat16")
    wire = LowPrecisionComm(e.comm, F32, BF16)
    xs = [np.random.default_rng(r).normal(size=(7, 143)).astype(F32) for r in range(n)]
    stacked = np.stack([x.astype(BF16).astype(F32) for x in xs])     # (n, 7, 143) fp32
    want = stacked.sum(axis=0).astype(BF16).astype(F32) if n > 1 else xs[0]
    e.reset_comm_stats()
    got = backend.to_host(wire.all_reduce(xp.asarray(xs[rank]), op="sum", group="dp"))
    sent = float(sum(e.comm_bytes.values()))
    print(f"device bf16 all_reduce at {n} ranks ({mode}): max diff "
          f"{float(np.abs(got - want).max()):g}, {sent:g} bytes sent for {xs[0].size} elements")
    assert got.dtype == F32 and np.array_equal(got, want)
    k = -(-xs[0].size // n)                     # elements per chunk (zero-padded)
    assert sent == (2 * (n - 1) * k * 2 if n > 1 else 0)      # all_to_all + all_gather, 2 B


def test_device_bf16_checkpoint_round_trip(tmp_path):
    def engine(device):
        e = ms.make_engine(MLP, comm=MPI.COMM_SELF, device=device, dtype=np.float32,
                           param_dtype="bfloat16", comm_dtype="bfloat16")
        e.load_checkpoint(MLP.init(seed=1))
        return e, ms.optim.AdamW(e, lr=1e-2)

    def device():
        return Backend("gpu", MPI.COMM_SELF, cuda_aware=False, array_module=DeviceModule())
    e, opt = engine(device())
    for x, t in batches(MLP, steps=2):
        e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.MSE())
        opt.step()
    save(str(tmp_path / "ck"), e, opt, step=2)
    words = {n: e.backend.to_host(p) for n, p in e.params.items()}
    masters = {n: e.backend.to_host(s["master"]) for n, s in opt.state.items()}
    for where in ("cpu", device()):
        e2, opt2 = engine(where)
        assert restore(str(tmp_path / "ck"), e2, opt2) == 2
        for n in words:
            got = e2.backend.to_host(e2.params[n])
            assert np.array_equal(got if where != "cpu" else got.view(WORD), words[n]), n
            master = e2.backend.to_host(opt2.state[n]["master"])
            assert np.array_equal(master.view(np.uint32), masters[n].view(np.uint32)), n

"""compute_dtype="bfloat16" through the layouts: the same layer code (nn/autocast.py's policy,
attached by compose) under dp, fsdp, tp, tp with sequence parallelism, pp and cp (ring and
Ulysses) (GPT), dp, tp and cp (Llama, grouped-query), dp and ep (its MoE form), against the
single-device engine with the same compute_dtype: loss, every gathered gradient and the
gathered logits. And bfloat16, float16 and TF32 on the device stand-in against the host.

Tolerance. A layout computes the same bf16 products but rounds at other places: tp's row
projections round each rank's partial product before the all-reduce sums them (single
rounds the whole sum once), and in the backward the column projections' partial dx before
theirs; dp, fsdp and ep round each rank's weight gradient before the average (as single's
microbatches would); cp's ring rounds each block's output before the online-softmax merge;
pp, sp and Ulysses move activations unchanged. Each such place moves a value by
at most one bf16 ulp of the partial, 2^-8 relative to a value of the order of the result,
and the following layers carry it on. Two blocks with two row projections each give four
such places forward and four backward on the longest path: we allow TOL = 8 * 2^-8 of each
array's largest element (observed: 3.9 under GPT's cp ring, 3.0 under Llama's tp and cp,
2.2 under GPT's tp, 1.3 under dp, fsdp, pp, Ulysses and ep; printed), and check the
layout ran in 16 bits: its gathered logits, the head's matmul outputs, lie on the bf16 grid
(a float32 run's do not).

MPI tests: `mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -m mpi
tests/parallel/test_compute_dtype.py`.
"""
import ml_dtypes
import numpy as np
import pytest

import mpishard as ms
from mpishard.comm.backend import Backend
from conftest import group_comm
from mpi4py import MPI
from test_bf16_cupy import gpu_cupy
from test_device_double import device_backend
from test_gpt_engine import make_case

CE = ms.losses.CrossEntropy()
TOL = 8 * 2.0 ** -8


def make_gpt():
    return ms.GPT(vocab_size=16, seq_len=8, d_model=32, n_heads=2, n_layers=2, d_ff=64)


def make_llama():
    return ms.Llama(vocab_size=16, seq_len=8, d_model=32, n_heads=4, n_layers=2, n_kv_heads=2,
                    d_ff=48)


def make_mixtral():
    return ms.Llama(vocab_size=16, seq_len=8, d_model=32, n_heads=4, n_layers=2, n_kv_heads=2,
                    d_ff=48, n_experts=4, top_k=2, capacity_factor=None)


MODELS = {"gpt": make_gpt, "llama": make_llama, "mixtral": make_mixtral}
CASES = [("gpt", layout) for layout in ("dp=2", "fsdp=2", "tp=2", "tp=2,sequence_parallel=1",
                                        "pp=2", "cp=2", "cp=2,cp_kind=ulysses")] + \
    [("llama", "dp=2"), ("llama", "tp=2"), ("llama", "cp=2"), ("mixtral", "dp=2"),
     ("mixtral", "ep=2")]


def run(model, layout, params, x, t, comm=None, compute_dtype="bfloat16"):
    """(loss, gathered gradients, gathered logits) of one train_step and predict (comm None:
    the single-device engine on this rank)."""
    if comm is None:
        e = ms.SingleDevice(model, dtype=np.float32, compute_dtype=compute_dtype)
    else:
        e = ms.make_engine(model, layout, dtype=np.float32, compute_dtype=compute_dtype,
                           comm=comm)
    e.load_checkpoint(params)
    loss, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), e.output.loss(CE))
    grads = e.gather_grads(grads)
    logits = e.gather_batch(e.predict(e.shard_batch(x)))
    return loss, grads, logits


def worst(a, b):
    """max |a - b| over the largest |b|, the worst over a dict's arrays: (value, name)."""
    if isinstance(b, dict):
        return max((worst(a[n], b[n])[0], n) for n in b)
    return float(np.abs(np.asarray(a) - b).max() / max(np.abs(b).max(), 1e-30)), ""


def on_bf16_grid(a):
    """Whether every element of a float32 array is a bfloat16 value."""
    return bool((a.astype(ml_dtypes.bfloat16).astype(np.float32) == a).all())


@pytest.mark.mpi
@pytest.mark.parametrize("name,layout", CASES, ids=[f"{m}-{v}" for m, v in CASES])
def test_bf16_layouts_match_single_bf16(name, layout):
    comm = group_comm(2)
    model = MODELS[name]()
    params, x, t = make_case(model)
    ref_loss, ref_grads, ref_logits = run(model, None, params, x, t)
    _, _, f32_logits = run(model, None, params, x, t, compute_dtype=None)
    loss, grads, logits = run(model, layout, params, x, t, comm)
    g_err, g_name = worst(grads, ref_grads)
    l_err, _ = worst(logits, ref_logits)
    loss_err = abs(loss - ref_loss) / abs(ref_loss)
    if comm.Get_rank() == 0:
        print(f"bf16 {name} {layout} vs single bf16: loss {loss_err:.2e}, logits {l_err:.2e}, "
              f"gradients {g_err:.2e} ({g_name}) of the largest; tolerance {TOL:.2e}")
    assert loss_err <= TOL and l_err <= TOL and g_err <= TOL, layout
    assert on_bf16_grid(logits) and not on_bf16_grid(f32_logits), "the head did not round"


@pytest.mark.parametrize("compute,tf32", [("bfloat16", False), ("float16", False), (None, True)])
def test_device_arrays_round_as_the_host_does(compute, tf32, monkeypatch):
    """On the strict device stand-in (tests/device_double.py: no np. on its arrays, 16-bit
    matmul inputs as real 16-bit arrays, products through nn/gemm.py; TF32 emulated, as on
    any device that is not cupy) a step rounds as numpy's does: loss,
    logits equal the host engine's bit for bit, the gradients to float32 rounding (the
    embedding's scatter-add sums in another order off numpy: xp.add.at), 1e-5 of each
    array's largest element, far below one bf16 (2^-8) or fp16 (2^-11) ulp. The host runs
    the xp softmax too (MPISHARD_CPU_FUSED=0: numba's sums in another order would move TF32
    roundings)."""
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    model = make_gpt()
    params, x, t = make_case(model)
    backend, xp = device_backend(MPI.COMM_SELF, "staged")
    got = {}
    for name, device in (("host", "cpu"), ("device", backend)):
        e = ms.make_engine(model, comm=MPI.COMM_SELF, device=device, dtype=np.float32,
                           compute_dtype=compute, tf32=tf32)
        e.load_checkpoint(params)
        xs, ts = (x, t) if device == "cpu" else (xp.asarray(x), xp.asarray(t))
        loss, grads = e.train_step(xs, ts, CE)
        logits = e.predict(xs)
        got[name] = (loss, {n: backend.to_host(g) for n, g in grads.items()},
                     backend.to_host(logits))
    (hl, hg, hy), (dl, dg, dy) = got["host"], got["device"]
    assert hl == dl
    np.testing.assert_array_equal(dy, hy)
    for n in hg:
        np.testing.assert_allclose(dg[n], hg[n], rtol=0, atol=1e-5 * np.abs(hg[n]).max(),
                                   err_msg=n)


DEVICE_CASES = CASES


def device_against_host(name, layout, compute, backend):
    """((loss, gathered gradients, gathered logits) on the host, the same on `backend`'s
    device) of one train_step and predict at 2 ranks."""
    comm = group_comm(2)
    model = MODELS[name]()
    params, x, t = make_case(model)
    got = {}
    for where, device in (("host", "cpu"), ("device", backend(comm))):
        e = ms.make_engine(model, layout, comm=comm, device=device, dtype=np.float32,
                           compute_dtype=compute)
        e.load_checkpoint(params)
        loss, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), e.output.loss(CE))
        grads = e.gather_grads(grads)
        logits = e.gather_batch(e.predict(e.shard_batch(x)))
        if where == "device":
            grads = {n: device.to_host(g) for n, g in grads.items()}
            logits = device.to_host(logits)
        got[where] = (loss, grads, logits)
    return got["host"], got["device"]


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["staged", "cuda_aware"])
@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,layout", DEVICE_CASES, ids=[f"{m}-{v}" for m, v in DEVICE_CASES])
def test_device_layouts_hold_16_bits_and_match_the_host(name, layout, compute, mode,
                                                        monkeypatch):
    """On the device stand-in a 16-bit engine holds its rounded matmul inputs as real 16-bit
    arrays (nn/autocast.py Narrow: what cupy runs, nn/gemm.py's products; the double refuses
    any 16-bit product that bypasses it), including the q, k, v blocks a cp ring sends and
    Ulysses exchanges. Per layout at 2 ranks, the loss and logits equal the host engine's
    (float32-held rounding) bit for bit, the gradients within 1e-5 of each array's largest
    element, as test_device_arrays_round_as_the_host_does says for one device. Staged, and
    CUDA-aware (MPI reads the device's bf16 words in place)."""
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    (hl, hg, hy), (dl, dg, dy) = device_against_host(
        name, layout, compute, lambda comm: device_backend(comm, mode)[0])
    assert hl == dl
    np.testing.assert_array_equal(dy, hy)
    for n in hg:
        np.testing.assert_allclose(dg[n], hg[n], rtol=0, atol=1e-5 * np.abs(hg[n]).max(),
                                   err_msg=n)


@pytest.mark.mpi
@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
@pytest.mark.parametrize("name,layout", DEVICE_CASES, ids=[f"{m}-{v}" for m, v in DEVICE_CASES])
def test_16_bit_layouts_on_cupy_match_the_host(name, layout, compute, monkeypatch):
    """The same layouts on real cupy (the GPU check's `layouts-16` part, 2 ranks sharing a
    GPU; skipped without one): tensor-core GEMMs sum in another order than the host's BLAS,
    so a rounding to 16 bits can move by one ulp and the layers carry it on. Loss, logits and
    every gradient within TOL (8 bf16 ulps of the array's largest element, as the layouts
    against single; float16's ulp is 8 times smaller) of the host's. Where the `cudnn` module
    imports, the GPT and Llama attention runs cuDNN's flash kernels (nn/cudnn_attention.py),
    whose roundings are as accurate as the emulation's but not the same. A top-k router is
    discontinuous in them: on the H200 (2026-11-30) one token of the Mixtral case went to
    another expert, its logits 0.24 of the largest apart in bfloat16 (loss 1.4e-4). So the
    Mixtral cases run our own attention kernels (MPISHARD_CUDNN=0), which round as the
    emulation does; benchmarks/gpu_cudnn_check.py measures cuDNN's error op by op."""
    gpu_cupy()                                    # skips without cupy and a GPU
    if name == "mixtral":
        monkeypatch.setenv("MPISHARD_CUDNN", "0")
    (hl, hg, hy), (dl, dg, dy) = device_against_host(
        name, layout, compute, lambda comm: Backend("gpu", comm, gpu_comm="staged"))
    g_err, g_name = worst(dg, hg)
    l_err = worst(dy, hy)[0]
    if group_comm(2).Get_rank() == 0:
        print(f"{compute} {name} {layout} on cupy vs host: loss {abs(dl - hl) / abs(hl):.2e}, "
              f"logits {l_err:.2e}, gradients {g_err:.2e} ({g_name}); tolerance {TOL:.2e}")
    assert abs(dl - hl) <= TOL * abs(hl) and l_err <= TOL and g_err <= TOL


@pytest.mark.mpi
def test_bf16_moe_expert_parallel_matches_single_bf16():
    """ms.MoE (MLP experts, parallel/expert_parallel.py) under ep=2 in bf16 against single
    bf16: loss, every gradient and the outputs within TOL. The outputs mix the experts' in
    float32 (the gates), so they are not on the bf16 grid: instead single float32's differ
    from single bf16's by more than 2^-12 of their scale (float32's own noise is ~2^-24)."""
    comm = group_comm(2)
    rng = np.random.default_rng(11)
    model = ms.MoE(d_model=8, d_hidden=16, n_experts=4, top_k=2, capacity_factor=None)
    params = model.init(seed=5)
    x, t = rng.standard_normal((16, 8)), rng.standard_normal((16, 8))
    got = {}
    for name, engine in (("single", ms.SingleDevice(model, dtype=np.float32,
                                                    compute_dtype="bfloat16")),
                         ("float32", ms.SingleDevice(model, dtype=np.float32)),
                         ("ep=2", ms.make_engine(model, "ep=2", comm=comm, dtype=np.float32,
                                                 compute_dtype="bfloat16"))):
        engine.load_checkpoint(params)
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                        ms.losses.MSE())
        got[name] = (loss, engine.gather_grads(grads),
                     engine.gather_batch(engine.predict(engine.shard_batch(x))))
    (rl, rg, ry), (el, eg, ey) = got["single"], got["ep=2"]
    g_err, g_name = worst(eg, rg)
    print(f"bf16 MoE ep=2 vs single bf16: loss {abs(el - rl) / rl:.2e}, outputs "
          f"{worst(ey, ry)[0]:.2e}, gradients {g_err:.2e} ({g_name}); tolerance {TOL:.2e}")
    assert abs(el - rl) <= TOL * rl and worst(ey, ry)[0] <= TOL and g_err <= TOL
    assert worst(got["float32"][2], ry)[0] > 2.0 ** -12, "nothing was rounded"

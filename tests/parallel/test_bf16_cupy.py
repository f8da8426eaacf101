"""bfloat16 as uint16 words (parallel/bf16.py): the conversions equal ml_dtypes bit for bit.

Everywhere (numpy and the strict device double, tests/device_double.py): the xp-op conversions
against ml_dtypes.bfloat16 on
- all 65536 bf16 words -> float32;
- float32 -> words on every float32 a bf16 word widens to (exact), every exact tie between two
  neighbours (low half 0x8000: ties to even, both directions of the sign), one bit either side
  of each tie, 2**20 random bit patterns, subnormals, the largest finite float32s (which round
  to inf), +-inf, and NaNs with assorted payloads (squashed to 0x7FC0 / 0xFFC0 by sign);
- float64 -> words (ml_dtypes goes through float32; so do the words).
On real cupy with a GPU (skipped cleanly without one): the ElementwiseKernels against the same
bit arithmetic as cupy array ops, bit for bit, on all those patterns, and on all 2**32 float32
bit patterns in chunks (kernel against xp ops, both on the GPU); and against ml_dtypes. An
engine with param_dtype=comm_dtype="bfloat16" on the GPU holds cupy uint16 words: after
loading, the host's ml_dtypes rounding of the checkpoint; after SGD steps, the rounding of
its fp32 masters; gather_params widens them exactly.
"""
import warnings

import ml_dtypes
import numpy as np
import pytest
from device_double import DeviceModule
from mpi4py import MPI

import mpishard as ms
from mpishard.comm.gpu import try_import_cupy
from mpishard.parallel import bf16

BF16 = np.dtype(ml_dtypes.bfloat16)
WORDS = np.arange(1 << 16, dtype=np.uint16)


def float32_patterns(seed=0) -> np.ndarray:
    """Bit patterns (uint32) of the float32s listed in the module docstring."""
    high = WORDS.astype(np.uint32) << 16
    rng = np.random.default_rng(seed)
    special = np.array([0x00000001, 0x00007FFF, 0x00008000, 0x00008001, 0x00018000, 0x0000FFFF,
                        0x007FFFFF, 0x00800000, 0x7F7F7FFF, 0x7F7F8000, 0x7F7FFFFF, 0x7F800000,
                        0x7F800001, 0x7FBFFFFF, 0x7FC00000, 0x7FFFFFFF, 0x3F808000, 0x3F818000],
                       dtype=np.uint32)
    return np.concatenate([high, high | 0x8000, high | 0x7FFF, high | 0x8001,
                           rng.integers(0, 1 << 32, 1 << 20, dtype=np.uint32),
                           rng.integers(0, 1 << 23, 4096, dtype=np.uint32),    # subnormals
                           special, special | 0x80000000])


def host_words(x: np.ndarray) -> np.ndarray:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # numpy: "invalid value" on NaN
        return x.astype(BF16).view(np.uint16)


def modules():
    return [("numpy", np), ("device double", DeviceModule())]


def on(xp, a):
    return xp.asarray(a) if xp is not np else a


def back(xp, a):
    return xp.asnumpy(a) if xp is not np else a


@pytest.mark.parametrize("name,xp", modules(), ids=lambda v: v if isinstance(v, str) else "")
def test_xp_ops_equal_ml_dtypes(name, xp):
    widened = back(xp, bf16.to_float32(xp, on(xp, WORDS)))
    assert widened.dtype == np.float32
    assert np.array_equal(widened.view(np.uint32), WORDS.view(BF16).astype(np.float32)
                          .view(np.uint32)), f"{name}: words -> float32"
    x = float32_patterns().view(np.float32)
    got = back(xp, bf16.to_words(xp, on(xp, x)))
    want = host_words(x)
    bad = np.flatnonzero(got != want)
    print(f"{name}: float32 -> bf16 words on {x.size} patterns: {bad.size} differ")
    assert got.dtype == np.uint16 and bad.size == 0, [hex(v) for v in x.view(np.uint32)[bad[:5]]]
    assert set(np.unique(want[np.isnan(x)])) == {0x7FC0, 0xFFC0}        # NaNs squashed by sign
    rng = np.random.default_rng(1)
    x64 = rng.normal(size=1 << 16) * np.exp2(rng.integers(-140, 130, 1 << 16))
    x64[:4] = [1 + 2.0 ** -8 + 2.0 ** -30, -(1 + 2.0 ** -8 + 2.0 ** -30), 2.0 ** -133, 1e39]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)       # 1e39: float64 -> float32 inf
        got64 = back(xp, bf16.to_words(xp, on(xp, x64)))
    assert np.array_equal(got64, host_words(x64))


def test_device_double_holds_bfloat16_but_refuses_its_products():
    """cupy 14 holds ml_dtypes' bfloat16 (seen on the H200: asarray, astype, sums), but its
    batched matmul and einsum refuse it and its 2-D float16 matmul sums in float16: the
    double holds 16-bit arrays and refuses their products, so the layers' products must go
    through nn/gemm.py."""
    xp = DeviceModule()
    a = xp.ones((2, 3, 3), dtype=np.float32).astype(BF16)
    assert a.dtype == BF16 and float(a.astype(np.float32).sum()) == 18.0
    for low in (a, a.astype(np.float16)):
        with pytest.raises(TypeError, match="16-bit"):
            xp.matmul(low, low)
        with pytest.raises(TypeError, match="16-bit"):
            low @ low
        with pytest.raises(TypeError, match="16-bit"):
            xp.einsum("bij,bjk->bik", low, low)
    with pytest.raises(TypeError, match="dtype"):
        xp.zeros(3, dtype=np.longdouble)


def gpu_cupy():
    cupy = try_import_cupy()
    try:
        if cupy is None or cupy.cuda.runtime.getDeviceCount() == 0:
            raise RuntimeError("no device")
    except Exception:
        pytest.skip("cupy with a CUDA device is not available here")
    return cupy


def test_kernels_equal_xp_ops_on_gpu():
    cp = gpu_cupy()
    words = cp.asarray(WORDS)
    kernel, ops = bf16.to_float32(cp, words), bf16.float32_by_ops(cp, words)
    assert kernel.dtype == np.float32 and bool((kernel.view(cp.uint32) == ops.view(cp.uint32))
                                               .all())
    assert np.array_equal(cp.asnumpy(kernel).view(np.uint32),
                          WORDS.view(BF16).astype(np.float32).view(np.uint32))
    x = float32_patterns().view(np.float32)
    got = bf16.to_words(cp, cp.asarray(x))
    assert got.dtype == np.uint16
    assert bool((got == bf16.words_by_ops(cp, cp.asarray(x))).all())
    assert np.array_equal(cp.asnumpy(got), host_words(x))
    strided = cp.asarray(x[:1 << 16].reshape(256, 256)).T           # non-contiguous input
    assert np.array_equal(cp.asnumpy(bf16.to_words(cp, strided)), host_words(x[:1 << 16]
                                                                             .reshape(256, 256).T))
    chunk, differ = 1 << 27, 0                                        # all 2**32 float32s
    for start in range(0, 1 << 32, chunk):
        u = cp.arange(start, start + chunk, dtype=cp.uint64).astype(cp.uint32)
        f = u.view(cp.float32)
        differ += int((bf16.to_words(cp, f) != bf16.words_by_ops(cp, f)).sum())
    print(f"kernel vs xp ops on all 2**32 float32 patterns: {differ} differ")
    assert differ == 0


def test_engine_holds_bf16_words_on_gpu():
    cp = gpu_cupy()
    model = ms.MLP(dims=[64, 128, 32], activation="relu")    # relu, SGD: few kernels for a
    # bare node's cupy to compile inside the GPU check's time box (benchmarks/gpu_check.py)
    params = model.init(seed=0)
    e = ms.make_engine(model, comm=MPI.COMM_SELF, device="gpu", dtype=np.float32,
                       param_dtype="bfloat16", comm_dtype="bfloat16")
    e.load_checkpoint(params)
    for n, p in params.items():
        assert isinstance(e.params[n], cp.ndarray) and e.params[n].dtype == np.uint16, n
        assert np.array_equal(cp.asnumpy(e.params[n]), host_words(p)), n
    opt = ms.optim.SGD(e, lr=0.1)
    rng = np.random.default_rng(0)
    losses, x, t = [], rng.normal(size=(16, 64)), rng.normal(size=(16, 32))
    for _ in range(3):
        losses.append(e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.MSE())[0])
        opt.step()
    print(f"bf16 MLP on the GPU: losses {losses}")
    full = e.gather_params()
    for n in params:
        words = cp.asnumpy(e.params[n])
        assert np.array_equal(words, host_words(cp.asnumpy(opt.state[n]["master"]))), n
        assert np.array_equal(cp.asnumpy(full[n]), words.view(BF16).astype(np.float32)), n
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]


def test_a_device_without_bfloat16_warns_that_compute_is_emulated(monkeypatch, caplog):
    """cupy 13 has no bfloat16 dtype: the engine falls back to the rounding emulation
    (float32 GEMMs) and says so, naming the cupy that would run it on the tensor cores."""
    from mpishard.nn.autocast import Narrow, Rounding
    from mpishard.parallel import precision

    p = precision.Precision(np.float32, compute_dtype="bfloat16")
    with caplog.at_level("WARNING", logger="mpishard"):
        assert isinstance(p.autocast(DeviceModule()), Narrow) and not caplog.records
        monkeypatch.setattr(precision, "holds", lambda xp, dtype: False)
        policy = p.autocast(DeviceModule())
    assert isinstance(policy, Rounding) and not isinstance(policy, Narrow)
    assert "emulated" in caplog.text and "cupy-cuda12x>=14" in caplog.text
    assert not caplog.records[1:]
    with caplog.at_level("WARNING", logger="mpishard"):
        p.autocast(np)                                      # numpy: the emulation, silently
    assert len(caplog.records) == 1

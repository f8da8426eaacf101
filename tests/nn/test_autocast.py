"""nn/autocast.py without torch: TF32 rounding bit for bit, a TF32 and a float16 matmul
against explicit numpy rounding of its inputs (and outputs), the float16 compute dtype
turning the trainer's loss scaler on, what the engine attaches (nothing unless asked), and
KV-cached decoding in bf16.
"""
import ml_dtypes
import numpy as np
import pytest

import mpishard as ms
from mpishard.nn.autocast import FULL, round_tf32
from mpishard.nn.kv_cache import KVCache, caching
from mpishard.nn.layers import Linear, LocalAccess, attach_autocast, every_layer
from mpishard.nn.transformer import CausalSelfAttention, TiedHead
from mpishard.parallel.precision import Precision
from mpishard.train.data import load_dataset
from mpishard.train.scaler import GradScaler
from mpishard.train.trainer import Trainer


def bits(words):
    return np.array(words, dtype=np.uint32).view(np.float32)


@pytest.mark.parametrize("given,want", [
    (0x3F800000, 0x3F800000),    # 1.0: already TF32
    (0x3F800FFF, 0x3F800000),    # below half of the last kept bit: down
    (0x3F801000, 0x3F800000),    # exact tie, kept bit even (0): stays
    (0x3F803000, 0x3F804000),    # exact tie, kept bit odd (1): up to even
    (0x3F801001, 0x3F802000),    # above the tie: up
    (0xBF801001, 0xBF802000),    # negative: the same on the magnitude
    (0x3FFFF000, 0x40000000),    # carry into the exponent: 2.0
    (0x7F7FFFFF, 0x7F800000),    # the largest float32 rounds to inf
    (0x00001FFF, 0x00002000),    # subnormals round like any other value
    (0x7F800000, 0x7F800000),    # inf stays
    (0x7FC00001, 0x7FC00001),    # NaN kept as it is (not rounded to inf or another NaN)
    (0x00000000, 0x00000000),
])
def test_tf32_rounding_bit_patterns(given, want):
    got = round_tf32(bits([given])).view(np.uint32)[0]
    assert got == want, f"{given:#010x} -> {got:#010x}, want {want:#010x}"


def test_tf32_keeps_ten_mantissa_bits_and_is_nearest(rng):
    x = (rng.standard_normal(10000) * 10.0 ** rng.integers(-20, 20, 10000)).astype(np.float32)
    r = round_tf32(x)
    assert not (r.view(np.uint32) & 0x1FFF).any()                      # 13 low bits clear
    ulp = np.ldexp(np.float32(1), np.frexp(x)[1] - 11)                 # TF32 spacing at x
    assert (np.abs(r.astype(np.float64) - x) <= ulp / 2).all()         # nearest
    np.testing.assert_array_equal(round_tf32(r), r)                    # idempotent


def linear_unit(w, policy):
    store = type("S", (), {})()
    store.params, store.grads = {"w": w}, {"w": np.zeros_like(w)}
    unit = Linear(LocalAccess(store), "w")
    attach_autocast([[unit]], policy)
    return unit, store


@pytest.mark.parametrize("kind", ["tf32", "float16"])
def test_matmul_rounds_inputs_as_numpy_does(rng, kind):
    """A Linear under tf32 (inputs to TF32, output float32) and float16 (inputs and output
    to float16): forward and both gradients equal float32 matmuls of explicitly rounded
    operands, bit for bit (the same BLAS call on the same values), and differ from the
    unrounded ones."""
    if kind == "tf32":
        policy = Precision(np.float32, tf32=True).autocast()
        rin, rout = round_tf32, (lambda a: a)
    else:
        policy = Precision(np.float32, compute_dtype="float16").autocast()
        rin = rout = (lambda a: a.astype(np.float16).astype(np.float32))
    x, w, dy = (rng.standard_normal(s).astype(np.float32) for s in ((16, 24), (24, 8), (16, 8)))
    unit, store = linear_unit(w.copy(), policy)
    y = unit.forward(x)
    dx = unit.backward(dy)
    np.testing.assert_array_equal(y, rout(rin(x) @ rin(w)))
    np.testing.assert_array_equal(dx, rout(rin(dy) @ rin(w).T))
    np.testing.assert_array_equal(store.grads["w"], rout(rin(x).T @ rin(dy)))
    assert y.dtype == dx.dtype == np.float32                 # held in float32
    assert not np.array_equal(y, x @ w)


def test_bf16_rounding_is_ml_dtypes_and_held_in_float32(rng):
    policy = Precision(np.float32, compute_dtype="bfloat16").autocast()
    x = rng.standard_normal(1000).astype(np.float32)
    r = policy.round(x)
    assert r.dtype == np.float32
    np.testing.assert_array_equal(r, x.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_policies_attach_only_when_asked():
    g = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=1, tied=True)
    for kw, name in (({}, None), ({"dtype": np.float64}, None),
                     ({"compute_dtype": "float32"}, None), ({"tf32": True}, "tf32"),
                     ({"compute_dtype": "bfloat16"}, "bfloat16")):
        kw.setdefault("dtype", np.float32)
        e = ms.make_engine(g, **kw)
        layers = list(every_layer(e.chunks))
        kinds = (Linear, TiedHead, CausalSelfAttention)
        policies = {repr(u.autocast) for u in layers if isinstance(u, kinds)}
        assert policies == ({"FULL"} if name is None else {f"Rounding({name})"}), kw
        if name is None:
            assert all("autocast" not in vars(u) for u in layers) and FULL.round(g) is g


def test_float16_compute_turns_the_loss_scaler_on():
    data = load_dataset("digits", d_in=64, d_out=10, seed=0)
    model = ms.MLP(dims=[64, 32, 10], activation="relu")
    for compute, scaled in ((None, False), ("bfloat16", False), ("float16", True)):
        e = ms.make_engine(model, dtype=np.float32, compute_dtype=compute)
        e.load_checkpoint(model.init(seed=0))
        assert e.precision.needs_loss_scaling is scaled
        trainer = Trainer(e, ms.optim.AdamW(e, lr=3e-3), data, batch=64, steps=3,
                          progress=False, log_every=0)
        assert isinstance(trainer.scaler, GradScaler) is scaled
        result = trainer.fit()
        assert np.isfinite(result["final_loss"])
        if scaled:
            assert result["loss_scale"] > 1


@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("where", ["cpu", "device double"])
def test_kv_cached_decoding_rounds_as_the_full_forward(kind, where):
    """Under compute_dtype bfloat16 a KV-cached forward's last logits are on the bf16 grid
    and equal the full forward's last position within a quarter bf16 ulp of the scale
    (observed: equal; the cached attention multiplies (g t, Dh) blocks where the full one
    multiplies (t, Dh) ones, so a rare rounding flip could appear). A cache whose attention
    does not round is 0.6 ulps off here: the bound tells them apart. The cache holds k and v
    as the matmuls take them: float32 on the grid on the CPU, bfloat16 (2 bytes) on a
    device."""
    from device_double import DeviceModule

    from mpishard.comm.backend import Backend
    sizes = dict(vocab_size=64, seq_len=16, d_model=16, n_heads=4, n_layers=2)
    model = ms.GPT(**sizes) if kind == "gpt" else ms.Llama(**sizes, n_kv_heads=2, d_ff=24)
    device = "cpu" if where == "cpu" else Backend("gpu", None, array_module=DeviceModule())
    engine = ms.make_engine(model, dtype=np.float32, compute_dtype="bfloat16", device=device)
    engine.load_checkpoint(model.init(seed=0))
    ids = np.random.default_rng(3).integers(0, 64, size=(2, 6))
    host = (lambda a: a) if where == "cpu" else device.to_host
    full = host(engine.predict(ids))[:, -1:]
    cache = KVCache(8)
    with caching(engine.chunks, cache):
        last = host(engine.predict(ids))
    held = {kb.dtype for kb, vb in cache.buffers.values()} | \
        {vb.dtype for kb, vb in cache.buffers.values()}
    assert held == {np.dtype(np.float32 if where == "cpu" else ml_dtypes.bfloat16)}
    for kb, _ in cache.buffers.values():
        k = host(kb).astype(np.float32)
        assert np.array_equal(k.astype(ml_dtypes.bfloat16).astype(np.float32), k)
    assert np.array_equal(last.astype(ml_dtypes.bfloat16).astype(np.float32), last)
    err = float(np.abs(last - full).max()) / (2.0 ** -7 * float(np.abs(full).max()))
    print(f"{kind}: cached vs full last logits: {err:.3f} bf16 ulps of the scale")
    assert err <= 0.25


def test_a_device_without_bfloat16_emulates_it(monkeypatch):
    """On a device whose arrays cannot be bfloat16 (cupy 13), compute_dtype="bfloat16" keeps
    the emulation (rounded values held in float32) instead of failing at the first cast;
    with bfloat16 (cupy 14, the stand-in) it holds real 16-bit arrays (Narrow)."""
    import device_double
    from mpishard.nn.autocast import Narrow

    policy = Precision(np.float32, compute_dtype="bfloat16")
    assert isinstance(policy.autocast(device_double.DeviceModule()), Narrow)
    monkeypatch.setattr(device_double, "CUPY_DTYPES", device_double.CUPY_DTYPES
                        - {np.dtype(ml_dtypes.bfloat16)})
    cupy13 = device_double.DeviceModule()
    emulated = policy.autocast(cupy13)
    assert not isinstance(emulated, Narrow) and repr(emulated) == "Rounding(bfloat16)"
    assert isinstance(Precision(np.float32, compute_dtype="float16").autocast(cupy13), Narrow)


def test_tf32_on_cupy_is_switched_around_each_layer_matmul(monkeypatch):
    """tf32=True on cupy (precision.CublasTF32): cupy's compute type is TF32 from a layer's
    taking of a matmul's inputs (round, or enter for a deferred weight gradient) to its
    taking of the output, and otherwise what it was (here a user's CUPY_TF32-style choice),
    so reductions and other code keep theirs. Stood in by a fake cupy._core module: the
    real one runs on the GPU check's bench-step."""
    import sys
    import types

    settings = {"f": "user's"}
    linalg = types.SimpleNamespace(
        COMPUTE_TYPE_TF32="tf32", COMPUTE_TYPE_DEFAULT="default",
        get_compute_type=lambda dtype: settings["f"],
        set_compute_type=lambda dtype, kind: settings.__setitem__(np.dtype(dtype).char, kind))
    core = types.ModuleType("cupy._core")
    core._routines_linalg = linalg
    monkeypatch.setitem(sys.modules, "cupy", types.ModuleType("cupy"))
    monkeypatch.setitem(sys.modules, "cupy._core", core)
    monkeypatch.setitem(sys.modules, "cupy._core._routines_linalg", linalg)
    fake_cupy = types.SimpleNamespace(__name__="cupy")
    policy = Precision(np.float32, tf32=True).autocast(fake_cupy)
    assert repr(policy) == "Rounding(tf32)" and settings["f"] == "user's"
    x = np.ones(3, np.float32)
    assert policy.round(x) is x and settings["f"] == "tf32"      # the inputs: TF32 on
    y = np.ones(3, np.float32)
    assert policy.output(y) is y and settings["f"] == "user's"   # the output: back
    policy.enter()                                               # a deferred weight gradient
    assert settings["f"] == "tf32"
    policy.output(y)
    assert settings["f"] == "user's"
    assert Precision(np.float32, tf32=True).autocast(np).round(x) is not x   # CPU: emulated

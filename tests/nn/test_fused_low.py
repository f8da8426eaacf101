"""nn/fused_low.py's 16-bit kernels (the attention softmax's, the in-place rounding, a linear
layer's bias add and rounding), their bodies run on the host.

tests/nn/host_kernels.py compiles each ElementwiseKernel body with a C++ preamble doing the
CUDA one's conversions (16-bit words widened exactly, narrowed to nearest even: the same bit
arithmetic for bfloat16, the compiler's _Float16 where the device's float16 helpers use PTX's
cvt, which only a GPU runs) and runs it here; the
results are checked against attention.py's xp path on the widened scores (float32 numpy: the
mask, the row max, exp, the sum, the scaling, then rounded to 16 bits as the next matmul
rounds its input). The kernels' float32 arithmetic is that path's, so the probabilities agree
to the host's exp against numpy's (a float32 ulp, then one 16-bit rounding: at most one
16-bit ulp apart); the backward's row sum runs key by key where numpy sums pairwise, so ds
agrees to a float32 rounding of the row sum, scaled by the largest |ds| (atol). The GPU check
runs the kernels themselves (layouts-16, bench-step). Without a C++ compiler the tests skip,
unless MPISHARD_REQUIRE_CXX=1 (make test-nvrtc, a CI stage), which makes that a failure.
"""
import os
from types import SimpleNamespace

import ml_dtypes
import numpy as np
import pytest

from host_kernels import HOST_PREAMBLE, HostKernel, compiler
from mpishard.nn import attention, fused_low
from mpishard.nn.layers import LocalAccess

if compiler() is None and os.environ.get("MPISHARD_REQUIRE_CXX") == "1":   # make test-nvrtc
    pytest.fail("MPISHARD_REQUIRE_CXX=1 but no C++ compiler (c++, g++) is on PATH",
                pytrace=False)
pytestmark = pytest.mark.skipif(compiler() is None, reason="needs a C++ compiler (g++)")
LOW = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
ULP = {"bfloat16": 2.0 ** -7, "float16": 2.0 ** -10}
TINY = {"bfloat16": 0.0, "float16": 2.0 ** -24}     # float16's subnormal step: p ~ 1e-8 is 0


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("host_kernels"))
    return {(kind, name): HostKernel(spec, HOST_PREAMBLE[kind], d)
            for kind in LOW for name, spec in fused_low.ELEMENTWISE.items()}


def scores(kind, shape, seed, spread=4.0):
    s = np.random.default_rng(seed).normal(0.0, spread, shape).astype(np.float32)
    return s.astype(LOW[kind])


def reference_softmax(s32, offset):
    """attention_block's xp path on the widened scores s^T (B, H, Tk, Tq): (p^T, lse)."""
    tk, tq = s32.shape[-2:]
    off = tk if offset is None else offset
    p = s32 + np.where(attention.causal_mask(np, tq, tk, off).T, 0.0, -np.inf).astype(np.float32)
    with np.errstate(invalid="ignore"):
        m = p.max(axis=-2, keepdims=True)
    m = np.where(np.isfinite(m), m, np.float32(0))
    p -= m
    np.exp(p, out=p)
    d = p.sum(axis=-2)
    p *= (np.float32(1) / np.where(d > 0, d, np.float32(1)))[..., None, :]
    with np.errstate(divide="ignore"):
        return p, m[..., 0, :] + np.log(d)


@pytest.fixture
def host_kernels(built, monkeypatch):
    """fused_low.kernels answering the host-built kernels (HostLaunch: cupy's call)."""
    monkeypatch.setattr(fused_low, "kernels", lambda xp, name: {
        k: HostLaunch(built[name, k]) for k in fused_low.ELEMENTWISE})


def run_softmax(kind, s, offset):
    p = s.copy()
    lse = fused_low.causal_softmax_t(np, p, offset)
    return p, lse


@pytest.mark.parametrize("kind", sorted(LOW))
@pytest.mark.parametrize("shape,offset", [((2, 3, 7, 7), 0), ((1, 2, 9, 5), 2),
                                          ((2, 1, 6, 8), -3), ((1, 2, 5, 4), None),
                                          ((1, 1, 64, 64), 0), ((1, 1, 200, 130), 0),
                                          ((1, 2, 130, 70), 60), ((1, 1, 129, 129), None)])
def test_softmax_is_the_xp_softmax_rounded(host_kernels, kind, shape, offset):
    s = scores(kind, shape, seed=sum(shape))
    got, lse = run_softmax(kind, s, offset)
    p, want_lse = reference_softmax(s.astype(np.float32), offset)
    g = got.astype(np.float32)
    assert np.all(g[p == 0] == 0)                            # hidden keys exactly 0
    np.testing.assert_allclose(g, p, rtol=ULP[kind], atol=TINY[kind])
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.isneginf(lse), np.isneginf(want_lse))
    rounded = p.astype(LOW[kind]).astype(np.float32)         # the PV matmul's input
    assert np.mean(g == rounded) > 0.95                      # mostly the very same words


def test_a_column_that_sees_no_key_is_zero_with_lse_minus_inf(host_kernels):
    s = scores("bfloat16", (1, 1, 4, 6), seed=3)
    got, lse = run_softmax("bfloat16", s, -5)         # query i sees keys j <= i - 5
    assert np.all(got[..., :5].astype(np.float32) == 0) and np.all(np.isneginf(lse[..., :5]))
    assert got[0, 0, 0, 5] == 1 and lse[0, 0, 5] == s[0, 0, 0, 5].astype(np.float32)


def test_the_64_bit_index_variants_give_the_same_words(host_kernels, monkeypatch):
    """Arrays of 2**32 elements or more take the per-element kernels with 64-bit index
    arithmetic; forced here (INDEX32 = 0) they equal the 32-bit ones word for word."""
    shape = (2, 3, 70, 45)
    s, ds = scores("bfloat16", shape, 21), scores("bfloat16", shape, 22, spread=0.5)

    def both():
        p, lse = run_softmax("bfloat16", s, 3)
        return (p, lse) + fused_low.softmax_grad_t(np, s.copy(), ds.copy(), lse, 3)
    want = both()
    monkeypatch.setattr(fused_low, "INDEX32", 0)
    HostLaunch.calls.clear()
    got = both()
    assert "mpishard_softmax16_write" in HostLaunch.calls
    assert "mpishard_softmax16_grad_write" in HostLaunch.calls
    for a, b in zip(got, want):
        assert np.array_equal(a.view(np.uint16) if a.dtype.itemsize == 2 else a,
                              b.view(np.uint16) if b.dtype.itemsize == 2 else b)


def test_a_chunk_of_minus_inf_scores_adds_nothing(host_kernels):
    """A column whose visible scores are -100 (64 keys) then -inf (a chunk of 64): the float32
    path's p = 1/64 on the first and lse = -100 + log 64 (0 exp(0 + 100) was NaN)."""
    s32 = np.full((1, 1, 128, 128), -np.inf, np.float32)
    s32[:, :, :64] = -100.0
    p, lse = run_softmax("bfloat16", s32.astype(LOW["bfloat16"]), None)
    want_p, want_lse = reference_softmax(s32.astype(LOW["bfloat16"]).astype(np.float32), None)
    assert np.isfinite(lse).all()
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    np.testing.assert_allclose(p.astype(np.float32), want_p, rtol=ULP["bfloat16"])


def reference_grad(s32, ds32, lse, offset):
    """attention_block_backward's xp path (whole, rounding cast): (p^T, ds^T / sqrt Dh)."""
    tk, tq = s32.shape[-2:]
    hide = ~attention.causal_mask(np, tq, tk, tk if offset is None else offset).T
    p = np.exp(s32 - np.where(np.isfinite(lse), lse, np.float32(0))[..., None, :])
    p[..., hide] = 0
    row = np.einsum("bhst,bhst->bht", ds32, p)
    return p, (ds32 - row[..., None, :]) * p


@pytest.mark.parametrize("kind", sorted(LOW))
@pytest.mark.parametrize("shape,offset", [((2, 3, 7, 7), 0), ((1, 2, 9, 5), 2),
                                          ((1, 1, 64, 64), 0), ((1, 2, 5, 4), None),
                                          ((1, 1, 200, 130), 0), ((1, 2, 130, 70), 60)])
def test_softmax_grad_is_the_xp_backward_rounded(host_kernels, kind, shape, offset):
    s = scores(kind, shape, seed=7 + sum(shape))
    ds = scores(kind, shape, seed=11 + sum(shape), spread=0.5)
    _, lse = run_softmax(kind, s, offset)
    got_p, got_g = fused_low.softmax_grad_t(np, s.copy(), ds.copy(), lse, offset)
    p, g = reference_grad(s.astype(np.float32), ds.astype(np.float32), lse, offset)
    got_p, got_g = got_p.astype(np.float32), got_g.astype(np.float32)
    assert np.all(got_p[p == 0] == 0)
    np.testing.assert_allclose(got_p, p, rtol=ULP[kind], atol=TINY[kind])
    np.testing.assert_allclose(got_g, g, rtol=ULP[kind], atol=1e-5 * np.abs(g).max())
    assert np.all(got_g[p == 0] == 0)


def test_softmax_grad_gives_zero_rows_the_probabilities_sum_to_one(host_kernels):
    """sum_s ds = sum_s (dp - row) p = row - row: the rounded ds sums to ~0 per column."""
    shape = (2, 2, 150, 150)                                # several chunks a column
    s, ds = scores("bfloat16", shape, 5), scores("bfloat16", shape, 6, spread=1.0)
    _, lse = run_softmax("bfloat16", s, 0)
    g = fused_low.softmax_grad_t(np, s.copy(), ds.copy(), lse, 0)[1].astype(np.float32)
    assert np.abs(g.sum(axis=-2)).max() < 0.05 * np.abs(g).sum(axis=-2).max()


class HostLaunch:
    """fused_low.kernels' dict entry on the host: called as cupy's kernel is (its parameters
    in order), n taken from its one element-wise array (lse)."""

    calls = []

    def __init__(self, kernel):
        self.kernel = kernel

    def __call__(self, *args):
        HostLaunch.calls.append(self.kernel.name)
        n = next(a.size for a, p in zip(args, self.kernel.params)
                 if p[0] != "raw" and np.ndim(a))
        flat = [np.ascontiguousarray(a) if np.ndim(a) else a for a in args]   # strided: a copy
        self.kernel(n, *flat)
        for a, f in zip(args, flat):
            if np.ndim(a) and f is not a:
                a[...] = f                                     # ... written back


def on_host_kernels(m, built):
    """Inside monkeypatch context m: nn/fused.py's switch on and fused_low's kernels the
    host-built ones (so numpy runs the cupy path's wiring)."""
    from mpishard.nn import fused
    m.setattr(fused, "use", lambda xp: True)
    m.setattr(fused_low, "kernels", lambda xp, name: {
        k: HostLaunch(built[name, k]) for k in fused_low.ELEMENTWISE})


@pytest.mark.parametrize("kind", sorted(LOW))
@pytest.mark.parametrize("cls", ["gpt", "llama"])
def test_the_attention_layer_on_the_16_bit_path_equals_the_float32_one(built, monkeypatch,
                                                                        kind, cls):
    """The wiring (attention.py's 16-bit path, the layers' saved lse and p None), run on
    numpy with a `Narrow` cast and the host-built kernels standing in for cupy's, against
    the float32 path of the same layer: output and input gradient within 8 16-bit ulps of
    their scale (the layouts-16 bound), and the 16-bit path keeps no probabilities."""
    from mpishard.nn import autocast, transformer
    from mpishard.models.llama.attention import GroupedQueryAttention, KVHeads

    rng = np.random.default_rng(3)
    b, t, h, dh = 2, 12, 2, 8
    if cls == "gpt":
        make, width = (lambda: transformer.CausalSelfAttention(h)), 3 * h * dh
    else:
        heads = KVHeads(4, 2)
        make, width = (lambda: GroupedQueryAttention(heads)), (4 + 2 * 2) * dh
    a = rng.normal(0, 1.5, (b, t, width)).astype(np.float32)
    dy = rng.normal(0, 1, (b, t, (4 if cls == "llama" else h) * dh)).astype(np.float32)

    def run(low_path):
        unit = make()
        unit.autocast = autocast.Narrow(LOW[kind])
        with monkeypatch.context() as m:
            if low_path:
                on_host_kernels(m, built)
            y = unit.forward(a.copy(), mb=0, record=True)
            kept = unit.tape[0][-1]                               # the probabilities, or None
            return y, unit.backward(dy.copy(), mb=0), kept

    y0, da0, p0 = run(False)
    HostLaunch.calls.clear()
    y1, da1, p1 = run(True)
    assert [c for c in HostLaunch.calls if "softmax" in c] == [
        f"mpishard_softmax16_{k}" for k in ("stats", "combine", "write32", "grad_stats",
                                            "grad_combine", "grad_write32")]
    tol = 8 * ULP[kind]
    assert np.abs(y1 - y0).max() <= tol * np.abs(y0).max()
    assert np.abs(da1 - da0).max() <= tol * np.abs(da0).max()
    assert p0 is not None and p0.dtype == np.float32 and p1 is None


@pytest.mark.parametrize("kind", sorted(LOW))
def test_round_in_place_rounds_as_the_16_bit_cast(built, kind):
    rng = np.random.default_rng(9)
    x = np.concatenate([rng.normal(0, 1, 500), rng.normal(0, 1e-6, 100) * 1e-30,
                        [0.0, -0.0, np.inf, -np.inf, np.nan, -np.nan, 3.4e38, -3.4e38, 7e4,
                         65519.0, 65520.0, 2.0 ** -25, 2.0 ** -24 * 1.5]]).astype(np.float32)
    y = x.copy()
    built[kind, "round"](y.size, y, y)
    with np.errstate(over="ignore"):                        # float16: 7e4 is inf
        want = x.astype(LOW[kind]).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(y), np.isnan(want))
    ok = ~np.isnan(want)
    assert np.array_equal(y[ok].view(np.uint32), want[ok].view(np.uint32))   # bit for bit


@pytest.mark.parametrize("kind", sorted(LOW))
@pytest.mark.parametrize("index32", [True, False])
def test_a_linear_layer_adds_its_bias_and_rounds_in_one_pass(built, monkeypatch, kind,
                                                             index32):
    """layers.Linear under a `Narrow` cast with a bias: on the fused path (the host-built
    bias_round kernel standing in for cupy's) the float32 product plus the rounded bias,
    rounded once, word for word the xp path's add then rounding; in 32- and 64-bit index
    arithmetic."""
    from mpishard.nn import autocast
    from mpishard.nn.layers import Linear

    rng = np.random.default_rng(5)
    store = SimpleNamespace(params={"w": rng.normal(0, 0.3, (24, 40)).astype(np.float32),
                                    "b": rng.normal(0, 1, 40).astype(np.float32)}, grads={})
    x = rng.normal(0, 1, (3, 7, 24)).astype(np.float32)

    def run(fused_path):
        layer = Linear(LocalAccess(store), "w", "b")
        layer.autocast = autocast.Narrow(LOW[kind])
        with monkeypatch.context() as m:
            if fused_path:
                on_host_kernels(m, built)
                m.setattr(fused_low, "INDEX32", 1 << 32 if index32 else 0)
            return layer.forward(x.copy(), mb=0, record=False)

    want = run(False)
    HostLaunch.calls.clear()
    got = run(True)
    assert HostLaunch.calls == ["mpishard_bias_round16" + ("32" if index32 else "")]
    assert got.dtype == np.float32 and got.shape == (3, 7, 40)
    assert np.array_equal(got.view(np.uint32), want.view(np.uint32))

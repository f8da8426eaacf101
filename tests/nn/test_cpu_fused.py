"""The numba CPU kernels (nn/cpu_fused.py) equal the numpy ops they replace.

numba comes with the `cpu-fused` extra; without it these tests skip, unless
MPISHARD_REQUIRE_NUMBA=1, which turns the skip into a failure. Each case runs the functional
entry point twice in one process, MPISHARD_CPU_FUSED=0 (the numpy ops) and =1 (the kernels):
GELU and the linear layer's bias add bit for bit in float32 and float64; LayerNorm forward
and backward to 1e-12 of each array's largest magnitude in float64 (their sums add in another
order; `close`), 1e-5 in float32; a whole GPT train step's loss and gradients at rtol 1e-12
in float64. And the switch itself: off for other dtypes, mixed dtypes, other array modules
and MPISHARD_CPU_FUSED=0.
The attention's kernels: test_cpu_attention.py; the loss's and the embedding's:
test_cpu_rows.py.
"""
import numpy as np
import pytest
from device_double import DeviceModule
from one_step import stepper

import mpishard as ms
from mpishard.nn import cpu_fused
from mpishard.nn import functional as nn

pytestmark = pytest.mark.usefixtures("numba_kernels")


def both(fn, monkeypatch):
    """fn() with the numpy ops, then with the kernels."""
    out = []
    for flag in ("0", "1"):
        monkeypatch.setenv("MPISHARD_CPU_FUSED", flag)
        out.append(fn())
    return out


def close(got, want, rtol):
    """rtol of each array's largest magnitude (a column sum near zero after cancellation is
    judged against the size of its neighbours)."""
    for g, w in zip(got, want):
        finite = np.abs(w[np.isfinite(w)])
        np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * float(finite.max(initial=0)))


def sample(shape, dtype, seed):
    return (np.random.default_rng(seed).standard_normal(shape) * 2).astype(dtype)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(3, 5), (2, cpu_fused.CHUNK // 64 + 3, 64), (0, 4)])
def test_gelu_bit_for_bit(dtype, shape, monkeypatch):
    z = sample(shape, dtype, 0)
    z.reshape(-1)[:3] = [30.0, -30.0, 0.0][:z.size]          # tanh saturated, and 0
    off, on = both(lambda: nn.gelu_forward(z), monkeypatch)
    for a, b in zip(on, off):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    dy = sample(shape, dtype, 1)
    off, on = both(lambda: nn.gelu_backward(dy, nn.gelu_forward(z)[1]), monkeypatch)
    np.testing.assert_array_equal(on, off)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gelu_written_over_its_input(dtype, monkeypatch):
    """overwrite=True: the same y and dy/dz bit for bit, y in z's own memory (the kernel's
    in-place loop); a strided z is not written over."""
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "1")
    z = sample((3, cpu_fused.CHUNK // 64 + 5, 64), dtype, 14)
    want = nn.gelu_forward(z)
    zc = z.copy()
    got = nn.activation_forward("gelu", zc, overwrite=True)
    assert np.shares_memory(got[0], zc)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    strided = z.copy()[:, ::2]
    before = strided.copy()
    nn.gelu_forward(strided, overwrite=True)
    np.testing.assert_array_equal(strided, before)


def test_gelu_of_a_strided_view(monkeypatch):
    z = sample((8, 10), np.float64, 2)[:, ::3]
    off, on = both(lambda: nn.gelu_forward(z), monkeypatch)
    for a, b in zip(on, off):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(4, 7, 13), (5, 64), (3, 768)])
def test_layernorm_forward_and_backward(dtype, rtol, shape, monkeypatch):
    x = sample(shape, dtype, 3) + 1.5
    scale, shift = sample(shape[-1:], dtype, 4), sample(shape[-1:], dtype, 5)
    dy = sample(shape, dtype, 6)

    def run():
        y, saved = nn.layernorm_forward(x, scale, shift)
        return (y, *saved) + tuple(nn.layernorm_backward(dy, saved, scale))
    off, on = both(run, monkeypatch)
    for a, b in zip(on, off):
        assert a.dtype == b.dtype and a.shape == b.shape
    close(on, off, rtol)


def test_layernorm_of_a_strided_view(monkeypatch):
    x = sample((6, 20), np.float64, 7)[:, ::2]
    scale, shift = sample((10,), np.float64, 8), sample((10,), np.float64, 9)
    off, on = both(lambda: nn.layernorm_forward(x, scale, shift)[0], monkeypatch)
    close([on], [off], 1e-12)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_linear_bias_bit_for_bit(dtype, monkeypatch):
    """linear_forward's bias: the kernel's add runs and equals numpy's bit for bit; a bias of
    another dtype takes numpy's add."""
    x, w, b = sample((3, 4, 6), dtype, 10), sample((6, 5), dtype, 11), sample((5,), dtype, 12)
    calls = []
    kernel = cpu_fused.add_bias
    monkeypatch.setattr(cpu_fused, "add_bias", lambda *a: calls.append(kernel(*a)) or calls[-1])
    off, on = both(lambda: nn.linear_forward(x, w, b), monkeypatch)
    assert calls == [False, True]                            # the switch off, then on
    assert on.shape == (3, 4, 5)
    np.testing.assert_array_equal(on, off)
    assert not cpu_fused.add_bias(np.ones((2, 5), dtype), b.astype(np.float16))


def test_gpt_step_equals_the_numpy_ops(monkeypatch):
    """A whole GPT train step (GELU, every LayerNorm, both directions) in float64."""
    model = ms.GPT(vocab_size=29, seq_len=12, d_model=16, n_heads=4, n_layers=2)
    rng = np.random.default_rng(4)
    step = stepper(model, rng.integers(0, 29, (3, 12)), rng.integers(0, 29, (3, 12)))
    (loss0, g0), (loss1, g1) = both(step, monkeypatch)
    np.testing.assert_allclose(loss1, loss0, rtol=1e-12)
    for n, g in g0.items():
        close([g1[n]], [g], 1e-12)


def test_the_switch(monkeypatch):
    a32, a64 = np.ones(3, np.float32), np.ones(3)
    monkeypatch.delenv("MPISHARD_CPU_FUSED", raising=False)
    assert cpu_fused.use(a32) and cpu_fused.use(a64, a64)
    assert not cpu_fused.use(a32, a64)                       # mixed dtypes: the numpy ops
    assert not cpu_fused.use(np.ones(3, np.float16))
    assert not cpu_fused.use(DeviceModule().asarray(a64))         # another array module
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    assert not cpu_fused.use(a64)

"""The GPT MLP's GELU reads and writes 16 bits on cupy (activation_layer.keep_low_around):
the fc's product and bias rounded once into a 16-bit array (fused_low.add_bias_narrow), the
GELU kernel on it (cuda_ops.bias_gelu_forward; its backward recomputes the derivative from
that 16-bit input), the proj's input gradient kept in 16 bits for it.

The wiring runs on numpy here: nn/fused.py's switch on, fused_low's kernels built for the
host (tests/nn/host_kernels.py), the GELU kernels replaced by their numpy mirrors computing
in float32 and storing 16 bits (the xp path's float32 GELU, whose steps the kernel's ms_gelu
takes in its order: tests/nn/test_cuda_kernels.py checks that in float64), the norm
kernels off. Against the same block without the switch (the float32 path of the
rounding policy, values widened at each matmul output), output, input gradient and every
weight gradient are equal bit for bit: the kernels compute the same float32 operations on
the same values and round once where the float32 path rounds at the next matmul. On the
kernel path the GELU keeps its 16-bit input, not a float32 derivative, and hands the proj a
16-bit input; elsewhere nothing changes.
"""
from types import SimpleNamespace

import numpy as np
import pytest
from test_fused_low import LOW, HostLaunch, built, on_host_kernels  # noqa: F401 (fixture)

from mpishard.models.gpt.units import Block
from mpishard.nn import autocast, cuda_ops, fused, fused_low
from mpishard.nn.activation_layer import Activation
from mpishard.nn.layers import LocalAccess
from mpishard.nn.pointwise import LowSaved, gelu_forward


def xp_gelu(z32):
    """pointwise.gelu_forward's xp path on float32 z (the fused switch off meanwhile)."""
    use, fused.use = fused.use, (lambda xp: False)
    try:
        return gelu_forward(z32)
    finally:
        fused.use = use


def emulated_gelu(m):
    """cuda_ops' GELU launches on numpy: float32 arithmetic, 16-bit storage."""
    def forward(xp, z, bias=None):
        assert bias is None and z.dtype in LOW.values()
        return xp_gelu(z.astype(np.float32))[0].astype(z.dtype), z

    def backward(xp, dy, u):
        assert dy.dtype == u.dtype
        return (dy.astype(np.float32) * xp_gelu(u.astype(np.float32))[1]).astype(u.dtype)
    m.setattr(cuda_ops, "bias_gelu_forward", forward)
    m.setattr(cuda_ops, "gelu_backward", backward)
    m.setattr(cuda_ops, "norm_takes", lambda xp, x, *p: False)
    m.setattr(cuda_ops, "use", lambda xp: True)


def arriving(m, cls):
    """The dtypes of the gradients that reach cls.backward (wrapped in context m)."""
    seen, backward = [], cls.backward

    def spy(self, dy, mb=0):
        seen.append(dy.dtype)
        return backward(self, dy, mb)
    m.setattr(cls, "backward", spy)
    return seen


@pytest.mark.parametrize("kind", sorted(LOW))
@pytest.mark.parametrize("index32", [True, False])
def test_the_mlp_on_the_16_bit_kernels_equals_the_float32_path(built, monkeypatch,  # noqa: F811
                                                               kind, index32):
    rng = np.random.default_rng(2)
    d, f = 24, 64
    params = {"block_0/ln_2/scale": 1 + 0.1 * rng.standard_normal(d),
              "block_0/ln_2/shift": 0.1 * rng.standard_normal(d),
              "block_0/mlp/fc/weights": 0.3 * rng.standard_normal((d, f)),
              "block_0/mlp/fc/bias": rng.standard_normal(f),
              "block_0/mlp/proj/weights": 0.2 * rng.standard_normal((f, d)),
              "block_0/mlp/proj/bias": 0.5 * rng.standard_normal(d)}
    params = {k: v.astype(np.float32) for k, v in params.items()}
    x = rng.standard_normal((3, 5, d)).astype(np.float32)
    dy = rng.standard_normal((3, 5, d)).astype(np.float32)

    def run(kernels):
        store = SimpleNamespace(params=params, grads={k: np.zeros_like(v)
                                                      for k, v in params.items()})
        mlp = Block(LocalAccess(store), 0, 2).units[1]
        for u in mlp.units:
            if hasattr(type(u), "autocast"):
                u.autocast = autocast.Narrow(LOW[kind])
        with monkeypatch.context() as m:
            m.setenv("MPISHARD_CPU_FUSED", "0")
            if kernels:
                on_host_kernels(m, built)
                emulated_gelu(m)
                m.setattr(fused_low, "INDEX32", 1 << 32 if index32 else 0)
            seen = arriving(m, Activation)
            y = mlp.forward(x.copy(), mb=0)
            gelu = next(u for u in mlp.units if isinstance(u, Activation))
            kept = gelu.tape[0]
            dx = mlp.backward(dy.copy(), mb=0)
        return y, dx, store.grads, kept, seen

    y0, dx0, g0, kept0, seen0 = run(False)
    HostLaunch.calls.clear()
    y1, dx1, g1, kept1, seen1 = run(True)
    assert "mpishard_bias_narrow16" + ("32" if index32 else "") in HostLaunch.calls
    assert isinstance(kept1, LowSaved) and kept1[0].dtype == LOW[kind]
    assert not isinstance(kept0, LowSaved) and kept0.dtype == np.float32
    assert seen1 == [LOW[kind]] and seen0 == [np.float32]     # the proj's dx: 16 bits
    for a, b in [(y1, y0), (dx1, dx0)] + [(g1[k], g0[k]) for k in g0]:
        assert a.dtype == b.dtype == np.float32
        assert np.array_equal(a, b)


def emulated_swiglu(m):
    """cuda_ops' SwiGLU launches on numpy: float32 arithmetic in the kernel's steps
    (tests/cuda_mirror.py), stored in the input's dtype, as the kernel stores."""
    from cuda_mirror import swiglu

    def forward(xp, a):
        return swiglu(a.astype(np.float32)).astype(a.dtype)

    def backward(xp, dy, a):
        assert dy.dtype == a.dtype
        return swiglu(a.astype(np.float32), dy.astype(np.float32)).astype(a.dtype)
    m.setattr(cuda_ops, "use", lambda xp: True)
    m.setattr(cuda_ops, "norm_takes", lambda xp, x, *p: False)
    m.setattr(cuda_ops, "swiglu_forward", forward)
    m.setattr(cuda_ops, "swiglu_backward", backward)


@pytest.mark.parametrize("kind", sorted(LOW))
def test_the_llama_mlp_on_the_16_bit_kernels_equals_the_float32_kernels(monkeypatch, kind):
    """The Llama MLP (RMSNorm, gate | up, SwiGLU, down) with the SwiGLU kernels in both runs
    (emulated: the GPU's float32 path before, which ran them on float32 gate | up) and the
    16-bit path switched on in one (nn/fused.py's switch): gate | up and the down's input
    gradient reach SwiGLU in 16 bits and it keeps gate | up in 16 bits; output, input
    gradient and every weight gradient equal bit for bit."""
    import mpishard as ms
    from mpishard.models.llama.attention import KVHeads
    from mpishard.models.llama.units import LlamaBlock, SwiGLU
    rng = np.random.default_rng(4)
    model = ms.Llama(32, 8, 16, 2, 1, n_kv_heads=1, d_ff=24)
    params = {k: v.astype(np.float32) for k, v in model.init(seed=3).items()
              if "/ln_2/" in k or "/mlp/" in k}
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    dy = rng.standard_normal((3, 5, 16)).astype(np.float32)

    def run(low):
        store = SimpleNamespace(params=params, grads={k: np.zeros_like(v)
                                                      for k, v in params.items()})
        mlp = LlamaBlock(model, LocalAccess(store), 0, KVHeads(2, 1)).units[1]
        for u in mlp.units:
            if hasattr(type(u), "autocast"):
                u.autocast = autocast.Narrow(LOW[kind])
        with monkeypatch.context() as m:
            emulated_swiglu(m)
            m.setattr(fused, "use", lambda xp: low)
            seen = arriving(m, SwiGLU)
            y = mlp.forward(x.copy(), mb=0)
            kept = next(u for u in mlp.units if isinstance(u, SwiGLU)).tape[0][0]
            dx = mlp.backward(dy.copy(), mb=0)
        return y, dx, store.grads, kept, seen

    y0, dx0, g0, kept0, seen0 = run(False)
    y1, dx1, g1, kept1, seen1 = run(True)
    assert kept0.dtype == np.float32 and kept1.dtype == LOW[kind]
    assert seen1 == [LOW[kind]] and seen0 == [np.float32]     # the down's dx: 16 bits
    for a, b in [(y1, y0), (dx1, dx0)] + [(g1[k], g0[k]) for k in g0]:
        assert a.dtype == b.dtype == np.float32
        assert np.array_equal(a, b)

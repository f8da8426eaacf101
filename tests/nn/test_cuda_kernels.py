"""The algorithms of nn/cuda_src.py's kernels, mirrored in numpy, against the xp paths they
replace (float64, rtol 1e-12; AdamW bit for bit in float32 and float64).

The mirrors (tests/cuda_mirror.py) follow their kernels statement by statement. What they
cannot show (the CUDA syntax, the 16-bit loads and stores, the launch shapes) is covered by
tests/nn/test_nvrtc.py (compiled) and benchmarks/gpu_kernels_check.py (run on a GPU).
"""
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from one_step import stepper
from cuda_mirror import (adamw, attention_bwd, attention_fwd, block_sum, cross_entropy,
                         embedding_bwd, gelu,
                         layernorm_bwd, layernorm_fwd, rmsnorm_bwd, rmsnorm_fwd, swiglu)

import mpishard as ms
from mpishard.models.llama.units import RMSNorm, SwiGLU
from mpishard.nn import attention as att
from mpishard.nn import cuda_ops, cuda_src, fused
from mpishard.nn import functional as nn
from mpishard.nn.layers import LocalAccess
from mpishard.train.optim import AdamW


def rows_problem(rows=11, d=300, seed=0):
    """d > BLOCK and not a multiple of it: every thread's loop and the padding run."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, d)) * 3 + 0.5
    return x, rng.standard_normal(d), rng.standard_normal(d), rng.standard_normal((rows, d))


def close(a, b, rtol=1e-12):
    np.testing.assert_allclose(a, b, rtol=rtol, atol=rtol * float(np.abs(b).max()))


def test_block_sum_mirror_counts_every_column_once():
    v = np.arange(3 * 700, dtype=np.float64).reshape(3, 700)
    np.testing.assert_array_equal(block_sum(v)[:, 0], v.sum(axis=1))     # integers: exact


@pytest.mark.parametrize("blocks", [1, 3, 11])
def test_layernorm_kernel_algorithm_equals_functional(blocks):
    x, scale, shift, dy = rows_problem()
    y_ref, (xhat, rstd) = nn.layernorm_forward(x.copy(), scale, shift)
    y, m, rs = layernorm_fwd(x, scale, shift, nn.LN_EPS)
    close(y, y_ref)
    close(rs, rstd)
    close((x - m) * rs, xhat)
    dx, dscale, dshift = layernorm_bwd(dy, x, scale, m, rs, blocks)
    for got, want in zip((dx, dscale, dshift), nn.layernorm_backward(dy, (xhat, rstd), scale)):
        close(got, want)


@pytest.mark.parametrize("blocks", [1, 4])
def test_rmsnorm_kernel_algorithm_equals_the_llama_unit(blocks):
    x, scale, _, dy = rows_problem(seed=1)
    store = SimpleNamespace(params={"n/scale": scale}, grads={"n/scale": np.zeros_like(scale)})
    unit = RMSNorm(LocalAccess(store), "n", 1e-6)
    y_ref = unit.forward(x)
    dx_ref = unit.backward(dy)
    y, rs = rmsnorm_fwd(x, scale, 1e-6)
    close(y, y_ref)
    dx, dscale = rmsnorm_bwd(dy, x, scale, rs, blocks)
    close(dx, dx_ref)
    close(dscale, store.grads["n/scale"])


def test_bias_gelu_kernel_algorithm_equals_functional():
    rng = np.random.default_rng(2)
    z, bias, dy = 4 * rng.standard_normal((6, 33)), rng.standard_normal(33), rng.standard_normal(
        (6, 33))
    y_ref, dydz = nn.gelu_forward(z + bias)
    y, dg = gelu(z + bias)
    close(y, y_ref)
    close(dy * dg, nn.gelu_backward(dy, dydz))                 # recomputed from u = z + bias


def test_swiglu_kernel_algorithm_equals_the_llama_unit():
    rng = np.random.default_rng(3)
    a, dy = 3 * rng.standard_normal((2, 5, 14)), rng.standard_normal((2, 5, 7))
    unit = SwiGLU()
    close(swiglu(a), unit.forward(a))
    close(swiglu(a, dy), unit.backward(dy))


def test_embedding_kernel_algorithm_equals_functional():
    rng = np.random.default_rng(4)
    ids = rng.integers(0, 9, (3, 17))
    ids[0, :5] = 8                                             # long runs and unused rows
    dy = rng.standard_normal((3, 17, 6))
    close(embedding_bwd(dy, ids, 12), nn.embedding_backward(dy, ids, 12))
    ref = np.zeros((12, 6))
    np.add.at(ref, ids.reshape(-1), dy.reshape(-1, 6))        # the xp path off numpy
    close(embedding_bwd(dy, ids, 12), ref)


@pytest.mark.parametrize("offset", [0, 3, -2, None])
def test_attention_kernels_online_softmax_equals_attention_block(offset):
    """Causal at offsets 0, 3 (the keys run ahead), -2 (the first rows see no key: out 0,
    lse -inf, no gradient) and None (every key)."""
    rng = np.random.default_rng(6)
    q, dout = (rng.standard_normal((2, 3, 9, 40)) for _ in range(2))
    k, v = (rng.standard_normal((2, 3, 7, 40)) * 2 for _ in range(2))
    out_ref, lse_ref = att.attention_block(q, k, v, offset=offset)
    out, lse = attention_fwd(q, k, v, offset)
    close(out, out_ref)
    np.testing.assert_array_equal(np.isinf(lse), np.isinf(lse_ref))
    close(np.where(np.isinf(lse), 0, lse), np.where(np.isinf(lse_ref), 0, lse_ref))
    grads = attention_bwd(dout, q, k, v, out, lse, offset)
    for got, want in zip(grads, att.attention_block_backward(dout, q, k, v, out_ref, lse_ref,
                                                             offset=offset)):
        close(got, want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_adamw_kernel_algorithm_is_optim_adamw_bit_for_bit(dtype, wd):
    model = ms.MLP([5, 7, 3], activation="tanh")
    e = ms.SingleDevice(model, dtype=dtype)
    e.load_checkpoint(model.init(0))
    lr, betas, eps = 3e-3, (0.8, 0.95), 1e-6
    opt = AdamW(e, lr, betas, eps, wd)
    rng = np.random.default_rng(5)
    mine = {n: [p.copy(), np.zeros_like(p), np.zeros_like(p)]
            for n, p, _, _ in e.optimizer_shards()}
    for t in (1, 2, 3):
        for name, _, g, _ in e.optimizer_shards():
            g[...] = rng.standard_normal(g.shape).astype(dtype) * 10.0 ** -t
        hyper = cuda_ops.adamw_hyper(lr, betas, eps, wd, [t])
        for name, _, g, _ in e.optimizer_shards():
            p, m, v = mine[name]
            adamw(p, g, m, v, hyper, 0)
        opt.step()
        for name, p, _, _ in e.optimizer_shards():
            np.testing.assert_array_equal(mine[name][0], p)
            np.testing.assert_array_equal(mine[name][1], opt.state[name]["exp_avg"])
            np.testing.assert_array_equal(mine[name][2], opt.state[name]["exp_avg_sq"])


@pytest.mark.parametrize("c", [7, 300, 1000])
def test_cross_entropy_kernel_algorithm_equals_the_loss(c):
    """The kernel's algorithm (cuda_mirror.cross_entropy: a block's sum order, c below,
    above and many times the block's width) against losses.CrossEntropy's xp path on the
    same float64 logits: value and gradient to rtol 1e-12, with ignored labels, a global
    count (over) and a gradient scale (1/3: applied after the division, in the order the
    float32 path applies step_pair's scale)."""
    from mpishard.nn.losses import CrossEntropy
    rng = np.random.default_rng(c)
    y = rng.standard_normal((9, c)) * 4
    t = rng.integers(0, c, 9)
    t[[2, 5]] = -100
    keep = t != -100
    for loss, n in ((CrossEntropy(), keep.sum()), (CrossEntropy().over(13.0), 13.0)):
        value, dy = loss(y, t)
        rows, g = cross_entropy(y, np.where(keep, t, 0), keep, n, 1 / 3)
        close(-rows.sum() / n, value)
        close(g, dy * (1 / 3))
        assert not g[~keep].any()


def test_storage_dtypes_and_switch():
    assert [cuda_ops.suffix(d) for d in (np.float64, np.float32, np.float16, np.uint16)] == [
        "f64", "f32", "f16", "bf16"]
    assert cuda_ops.acc_dtype(np.float16) == np.float32
    assert cuda_ops.acc_dtype(np.float64) == np.float64
    with pytest.raises(TypeError, match="int32"):
        cuda_ops.suffix(np.int32)
    assert cuda_ops.use is fused.use and not cuda_ops.use(np)


def test_every_launched_kernel_is_defined():
    text = Path(cuda_ops.__file__).read_text()
    launched = set(re.findall(r'_launch\(xp, "(\w+)"', text)) | set(
        re.findall(r'entry_name\("(\w+)"', text))
    assert len(launched) == 15
    for kernel in launched:
        suffixes = ("f64", "f32") if kernel == "adamw" else tuple(cuda_src.SUFFIXES)
        for s in suffixes:
            assert cuda_src.entry_name(kernel, s) in cuda_src.ENTRIES


def mirrored_norms(monkeypatch):
    """cuda_ops' norm launches replaced by their numpy mirrors, taken on numpy float64 (the
    layers' wiring: what they save, the arguments' order, the shapes of the statistics)."""
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    monkeypatch.setattr(cuda_ops, "norm_takes", lambda xp, x, *p: True)
    def blocks(x):                                          # as cuda_ops launches them
        return max(min(x.size // x.shape[-1], cuda_ops.NORM_BWD_BLOCKS), 1)

    def rows(x):
        return x.reshape(-1, x.shape[-1])

    def ln_fwd(xp, x, scale, shift, eps):
        y, m, rs = layernorm_fwd(rows(x), scale, shift, eps)
        return y.reshape(x.shape), m.reshape(x.shape[:-1]), rs.reshape(x.shape[:-1])

    def ln_bwd(xp, dy, x, scale, mean, rstd):
        dx, ds, db = layernorm_bwd(rows(dy), rows(x), scale, mean.reshape(-1, 1),
                                   rstd.reshape(-1, 1), blocks(x))
        return dx.reshape(dy.shape), ds, db

    def rms_fwd(xp, x, scale, eps):
        y, rs = rmsnorm_fwd(rows(x), scale, eps)
        return y.reshape(x.shape), rs.reshape(x.shape[:-1])

    def rms_bwd(xp, dy, x, scale, rstd):
        dx, ds = rmsnorm_bwd(rows(dy), rows(x), scale, rstd.reshape(-1, 1), blocks(x))
        return dx.reshape(dy.shape), ds

    calls = []

    def counted(name, fn):
        def call(*args):
            calls.append(name)
            return fn(*args)
        return call
    for name, fn in (("layernorm_forward", ln_fwd), ("layernorm_backward", ln_bwd),
                     ("rmsnorm_forward", rms_fwd), ("rmsnorm_backward", rms_bwd)):
        monkeypatch.setattr(cuda_ops, name, counted(name, fn))
    return calls


@pytest.mark.parametrize("model", ["gpt", "llama"])
def test_the_norm_kernels_wired_into_a_model_step_equal_the_xp_path(monkeypatch, model):
    """A float64 train step of a tiny GPT (LayerNorm) and Llama (RMSNorm) with the norms on
    cuda_ops' kernels (their mirrors) equals the xp path's: loss and every gradient, rtol
    1e-12, the kernels called once each way per norm."""
    sizes = dict(vocab_size=17, seq_len=8, d_model=16, n_heads=4, n_layers=2)
    net = ms.GPT(**sizes) if model == "gpt" else ms.Llama(**sizes, n_kv_heads=2, d_ff=24)
    rng = np.random.default_rng(4)
    step = stepper(net, rng.integers(0, 17, (3, 8)), rng.integers(0, 17, (3, 8)))
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    loss0, g0 = step()
    with monkeypatch.context() as m:
        calls = mirrored_norms(m)
        loss1, g1 = step()
    norm = "layernorm" if model == "gpt" else "rmsnorm"
    n = 2 * 2 + 1                                          # two a block, and the final one
    assert calls == [f"{norm}_forward"] * n + [f"{norm}_backward"] * n
    assert loss1 == pytest.approx(loss0, rel=1e-12)
    assert sorted(g1) == sorted(g0)
    for k in g0:
        close(g1[k], g0[k])


def test_rmsnorm_keeps_its_own_copy_of_the_input(monkeypatch):
    mirrored_norms(monkeypatch)
    x, scale, _, dy = rows_problem(seed=1)
    store = SimpleNamespace(params={"n/scale": scale}, grads={"n/scale": np.zeros_like(scale)})
    unit = RMSNorm(LocalAccess(store), "n", 1e-6)
    want = RMSNorm(LocalAccess(SimpleNamespace(params={"n/scale": scale}, grads={
        "n/scale": np.zeros_like(scale)})), "n", 1e-6)
    want.forward(x.copy())
    unit.forward(x)
    assert unit.tape[0][0] is not x and unit.tape[0][2] is True   # the kernel's tape
    x[...] = 0                                             # e.g. a reused receive buffer
    close(unit.backward(dy), want.backward(dy))


def test_a_norm_keeps_its_own_copy_of_the_input(monkeypatch):
    mirrored_norms(monkeypatch)
    x, scale, shift, dy = rows_problem()
    want = nn.layernorm_backward(dy, nn.layernorm_forward(x.copy(), scale, shift)[1], scale)
    y, saved = nn.layernorm_forward(x, scale, shift)
    assert len(saved) == 3 and saved[0] is not x
    x[...] = 0                                             # e.g. a reused receive buffer
    for got, w in zip(nn.layernorm_backward(dy, saved, scale), want):
        close(got, w)


def mirrored_swiglu(monkeypatch):
    """cuda_ops' SwiGLU launches replaced by their numpy mirror, taken on numpy float64."""
    monkeypatch.setattr(cuda_ops, "swiglu_takes", lambda xp, a: True)
    calls = []
    monkeypatch.setattr(cuda_ops, "swiglu_forward",
                        lambda xp, a: calls.append("forward") or swiglu(a))
    monkeypatch.setattr(cuda_ops, "swiglu_backward",
                        lambda xp, dy, a: calls.append("backward") or swiglu(a, dy))
    return calls


def test_the_swiglu_kernels_wired_into_a_llama_step_equal_the_xp_path(monkeypatch):
    """A float64 Llama train step with SwiGLU on cuda_ops' kernels (their mirror) equals the
    xp path's, loss and every gradient at rtol 1e-12, each kernel once per block."""
    net = ms.Llama(vocab_size=17, seq_len=8, d_model=16, n_heads=4, n_layers=2, n_kv_heads=2,
                   d_ff=24)
    rng = np.random.default_rng(5)
    step = stepper(net, rng.integers(0, 17, (3, 8)), rng.integers(0, 17, (3, 8)))
    loss0, g0 = step()
    with monkeypatch.context() as m:
        calls = mirrored_swiglu(m)
        loss1, g1 = step()
    assert calls == ["forward"] * 2 + ["backward"] * 2
    assert loss1 == pytest.approx(loss0, rel=1e-12)
    for k in g0:
        close(g1[k], g0[k])


def test_swiglu_keeps_its_input_alone(monkeypatch):
    """On the kernels the tape holds the input (2 F a token, not gate, up, s and silu); a
    gradient of another dtype takes the xp ops from it, s recomputed."""
    calls = mirrored_swiglu(monkeypatch)
    rng = np.random.default_rng(6)
    a, dy = 3 * rng.standard_normal((2, 5, 14)), rng.standard_normal((2, 5, 7))
    unit = SwiGLU()
    unit.forward(a)
    assert len(unit.tape[0]) == 1 and unit.tape[0][0] is a
    close(unit.backward(dy), swiglu(a, dy))
    unit.forward(a)
    got = unit.backward(dy.astype(np.float32))               # not the kernel: the xp ops
    assert calls == ["forward", "backward", "forward"]
    np.testing.assert_allclose(got, swiglu(a, dy), rtol=1e-6)

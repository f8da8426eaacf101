"""The algorithms of nn/cuda_src.py's kernels, mirrored in numpy, against the xp paths they
replace (float64, rtol 1e-12; AdamW bit for bit in float32 and float64).

A mirror follows its kernel statement by statement: the block reduction's order (thread t
sums columns t, t + BLOCK, ... ; a butterfly of shuffles over each warp's 32 lanes; the
warps' partials added in order), the norms' backward recomputing xhat / n from x and the
saved statistics and summing the parameter gradients per block of rows, GELU's derivative
recomputed from u, SwiGLU's sigmoid recomputed from the gate, the embedding backward's
stable sort and runs, AdamW's host scalars rounded to the dtype. What the mirrors cannot
show (the CUDA syntax, the 16-bit loads and stores, the launch shapes) is covered by
tests/nn/test_nvrtc.py (compiled) and benchmarks/gpu_kernels_check.py (run on a GPU).
"""
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

import mpishard as ms
from mpishard.models.llama.units import RMSNorm, SwiGLU
from mpishard.nn import cuda_ops, cuda_src, fused
from mpishard.nn import functional as nn
from mpishard.nn.layers import LocalAccess
from mpishard.train.optim import AdamW

BLOCK = cuda_src.BLOCK


def block_sum(v):
    """ms_block_sum over each row of v (rows, d), in the kernel's order."""
    rows, d = v.shape
    k = -(-d // BLOCK)
    lanes = np.zeros((rows, k * BLOCK), dtype=v.dtype)
    lanes[:, :d] = v                                 # zeros beyond d: exact additions
    lanes = lanes.reshape(rows, k, BLOCK)
    t = lanes[:, 0].copy()
    for j in range(1, k):                            # thread t: columns t, t + BLOCK, ...
        t += lanes[:, j]
    w = t.reshape(rows, BLOCK // 32, 32)
    lane = np.arange(32)
    for o in (16, 8, 4, 2, 1):                       # __shfl_xor_sync butterfly
        w = w + w[..., lane ^ o]
    total = w[:, 0, 0].copy()
    for j in range(1, BLOCK // 32):                  # the warps' partials, in order
        total += w[:, j, 0]
    return total[:, None]


def layernorm_fwd(x, scale, shift, eps):
    d = x.shape[-1]
    m = block_sum(x) / d
    xc = x - m
    rs = 1 / np.sqrt(block_sum(xc * xc) / d + eps)
    return ((x - m) * rs) * scale + shift, m, rs


def per_block(rows, blocks, fn):
    """Sum over blocks b of the per-row values fn(r) for r = b, b + blocks, ... in order."""
    parts = []
    for b in range(blocks):
        acc = None
        for r in range(b, rows, blocks):
            acc = fn(r) if acc is None else acc + fn(r)
        parts.append(acc)
    return np.sum(parts, axis=0)


def layernorm_bwd(dy, x, scale, m, rs, blocks):
    d = x.shape[-1]
    xh = (x - m) * rs
    g = dy * scale
    c0, c1 = block_sum(g) / d, block_sum(g * xh) / d
    dx = ((dy * scale - c0) - xh * c1) * rs
    return (dx, per_block(len(x), blocks, lambda r: dy[r] * xh[r]),
            per_block(len(x), blocks, lambda r: dy[r]))


def rmsnorm_fwd(x, scale, eps):
    rs = 1 / np.sqrt(block_sum(x * x) / x.shape[-1] + eps)
    return (x * rs) * scale, rs


def rmsnorm_bwd(dy, x, scale, rs, blocks):
    n = x * rs
    c1 = block_sum((dy * scale) * n) / x.shape[-1]
    return (dy * scale - n * c1) * rs, per_block(len(x), blocks, lambda r: dy[r] * n[r])


def gelu(z):
    """ms_gelu's steps (fused._GELU's)."""
    c = np.sqrt(2 / np.pi)
    s = z * z
    h = s * (0.044715 * c)
    h += c
    h *= z
    h = np.tanh(h)
    h += 1
    h *= 0.5
    s *= 6 * 0.044715 * c
    s += 2 * c
    s *= z
    s *= 1 - h
    s += 1
    return z * h, h * s


def swiglu(a, dy=None):
    f = a.shape[-1] // 2
    g, u = a[..., :f], a[..., f:]
    s = 0.5 * (np.tanh(0.5 * g) + 1)
    if dy is None:
        return (g * s) * u
    slope = ((1 - s) * g + 1) * s
    return np.concatenate([(dy * u) * slope, dy * (g * s)], axis=-1)


def embedding_bwd(dy, ids, rows):
    flat, dy2 = ids.reshape(-1), dy.reshape(-1, dy.shape[-1])
    order = np.argsort(flat, kind="stable")
    sorted_ids = flat[order]
    starts = np.r_[np.flatnonzero(np.r_[True, sorted_ids[1:] != sorted_ids[:-1]]), flat.size]
    g = np.zeros((rows, dy2.shape[1]), dtype=dy.dtype)
    for k in range(len(starts) - 1):
        acc = np.zeros(dy2.shape[1], dtype=dy.dtype)
        for j in range(starts[k], starts[k + 1]):
            acc += dy2[order[j]]
        g[sorted_ids[starts[k]]] = acc
    return g


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
        per, decay, omb1, b2, omb2, eps_ = cuda_ops.adamw_hyper(lr, betas, eps, wd, [t])
        s = np.dtype(dtype).type
        for name, _, g, _ in e.optimizer_shards():                 # the kernel's statements
            p, m, v = mine[name]
            step_size, bc2 = (s(x) for x in per[0])
            p *= s(decay)
            m += s(omb1) * (g - m)
            v[...] = v * s(b2)
            v += s(omb2) * (g * g)
            p -= step_size * (m / (np.sqrt(v) / bc2 + s(eps_)))
        opt.step()
        for name, p, _, _ in e.optimizer_shards():
            np.testing.assert_array_equal(mine[name][0], p)
            np.testing.assert_array_equal(mine[name][1], opt.state[name]["exp_avg"])
            np.testing.assert_array_equal(mine[name][2], opt.state[name]["exp_avg_sq"])


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
    assert len(launched) == 11
    for kernel in launched:
        suffixes = ("f64", "f32") if kernel == "adamw" else tuple(cuda_src.SUFFIXES)
        for s in suffixes:
            assert cuda_src.entry_name(kernel, s) in cuda_src.ENTRIES

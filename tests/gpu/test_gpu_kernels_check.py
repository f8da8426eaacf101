"""The GPU check's kernel part (benchmarks/gpu_kernels_check.py) on the CPU, so it cannot rot.

The CUDA kernels cannot run here, so cuda_ops' functions are replaced by numpy emulations of
the kernels (tests/cuda_mirror.py's algorithms, computed in the kernel's A: float32 for a
16-bit input, and stored as the kernel stores: bfloat16 words by parallel/bf16.py's rounding,
float16 by numpy's cast). check_kernels(numpy) at small sizes must then give a passing row
for every kernel and storage dtype: its plumbing (storage, widening, the xp paths, the
comparison) works, and its 16-bit tolerances hold for float32 arithmetic rounded once to 16
bits, which is what the kernels do. A wrong kernel output fails its row.
"""
import sys
from pathlib import Path

import numpy as np
import pytest

import cuda_mirror as mirror
from mpishard.nn import cuda_ops
from mpishard.parallel import bf16

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_kernels_check as check  # noqa: E402


def acc(a):
    """A storage array as the kernel reads it (A-typed)."""
    if a.dtype == np.uint16:
        return bf16.float32_by_ops(np, a)
    return a.astype(np.float32) if a.dtype == np.float16 else a


def out(v, like):
    """An A-typed result stored as `like`'s dtype, as the kernel's ms_st."""
    return bf16.words_by_ops(np, v) if like.dtype == np.uint16 else v.astype(like.dtype)


def blocks(x):
    return max(min(x.size // x.shape[-1], cuda_ops.NORM_BWD_BLOCKS), 1)


class Emulated:
    """cuda_ops' functions, with the kernels' numerics, on numpy."""

    @staticmethod
    def layernorm_forward(xp, x, scale, shift, eps):
        a = acc(x)
        y, m, rs = mirror.layernorm_fwd(a, acc(scale), acc(shift), a.dtype.type(eps))
        return out(y, x), m[:, 0], rs[:, 0]

    @staticmethod
    def layernorm_backward(xp, dy, x, scale, mean, rstd):
        dx, ds, db = mirror.layernorm_bwd(acc(dy), acc(x), acc(scale), mean[:, None],
                                          rstd[:, None], blocks(x))
        return out(dx, x), ds, db

    @staticmethod
    def rmsnorm_forward(xp, x, scale, eps):
        a = acc(x)
        y, rs = mirror.rmsnorm_fwd(a, acc(scale), a.dtype.type(eps))
        return out(y, x), rs[:, 0]

    @staticmethod
    def rmsnorm_backward(xp, dy, x, scale, rstd):
        dx, ds = mirror.rmsnorm_bwd(acc(dy), acc(x), acc(scale), rstd[:, None], blocks(x))
        return out(dx, x), ds

    @staticmethod
    def bias_gelu_forward(xp, z, bias=None):
        u = acc(z) + acc(bias)                  # y from u in A; u stored for the backward
        return out(mirror.gelu(u)[0], z), out(u, z)

    @staticmethod
    def gelu_backward(xp, dy, u):
        return out(acc(dy) * mirror.gelu(acc(u))[1], u)

    @staticmethod
    def swiglu_forward(xp, a):
        return out(mirror.swiglu(acc(a)), a)

    @staticmethod
    def swiglu_backward(xp, dy, a):
        return out(mirror.swiglu(acc(a), acc(dy)), a)

    @staticmethod
    def residual_add(xp, h, branch):
        h += acc(branch)
        return h

    @staticmethod
    def embedding_backward(xp, dy, ids, rows):
        return out(mirror.embedding_bwd(acc(dy), ids, rows), dy)

    @staticmethod
    def attention_forward(xp, q, k, v, offset=None):
        o, lse = mirror.attention_fwd(acc(q), acc(k), acc(v), offset)
        return out(o, q), lse.astype(cuda_ops.acc_dtype(q.dtype))

    @staticmethod
    def attention_backward(xp, dout, q, k, v, o, lse, offset=None):
        return tuple(out(g, q) for g in mirror.attention_bwd(acc(dout), acc(q), acc(k),
                                                             acc(v), acc(o), lse, offset))

    @staticmethod
    def cross_entropy(xp, y2, labels, keep, n, scale=1.0):
        a = acc(y2)
        rows, g = mirror.cross_entropy(a, labels, keep, a.dtype.type(n), scale)
        return rows, out(g, y2)

    @staticmethod
    def adamw_step(xp, blocks_, lr, betas, eps, weight_decay):
        hyper = cuda_ops.adamw_hyper(lr, betas, eps, weight_decay, [b[4] for b in blocks_])
        for k, (p, g, m, v, _) in enumerate(blocks_):
            mirror.adamw(p, g, m, v, hyper, k)


@pytest.fixture
def emulated(monkeypatch):
    for name, fn in vars(Emulated).items():
        if not name.startswith("_"):
            monkeypatch.setattr(cuda_ops, name, fn.__func__)
    for name, value in dict(ROWS=40, D=300, F=24, VOCAB=50, ATT=(2, 3, 20, 40),
                            LOSS_ROWS=30).items():
        monkeypatch.setattr(check, name, value)
    monkeypatch.setattr(check, "seconds", lambda xp, fn, reps=1: (fn(), 1.0)[1])


def test_every_kernel_row_passes_on_the_emulated_kernels(emulated):
    rows = check.check_kernels(np)
    for r in rows:
        print(r)
    assert sorted((r["kernel"], r["dtype"]) for r in rows) == sorted(
        [(k, m) for k in ("layernorm", "rmsnorm", "bias_gelu", "swiglu", "residual_add",
                          "embedding_bwd", "attention", "cross_entropy") for m in check.MODES]
        + [("adamw", "float64"), ("adamw", "float32")])
    assert all(r["ok"] for r in rows), [r for r in rows if not r["ok"]]
    assert all(r["exact"] for r in rows if r["kernel"] == "adamw")
    worst16 = max(r["max_rel_diff"] for r in rows if r["dtype"] == "bfloat16")
    assert 2.0 ** -10 < worst16 < check.RTOL["bfloat16"]     # 16-bit rounding is what shows


def test_a_loss_kernel_that_loses_the_small_gradients_fails(emulated, monkeypatch):
    """The cross entropy's rows hold each gradient element to its own size: a kernel that
    writes 0 where the gradient is small (under a tenth of the largest) fails every dtype's
    row, though rtol of the largest element would let it pass."""
    def lossy(xp, y2, labels, keep, n, scale=1.0):
        rows, g = Emulated.cross_entropy(xp, y2, labels, keep, n, scale)
        wide = acc(g)
        return rows, out(np.where(np.abs(wide) < 0.1 * np.abs(wide).max(), 0, wide), y2)
    monkeypatch.setattr(cuda_ops, "cross_entropy", lossy)
    rows = {(r["kernel"], r["dtype"]): r for r in check.check_kernels(np)}
    assert not any(rows[("cross_entropy", m)]["ok"] for m in check.MODES)
    assert rows[("layernorm", "bfloat16")]["ok"]


def test_a_loss_kernel_that_reads_outside_the_row_on_a_bad_label_fails(emulated, monkeypatch):
    """The cross entropy's row also runs labels outside [0, C): a kernel that does not give
    those rows nan (here: clips the label into the row) fails it."""
    def clipping(xp, y2, labels, keep, n, scale=1.0):
        return Emulated.cross_entropy(xp, y2, np.clip(labels, 0, y2.shape[1] - 1), keep, n,
                                      scale)
    monkeypatch.setattr(cuda_ops, "cross_entropy", clipping)
    rows = {(r["kernel"], r["dtype"]): r for r in check.check_kernels(np)}
    assert not any(rows[("cross_entropy", m)]["ok"] for m in check.MODES)
    assert not any(rows[("cross_entropy", m)]["bad_labels_nan"] for m in check.MODES)


def test_a_wrong_kernel_fails_its_row(emulated, monkeypatch):
    monkeypatch.setattr(cuda_ops, "swiglu_backward",
                        lambda xp, dy, a: out(mirror.swiglu(acc(a), acc(dy)) * 1.01, a))
    rows = {(r["kernel"], r["dtype"]): r for r in check.check_kernels(np)}
    assert not any(rows[("swiglu", m)]["ok"] for m in ("float64", "float32", "float16"))
    assert rows[("layernorm", "float32")]["ok"]

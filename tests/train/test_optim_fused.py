"""AdamW's numba update (train/optim_fused.py) is bit for bit the numpy update.

numba comes with the `cpu-fused` extra; without it these tests skip, unless
MPISHARD_REQUIRE_NUMBA=1, which turns the skip into a failure. Each case runs the same
AdamW steps with MPISHARD_CPU_FUSED=0 (optim.AdamW's numpy ops) and =1 (the kernel) on the
same gradients and compares parameters and both moments exactly, float32 and float64.
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.train import optim_fused
from mpishard.train.optim import AdamW

pytestmark = pytest.mark.usefixtures("numba_kernels")


def run(dtype, flag, monkeypatch, wd, betas, eps, steps=4):
    """Parameters and AdamW state after `steps` steps on fixed random gradients."""
    monkeypatch.setenv("MPISHARD_CPU_FUSED", flag)
    model = ms.MLP([6, 16, 8, 3], activation="tanh")
    engine = ms.SingleDevice(model, dtype=dtype)
    engine.load_checkpoint(model.init(0))
    opt = AdamW(engine, 0.01, betas, eps, wd)
    rng = np.random.default_rng(1)
    for _ in range(steps):
        for g in engine.grads.values():
            g[...] = rng.standard_normal(g.shape) * rng.choice([1e-6, 1.0, 1e3])
        opt.step(engine.grads)
    return {k: (engine.params[k].copy(), opt.state[k]["exp_avg"].copy(),
                opt.state[k]["exp_avg_sq"].copy()) for k in engine.params}


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("wd,betas,eps", [(0.01, (0.9, 0.999), 1e-8), (0.0, (0.8, 0.99), 1e-3),
                                          (0.3, (0.0, 0.5), 1e-6)])
def test_adamw_bit_for_bit(dtype, wd, betas, eps, monkeypatch):
    off = run(dtype, "0", monkeypatch, wd, betas, eps)
    on = run(dtype, "1", monkeypatch, wd, betas, eps)
    for k, arrays in off.items():
        for a, b in zip(on[k], arrays):
            assert a.dtype == np.dtype(dtype)
            np.testing.assert_array_equal(a, b, err_msg=k)


def test_kernel_updates_contiguous_blocks_in_place(monkeypatch):
    """p, m, v are written through flat views, so they must be C-contiguous; g is only read
    (a strided g is read through a copy, the same numbers)."""
    monkeypatch.delenv("MPISHARD_CPU_FUSED", raising=False)
    rng = np.random.default_rng(2)
    strided = rng.standard_normal((4, 12))[:, ::2]
    zeros = np.zeros((4, 6))
    assert optim_fused.usable(zeros.copy(), strided, zeros.copy(), zeros.copy())
    assert not optim_fused.usable(strided, zeros.copy(), zeros.copy(), zeros.copy())
    assert not optim_fused.usable(zeros.copy(), zeros, zeros.copy(), zeros.astype(np.float32))
    states = []
    for g in (strided, strided.copy()):
        p, m, v = np.ones((4, 6)), zeros.copy(), zeros.copy()
        optim_fused.adamw(p, g, m, v, 0.1, (0.9, 0.999), 1e-8, 0.01, 1)
        states.append((p, m, v))
    for a, b in zip(*states):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(states[0][0], np.ones((4, 6)))
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")
    assert not optim_fused.usable(zeros, zeros, zeros, zeros)

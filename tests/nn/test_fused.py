"""Fused cupy kernels (nn/fused.py) against the xp ops they replace.

Everywhere: the dispatch. numpy and the strict device double (tests/device_double.py) never
take the fused path (`fused.use` is False), so attention forward/backward, GELU and cross
entropy are bit for bit the same whatever MPISHARD_FUSED says, and softmax_grad_t's xp ops
are (ds - row) p. On real cupy with a GPU (skipped cleanly without one): each kernel against
the same function with MPISHARD_FUSED=0 (the xp ops, on the GPU) in float64 to rtol 1e-12 of
each array's largest magnitude (sums run in another order), on shapes with odd sizes, causal
offsets 0, positive, negative (rows that see no key) and None, GELU over a wide range of z,
cross entropy on (B, T, C) logits; float32 to 1e-5; and a whole fused GPT step in float64
equals numpy's.
"""
import numpy as np
import pytest
from device_double import DeviceModule

import mpishard as ms
from mpishard.nn import functional as nn
from mpishard.comm.gpu import try_import_cupy
from mpishard.nn import attention as att
from mpishard.nn import fused


def gpu_cupy():
    cupy = try_import_cupy()
    try:
        return cupy if cupy is not None and cupy.cuda.runtime.getDeviceCount() > 0 else None
    except Exception:
        return None


CUPY = gpu_cupy()
needs_gpu = pytest.mark.skipif(CUPY is None, reason="needs cupy and a GPU")


def problem(xp, dtype, b=2, h=3, tq=37, tk=41, dh=8, seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, dout = (xp.asarray(rng.standard_normal(s).astype(dtype)) for s in
                     [(b, h, tq, dh), (b, h, tk, dh), (b, h, tk, dh), (b, h, tq, dh)])
    return q, k, v, dout


def attention_all(q, k, v, dout, offset):
    out, lse, p = att.attention_block(q, k, v, offset=offset, keep_probs=True)
    grads = att.attention_block_backward(dout, q, k, v, out, lse, offset=offset, probs=p)
    grads_recomputed = att.attention_block_backward(dout, q, k, v, out, lse, offset=offset)
    return (out, lse, p) + tuple(grads) + tuple(grads_recomputed)


def gelu_and_loss(xp, dtype, seed=1):
    rng = np.random.default_rng(seed)
    z = xp.asarray((4 * rng.standard_normal((5, 7, 33))).astype(dtype))
    logits = xp.asarray((3 * rng.standard_normal((3, 5, 29))).astype(dtype))
    labels = rng.integers(0, 29, (3, 5))
    labels[rng.random((3, 5)) < 0.3] = -100                     # ignored targets (ignore_index)
    labels = xp.asarray(labels)
    loss = ms.losses.CrossEntropy()
    value, dy = loss(logits, labels)
    over, d_over = loss.over(7.5)(logits, labels)                # the global-token divisor
    return nn.gelu_forward(z) + (xp.asarray(np.array(value)), dy,
                                 xp.asarray(np.array(over)), d_over)


def host(a, xp):
    return a if xp is np else (a.get() if hasattr(a, "get") else xp.asnumpy(a))


@pytest.mark.parametrize("module", ["numpy", "device"])
def test_fused_never_runs_off_cupy(module, monkeypatch):
    xp = np if module == "numpy" else DeviceModule()
    assert not fused.use(xp)
    runs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("MPISHARD_FUSED", flag)
        assert not fused.use(xp)
        runs[flag] = [host(a, xp) for a in attention_all(*problem(xp, np.float64), offset=4)
                      + gelu_and_loss(xp, np.float64)]
    for a, b in zip(runs["1"], runs["0"]):
        np.testing.assert_array_equal(a, b)


def test_softmax_grad_xp_ops():
    rng = np.random.default_rng(3)
    ds, p = rng.standard_normal((2, 3, 5, 4)), rng.random((2, 3, 5, 4))
    row = rng.standard_normal((2, 3, 4))
    want = (ds - row[..., None, :]) * p
    got = fused.softmax_grad_t(np, ds.copy(), row, p)
    np.testing.assert_array_equal(got, want)


def test_dot_over_keys_xp_ops():
    rng = np.random.default_rng(5)
    a, b = rng.standard_normal((2, 3, 5, 4)), rng.standard_normal((2, 3, 5, 4))
    np.testing.assert_allclose(fused.dot_over_keys(np, a, b), (a * b).sum(axis=-2),
                               rtol=1e-14)


def close(got, want, rtol):
    """Equal to rtol relative to each array's largest finite magnitude (a sum in another
    order differs by rounding of its terms, not of a result that cancels), infinities equal."""
    for g, w in zip(got, want):
        finite = np.isfinite(w)
        np.testing.assert_array_equal(np.isfinite(g), finite)
        np.testing.assert_array_equal(g[~finite], w[~finite])
        scale = float(np.abs(w[finite]).max()) if finite.any() else 0.0
        np.testing.assert_allclose(g[finite], w[finite], rtol=rtol, atol=rtol * scale)


def both(fn, monkeypatch):
    monkeypatch.setenv("MPISHARD_FUSED", "1")
    assert fused.use(CUPY)
    a = [host(x, CUPY) for x in fn()]
    monkeypatch.setenv("MPISHARD_FUSED", "0")
    assert not fused.use(CUPY)
    return a, [host(x, CUPY) for x in fn()]


@needs_gpu
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("offset", [0, 4, -5, None])
def test_fused_attention_on_cupy(dtype, rtol, offset, monkeypatch):
    args = problem(CUPY, dtype)
    close(*both(lambda: attention_all(*args, offset=offset), monkeypatch), rtol)


@needs_gpu
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_fused_dot_over_keys_on_cupy(dtype, rtol, monkeypatch):
    rng = np.random.default_rng(4)
    a, b = (CUPY.asarray(rng.standard_normal((2, 3, 41, 37)).astype(dtype)) for _ in range(2))
    close(*both(lambda: [fused.dot_over_keys(CUPY, a, b)], monkeypatch), rtol)


@needs_gpu
@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_fused_gelu_and_cross_entropy_on_cupy(dtype, rtol, monkeypatch):
    close(*both(lambda: gelu_and_loss(CUPY, dtype), monkeypatch), rtol)


@needs_gpu
def test_fused_gpt_step_equals_numpy_on_cupy(monkeypatch):
    """A whole GPT train step on cupy with the fused kernels equals numpy's (float64)."""
    from mpi4py import MPI

    from mpishard.comm.backend import Backend
    monkeypatch.setenv("MPISHARD_FUSED", "1")
    model = ms.GPT(vocab_size=29, seq_len=12, d_model=16, n_heads=4, n_layers=2)
    params = model.init(seed=0)
    rng = np.random.default_rng(4)
    x, t = rng.integers(0, 29, (3, 12)), rng.integers(0, 29, (3, 12))
    res = []
    for device in (None, Backend("gpu", MPI.COMM_SELF)):
        kw = {} if device is None else {"device": device}
        engine = ms.make_engine(model, "single", dtype=np.float64, comm=MPI.COMM_SELF, **kw)
        engine.load_checkpoint(params)
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                        ms.losses.CrossEntropy())
        res.append((loss, {n: host(g, engine.xp) for n, g in grads.items()}))
    np.testing.assert_allclose(res[1][0], res[0][0], rtol=1e-12)
    for n, g in res[0][1].items():
        np.testing.assert_allclose(res[1][1][n], g, rtol=1e-9, atol=1e-12, err_msg=n)

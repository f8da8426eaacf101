"""nn/gemm.py: 16-bit matrix products (float32 sums, a 16-bit result), and the cuBLAS call
it makes on cupy, replayed on numpy memory so its transposes, leading dimensions and batch
strides are checked here without a GPU (the GPU check runs the call itself: `gemm` part)."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from mpishard.nn import gemm
from mpishard.nn.autocast import Narrow
from mpishard.parallel.precision import Precision

BF16 = np.dtype(ml_dtypes.bfloat16)
LOWS = [BF16, np.dtype(np.float16)]


def rounded(x, dtype):
    return x.astype(np.float32).astype(dtype)


@pytest.mark.parametrize("low", LOWS, ids=str)
def test_a_16_bit_product_is_the_rounding_emulation_bit_for_bit(low):
    """Widened inputs, a float32 product, the result rounded: what nn/autocast.py's Rounding
    policy computes on numpy, here with 16-bit arrays in and out."""
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(2, 3, 17, 24)), rng.normal(size=(2, 3, 24, 9))
    got = gemm.matmul(np, rounded(a, low), rounded(b, low))
    assert got.dtype == low
    emulation = Precision(np.float32, compute_dtype=low.name).autocast()
    want = emulation.output(np.matmul(emulation.round(a.astype(np.float32)),
                                      emulation.round(b.astype(np.float32))))
    assert np.array_equal(got.astype(np.float32), want)
    out = np.empty((2, 3, 17, 9), np.float32)        # a float32 out: the float32 product
    assert gemm.matmul(np, rounded(a, low), rounded(b, low), out=out) is out
    assert np.array_equal(out, np.matmul(rounded(a, low).astype(np.float32),
                                         rounded(b, low).astype(np.float32)))


def test_other_dtypes_are_xp_matmul():
    a, b = np.arange(6.0).reshape(2, 3), np.arange(12.0).reshape(3, 4)
    assert np.array_equal(gemm.matmul(np, a, b), a @ b)


def replay(g, dtype):
    """cublasGemmStridedBatchedEx on numpy memory: C' = op(A') op(B'), column-major, from
    the arguments gemm_args gives (each operand read from its first element, as from its
    device pointer)."""
    def op(x, trans, rows, cols, ld, stride):
        item = x.itemsize
        if trans == 0:       # x holds the (rows x cols) matrix column-major, ld
            return as_strided(x, (g.batch, rows, cols), (stride * item, item, ld * item))
        return as_strided(x, (g.batch, rows, cols), (stride * item, ld * item, item))
    a = op(g.A, g.transa, g.m, g.k, g.lda, g.strideA).astype(np.float64)
    b = op(g.B, g.transb, g.k, g.n, g.ldb, g.strideB).astype(np.float64)
    c = np.matmul(a, b)                                   # (batch, m, n): C' column-major
    return c.transpose(0, 2, 1).astype(dtype)             # row-major C, batch of (n, m)


def layouts(rng):
    """(a, b) pairs as the layers hand them: contiguous, transposed views, a 2-D weight
    under a batch, a broadcast batch axis, vectors, a non-uniform batch stride."""
    def t(x):
        return x.swapaxes(-1, -2)
    r = rng.normal
    yield r(size=(5, 7)), r(size=(7, 3))                                # plain
    yield t(r(size=(7, 5))), r(size=(7, 3))                             # a^T (matmul_tn)
    yield r(size=(5, 7)), t(r(size=(3, 7)))                             # b^T ('bd,vd->bv')
    yield t(r(size=(7, 5))), t(r(size=(3, 7)))
    yield r(size=(2, 3, 6, 4)), r(size=(2, 3, 4, 5))                    # attention scores
    yield t(r(size=(2, 3, 4, 6))), r(size=(2, 3, 4, 5))                 # p^T v
    yield r(size=(2, 3, 6, 4)), t(r(size=(2, 3, 5, 4)))
    yield r(size=(4, 6, 8)), r(size=(8, 3))                             # 2-D weight, batch
    yield r(size=(8, 3)).T[None].repeat(2, 0), r(size=(8, 5))
    yield r(size=(1, 3, 6, 4)), r(size=(2, 3, 4, 5))                    # broadcast batch
    yield r(size=(2, 6, 3, 4)).transpose(0, 2, 1, 3), r(size=(2, 3, 4, 5))   # split heads
    yield r(size=(6, 4))[::2], r(size=(4, 5))                           # row step 2
    yield r(size=(7,)), r(size=(7, 3))                                  # column sums
    yield r(size=(5, 7)), r(size=(7,))
    yield r(size=(1, 7)), r(size=(7, 1))


@pytest.mark.parametrize("low", LOWS, ids=str)
def test_the_cublas_arguments_replayed_on_numpy_are_the_product(low):
    rng = np.random.default_rng(1)
    for a, b in layouts(rng):
        a, b = rounded(a, low), rounded(b, low)
        va, vb = a.ndim == 1, b.ndim == 1
        a2 = a[None, :] if va else a
        b2 = b[:, None] if vb else b
        g = gemm.gemm_args(np, a2, b2)
        got = replay(g, np.float64).reshape(np.matmul(a2, b2).shape)
        want = np.matmul(a2.astype(np.float64), b2.astype(np.float64))
        assert np.allclose(got, want, rtol=1e-12, atol=1e-12), (a.shape, a.strides)
        assert g.lda >= (g.m if g.transa == 0 else g.k) and g.ldb >= (
            g.k if g.transb == 0 else g.n)                 # cuBLAS's own conditions


def test_transposed_views_are_read_where_they_lie():
    """The layouts the layers hand over need no copy: a^T, b^T, the split heads' batch."""
    x = rounded(np.ones((2, 3, 4, 6)), BF16)
    for view in (x, x.swapaxes(-1, -2), x[0], x[0, 0].T):
        assert gemm._layout(view) is not None
    assert gemm._layout(rounded(np.ones((2, 6, 3, 4)), BF16).transpose(0, 2, 1, 3)) is None


def test_narrow_holds_16_bits_and_widens_outputs():
    policy = Narrow(BF16)
    x = np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)
    r = policy.round(x)
    assert r.dtype == BF16 and policy.round(r) is r
    y = policy.output(gemm.matmul(np, r, r.T))
    assert y.dtype == np.float32
    assert np.array_equal(y, rounded(r.astype(np.float32) @ r.astype(np.float32).T, BF16)
                          .astype(np.float32))
    f = np.full(3, 1 + 2.0 ** -10, np.float32)       # a float32 output: rounded in place
    assert policy.output(f) is f and np.all(f == 1.0)


def test_on_cupy_the_tensor_cores_agree_with_the_emulation():
    """The GPU check's `gemm` part: each layout of `layouts` as cupy 16-bit arrays through
    one cublasGemmStridedBatchedEx, against numpy's emulation (float32 sums in another
    order): within one 16-bit ulp of the result's largest element (the two sums differ by
    float32 rounding, which can move a rounding to 16 bits by one ulp), and a float32 `out`
    within 2^-20 of it."""
    cp = pytest.importorskip("cupy")
    try:
        cp.cuda.runtime.getDeviceCount()
    except Exception:
        pytest.skip("no GPU")
    rng = np.random.default_rng(2)
    for low in LOWS:
        ulp = float(ml_dtypes.finfo(low).eps)
        for a, b in layouts(rng):
            a, b = rounded(a, low), rounded(b, low)
            want = gemm.matmul(np, a, b).astype(np.float32)
            got = gemm.matmul(cp, cp.asarray(a), cp.asarray(b))
            assert got.dtype == low, (low, a.shape)
            scale = max(float(np.abs(want).max()), 1e-30)
            err = float(np.abs(cp.asnumpy(got).astype(np.float32) - want).max()) / scale
            assert err <= ulp, (low, a.shape, a.strides, err)
            out = cp.empty(want.shape, cp.float32)
            assert gemm.matmul(cp, cp.asarray(a), cp.asarray(b), out=out) is out
            exact = np.matmul(a.astype(np.float64), b.astype(np.float64))
            assert float(np.abs(cp.asnumpy(out) - exact).max()) / scale <= 2.0 ** -20
            strided = cp.empty(want.shape[:-2] + want.shape[:-3:-1], cp.float32)
            strided = strided.swapaxes(-1, -2) if want.ndim >= 2 else cp.empty_like(out)
            gemm.matmul(cp, cp.asarray(a), cp.asarray(b), out=strided)   # not contiguous:
            assert float(np.abs(cp.asnumpy(strided) - exact).max()) / scale <= 2.0 ** -20
        empty = gemm.matmul(cp, cp.zeros((0, 3, 4), low), cp.zeros((0, 4, 5), low))
        assert empty.shape == (0, 3, 5)                  # an empty batch: no cuBLAS call


class FakeCublas:
    """cupy.cuda's cublas and runtime as _cublas calls them, on the device double's host
    memory: gemmStridedBatchedEx reads A and B at their pointers with the transposes, leading
    dimensions and batch strides it is given, and writes C there (column-major, ldc)."""

    CUDA_R_16BF, CUDA_R_16F, CUDA_R_32F = 14, 2, 0
    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT = 68, -1
    TYPES = {14: BF16, 2: np.dtype(np.float16), 0: np.dtype(np.float32)}

    def __init__(self):
        self.calls = 0

    def gemmStridedBatchedEx(self, handle, transa, transb, m, n, k, alpha, A, ta, lda, sa,
                             B, tb, ldb, sb, beta, C, tc, ldc, sc, batch, compute, algo):
        import ctypes
        assert compute == 68 and algo == -1 and handle == "handle"
        assert ctypes.c_float.from_address(alpha).value == 1.0
        assert ctypes.c_float.from_address(beta).value == 0.0
        self.calls += 1

        def at(ptr, dtype, trans, rows, cols, ld, stride):
            dtype = self.TYPES[dtype]
            item = dtype.itemsize
            span = (batch - 1) * stride + ld * max(rows, cols) + max(rows, cols)
            flat = np.frombuffer((ctypes.c_char * (span * item)).from_address(ptr), dtype)
            if trans == 0:
                return as_strided(flat, (batch, rows, cols), (stride * item, item, ld * item))
            return as_strided(flat, (batch, rows, cols), (stride * item, ld * item, item))
        a = at(A, ta, transa, m, k, lda, sa).astype(np.float64)
        b = at(B, tb, transb, k, n, ldb, sb).astype(np.float64)
        c = at(C, tc, 0, m, n, ldc, sc)
        c[...] = np.matmul(a, b).astype(c.dtype)


def t(x):
    return x.swapaxes(-1, -2)


def same(x):
    return x


VIEWS = [((5, 7), same, (7, 3), same), ((7, 5), t, (7, 3), same), ((5, 7), same, (3, 7), t),
         ((7, 5), t, (3, 7), t), ((2, 3, 6, 4), same, (2, 3, 4, 5), same),
         ((2, 3, 4, 6), t, (2, 3, 4, 5), same), ((2, 3, 6, 4), same, (2, 3, 5, 4), t),
         ((4, 6, 8), same, (8, 3), same), ((1, 3, 6, 4), same, (2, 3, 4, 5), same),
         ((2, 6, 3, 4), lambda x: x.transpose(0, 2, 1, 3), (2, 3, 4, 5), same),
         ((6, 4), lambda x: x[::2], (4, 5), same), ((7,), same, (7, 3), same),
         ((5, 7), same, (7,), same), ((1, 7), same, (7, 1), same),
         ((7,), lambda x: x[::-1], (7, 3), same), ((5, 7), same, (7,), lambda x: x[::-1])]
"""(a's base shape, its view, b's, its view): the layouts of `layouts`, made on a device,
and reversed vectors (which cuBLAS cannot read: copied first)."""


def test_the_cublas_call_reads_and_writes_where_the_arrays_lie(monkeypatch):
    """gemm._cublas itself (the cached plan, the pointers, the dtypes' enums, a float32 or
    16-bit result, a given `out`) on the strict device double, with a fake cuBLAS that reads
    and writes the double's host memory at the pointers it is handed: each layout (views
    made on the device: transposes, split heads, a row step, vectors, a broadcast batch)
    equals numpy's float64 product rounded once, twice over (the second time from the cached
    plan)."""
    import sys
    import types

    from device_double import DeviceModule
    fake = FakeCublas()
    cuda = types.SimpleNamespace(cublas=fake, runtime=fake,
                                 device=types.SimpleNamespace(get_cublas_handle=lambda: "handle"))
    monkeypatch.setitem(sys.modules, "cupy", types.SimpleNamespace(cuda=cuda))
    monkeypatch.setitem(sys.modules, "cupy.cuda", cuda)
    gemm._types.cache_clear()
    xp = DeviceModule()
    rng = np.random.default_rng(3)
    for _ in range(2):
        for sa, va, sb, vb in VIEWS:
            for low in LOWS:
                ha, hb = rounded(rng.normal(size=sa), low), rounded(rng.normal(size=sb), low)
                da, db = va(xp.asarray(ha)), vb(xp.asarray(hb))
                want = np.matmul(va(ha).astype(np.float64), vb(hb).astype(np.float64))
                got = gemm._cublas(xp, da, db, None).get()
                assert got.dtype == low and got.shape == want.shape
                np.testing.assert_array_equal(got, want.astype(low))
                out = xp.empty(want.shape, dtype=np.float32)
                assert gemm._cublas(xp, da, db, out) is out
                np.testing.assert_allclose(out.get(), want, rtol=1e-6)
    assert fake.calls == 2 * 2 * 2 * len(VIEWS)
    gemm._types.cache_clear()

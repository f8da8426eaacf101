"""The numba attention kernels (nn/cpu_attention.py) equal the numpy ops they replace.

As tests/nn/test_cpu_fused.py: each case runs the entry point with MPISHARD_CPU_FUSED=0 (the
numpy ops) and =1 (the kernels). The causal softmax's forward to 1e-12 of each array's
largest magnitude in float64 (its sums add in another order), 1e-5 in float32; its backward
pass (ds - row) p bit for bit, in both dtypes.
"""
import numpy as np
import pytest
from test_cpu_fused import both, close, sample

from mpishard.nn import attention as att
from mpishard.nn import cpu_attention
from mpishard.nn import documents as docs

pytestmark = pytest.mark.usefixtures("numba_kernels")


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("offset", [None, 0, 5, -3])
def test_causal_softmax_in_attention(dtype, rtol, offset, monkeypatch):
    """attention_block (out, lse, kept p^T) and its backward, Tq 9 against Tk 14: offset -3
    leaves the first queries without a key (out 0, lse -inf)."""
    q, k, v = (sample((2, 3, t, 8), dtype, s) for s, t in ((10, 9), (11, 14), (12, 14)))
    dout = sample((2, 3, 9, 8), dtype, 13)
    k[0, 1, 2] *= 40.0                                       # scores far apart

    def run():
        out, lse, p = att.attention_block(q, k, v, offset, keep_probs=True)
        grads = att.attention_block_backward(dout, q, k, v, out, lse, offset)
        return (out, lse, p) + tuple(grads)
    off, on = both(run, monkeypatch)
    if offset == -3:
        assert np.isneginf(on[1][..., :3]).all() and not on[0][..., :3, :].any()
    for a, b in zip(on, off):
        assert a.dtype == b.dtype and a.shape == b.shape
    close(on, off, rtol)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("offset", [None, 0, 5])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("poison", [None, np.nan, np.inf])
@pytest.mark.filterwarnings("ignore::RuntimeWarning")       # the poisoned rows' NaN arithmetic
def test_masked_softmax_in_attention(dtype, rtol, offset, heads, poison, monkeypatch):
    """attention_block with a further mask `visible` (B, 1 or H, Tq, Tk): a packed row's
    documents (nn/documents.visible, padding -1 included) and a mask that leaves a query no
    key at all (out 0, lse -inf): the kernel's forward equals the xp ops'. poison: a NaN or
    inf key in row 0's third document, hidden from the other documents' queries (and, causal,
    from earlier ones): its hidden scores make the same queries' lse NaN on both paths (a
    hidden NaN or +inf is not masked away: the mask is an added -inf), and row 1 stays
    equal."""
    q, k, v = (sample((2, 3, 9, 8), dtype, s) for s in (20, 21, 22))
    if poison is not None:
        k[0, 0, 5, 0] = poison
    dout = sample((2, 3, 9, 8), dtype, 23)
    ids = np.array([[0, 0, 0, 1, 1, 2, 2, 2, -1], [5, 5, 5, 5, 5, 5, 7, 7, 7]])
    visible = docs.visible(ids, ids)
    if heads == 3:                                           # per head: query 4 of head 1
        visible = np.repeat(visible, 3, axis=1)              # sees nothing
        visible[0, 1, 4, :] = False
    assert cpu_attention.takes_mask(visible, (2, 3, 9, 9))

    calls = []
    kernel = cpu_attention.causal_softmax_t
    monkeypatch.setattr(cpu_attention, "causal_softmax_t", lambda *a: calls.append(1) or kernel(*a))

    def run():
        out, lse, p = att.attention_block(q, k, v, offset, keep_probs=True, visible=visible)
        grads = att.attention_block_backward(dout, q, k, v, out, lse, offset, visible=visible)
        return (out, lse, p) + tuple(grads)
    off, on = both(run, monkeypatch)
    assert calls == [1]                                      # the kernel ran, once
    if poison is not None:         # the hidden score poisons other documents' rows alike,
        assert np.isnan(on[1][0, 0, :3]).any()               # lse NaN (their other values:
        np.testing.assert_array_equal(np.isnan(on[1]), np.isnan(off[1]))   # each path's own
        on, off = ([a[1:] for a in r] for r in (on, off))    # garbage); the clean row equal
    if heads == 3 and poison is None:
        assert np.isneginf(on[1][0, 1, 4]) and not on[0][0, 1, 4].any()
    for a, b in zip(on, off):
        assert a.dtype == b.dtype and a.shape == b.shape
    close(on, off, rtol)


def test_a_mask_the_kernel_does_not_take():
    """Masks the kernel's indexing cannot read run the xp ops: 2-D, not bool, not broadcast."""
    assert not cpu_attention.takes_mask(np.ones((9, 9), bool), (2, 3, 9, 9))
    assert not cpu_attention.takes_mask(np.ones((2, 1, 9, 9)), (2, 3, 9, 9))
    assert not cpu_attention.takes_mask(np.ones((2, 2, 9, 9), bool), (2, 3, 9, 9))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_grad_bit_for_bit(dtype, monkeypatch):
    """The backward's ds = (ds - row) p: the kernel runs (counted) and equals the numpy
    ops' two in-place passes bit for bit; a non-contiguous p takes the numpy ops."""
    ds0, p = sample((2, 3, 14, 9), dtype, 30), sample((2, 3, 14, 9), dtype, 31)
    row = sample((2, 3, 9, 4), dtype, 32)[..., 1]              # a strided row: copied
    calls = []
    kernel = cpu_attention.softmax_grad_t
    monkeypatch.setattr(cpu_attention, "softmax_grad_t",
                        lambda *a: calls.append(1) or kernel(*a))

    def run():
        ds = ds0.copy()
        if cpu_attention.takes_grad(ds, row, p):
            return cpu_attention.softmax_grad_t(ds, row, p)
        ds -= row[..., None, :]
        ds *= p
        return ds
    off, on = both(run, monkeypatch)
    assert calls == [1]
    np.testing.assert_array_equal(on, off)
    assert not cpu_attention.takes_grad(ds0.copy(), row, np.asfortranarray(p))
    assert not cpu_attention.takes_grad(ds0.copy(), row, p.astype(np.float16))


def test_the_attention_backward_runs_the_kernel(monkeypatch):
    """attention_block_backward on numpy calls softmax_grad_t once per block."""
    q, k, v = (sample((2, 3, 9, 8), np.float64, s) for s in (40, 41, 42))
    dout = sample((2, 3, 9, 8), np.float64, 43)
    out, lse = att.attention_block(q, k, v, 0)
    calls = []
    kernel = cpu_attention.softmax_grad_t
    monkeypatch.setattr(cpu_attention, "softmax_grad_t",
                        lambda *a: calls.append(1) or kernel(*a))
    att.attention_block_backward(dout, q, k, v, out, lse, 0)
    assert calls == [1]

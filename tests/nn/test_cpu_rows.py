"""The numba loss and embedding kernels (nn/cpu_rows.py) equal the numpy ops they replace.

As tests/nn/test_cpu_fused.py: each case runs the entry point with MPISHARD_CPU_FUSED=0 (the
numpy ops) and =1 (the kernels), and counts that the kernel ran. The cross-entropy's value and
gradient to 1e-12 in float64 (its row sums add in another order, p is exp(z) / s), 1e-5 in
float32; the embedding's backward bit for bit np.add.at's (the same adds in the same order).
"""
import numpy as np
import pytest
from test_cpu_fused import both, close, sample

from mpishard.nn import cpu_rows
from mpishard.nn import functional as nn
from mpishard.nn.losses import CrossEntropy

pytestmark = pytest.mark.usefixtures("numba_kernels")


def counted(monkeypatch, name):
    calls = []
    kernel = getattr(cpu_rows, name)
    monkeypatch.setattr(cpu_rows, name, lambda *a: calls.append(1) or kernel(*a))
    return calls


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
@pytest.mark.parametrize("shape", [(5, 7), (2, 6, 11)])
@pytest.mark.parametrize("ignored", [False, True])
def test_cross_entropy(dtype, rtol, shape, ignored, monkeypatch):
    """Value and dy, labels at both ends of the vocabulary, logits far apart; `ignored`: some
    labels are ignore_index (0 gradient, not counted) and `over` sets the divisor."""
    y = sample(shape, dtype, 1) * 4
    y.reshape(-1, shape[-1])[1, 2] = 60.0                    # a logit far above its row's
    t = np.random.default_rng(2).integers(0, shape[-1], shape[:-1])
    t.reshape(-1)[:2] = [0, shape[-1] - 1]
    loss = CrossEntropy()
    if ignored:
        t.reshape(-1)[2::3] = -100
        loss = loss.over(7.0)
    calls = counted(monkeypatch, "cross_entropy")
    off, on = both(lambda: loss(y, t), monkeypatch)
    assert calls == [1]
    assert on[1].dtype == off[1].dtype and on[1].shape == off[1].shape
    np.testing.assert_allclose(on[0], off[0], rtol=rtol)
    close([on[1]], [off[1]], rtol)
    if ignored:
        assert not on[1].reshape(-1, shape[-1])[2::3].any()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_cross_entropy_of_a_nan_logit(monkeypatch):
    """A NaN logit makes its row's value and gradient NaN on both paths, the others equal."""
    y, t = sample((4, 6), np.float64, 3), np.array([1, 2, 3, 4])
    y[2, 5] = np.nan
    calls = counted(monkeypatch, "cross_entropy")
    off, on = both(lambda: CrossEntropy()(y, t), monkeypatch)
    assert calls == [1]
    assert np.isnan(on[0]) and np.isnan(off[0])
    np.testing.assert_array_equal(np.isnan(on[1]), np.isnan(off[1]))
    assert np.isnan(on[1][2]).all()
    close([on[1][[0, 1, 3]]], [off[1][[0, 1, 3]]], 1e-12)


@pytest.mark.parametrize("dtype,rtol", [(np.float64, 1e-12), (np.float32, 1e-5)])
def test_embedding_backward(dtype, rtol, monkeypatch):
    """Repeated ids (one row hit 40 times): bit for bit np.add.at's sums (the same adds in
    the same order), and the numpy path's sorted add.reduceat (another order) to rounding."""
    ids = np.random.default_rng(4).integers(0, 9, (4, 30))
    ids[1] = 3
    dy = sample((4, 30, 5), dtype, 5)
    calls = counted(monkeypatch, "embedding_backward")
    off, on = both(lambda: nn.embedding_backward(dy, ids, 9), monkeypatch)
    assert calls == [1]
    assert on.dtype == off.dtype and on.shape == (9, 5)
    at = np.zeros((9, 5), dtype)
    np.add.at(at, ids.reshape(-1), dy.reshape(-1, 5))
    np.testing.assert_array_equal(on, at)
    close([on], [off], rtol)
    assert not on[np.setdiff1d(np.arange(9), ids)].any()


def test_embedding_backward_of_negative_ids(monkeypatch):
    """Ids in [-rows, 0) count from the end, as numpy's indexing and np.add.at do: -1 and 8
    add into one row, on the kernel (bit for bit np.add.at) and on the numpy path."""
    dy, ids = sample((2, 4, 3), np.float64, 7), np.array([[0, -1, 8, -9], [-1, 2, 2, 8]])
    calls = counted(monkeypatch, "embedding_backward")
    off, on = both(lambda: nn.embedding_backward(dy, ids, 9), monkeypatch)
    at = np.zeros((9, 3))
    np.add.at(at, ids.reshape(-1), dy.reshape(-1, 3))
    assert calls == [1]
    np.testing.assert_array_equal(on, at)
    close([off], [at], 1e-12)


def test_embedding_backward_leaves_bad_ids_to_numpy(monkeypatch):
    """An id past the table never reaches the loop (it would write outside g): the numpy
    path raises numpy's IndexError, with the kernels on as off."""
    dy, ids = sample((1, 3, 2), np.float64, 6), np.array([[0, 9, 1]])
    calls = counted(monkeypatch, "embedding_backward")
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "1")
    with pytest.raises(IndexError):
        nn.embedding_backward(dy, ids, 9)
    with pytest.raises(IndexError):                          # below -rows: the same
        nn.embedding_backward(dy, np.array([[0, -10, 1]]), 9)
    assert calls == []
    assert not cpu_rows.takes_embedding(dy[:, :1], ids, 9)     # a row of dy per id

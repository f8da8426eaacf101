"""Data sets and the distributed batcher.

    pytest -m "not mpi" tests/train/test_data.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_data.py
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.train.data import (DistributedBatcher, digits, eval_chunks, load_dataset,
                           synthetic_classification, synthetic_regression)

from conftest import world


# -- data sets ------------------------------------------------------------------------------------
def test_synthetic_regression_is_seeded():
    a = synthetic_regression(100, 20, d_in=5, d_out=3, seed=4)
    b = synthetic_regression(100, 20, d_in=5, d_out=3, seed=4)
    c = synthetic_regression(100, 20, d_in=5, d_out=3, seed=5)
    assert a.x_train.shape == (100, 5) and a.t_test.shape == (20, 3)
    assert a.t_train.dtype == np.float64 and a.task == "regression" and a.default_loss == "mse"
    np.testing.assert_array_equal(a.x_train, b.x_train)
    np.testing.assert_array_equal(a.t_test, b.t_test)
    assert not np.allclose(a.x_train, c.x_train)
    assert (a.d_in, a.d_out) == (5, 3)


def test_synthetic_classification_labels():
    d = synthetic_classification(400, 100, d_in=6, n_classes=5, seed=1)
    assert d.t_train.dtype == np.int64 and d.t_train.shape == (400,)
    assert set(np.unique(d.t_train)) == set(range(5))
    assert d.default_loss == "cross_entropy" and d.d_out == 5
    b = synthetic_classification(64, 16, d_in=6, n_classes=1, seed=1)
    assert b.task == "binary" and b.t_train.shape == (64, 1) and b.t_train.dtype == np.float64
    assert set(np.unique(b.t_train)) == {0.0, 1.0} and b.default_loss == "bce"


def test_digits_split_is_stratified_and_standardised():
    from sklearn.datasets import load_digits

    y_all = load_digits().target
    d = digits(seed=0)
    assert d.x_train.shape == (1437, 64) and d.x_test.shape == (360, 64)
    assert d.t_train.dtype == np.int64 and (d.d_in, d.d_out) == (64, 10)
    for c in range(10):                           # stratified: each class ~20% in the test set
        n_c = int((y_all == c).sum())
        assert abs(int((d.t_test == c).sum()) - 0.2 * n_c) <= 1, c
        assert int((d.t_test == c).sum()) + int((d.t_train == c).sum()) == n_c
    varying = d.x_train.std(axis=0) > 0
    np.testing.assert_allclose(d.x_train.mean(axis=0), 0.0, atol=1e-12)
    np.testing.assert_allclose(d.x_train.std(axis=0)[varying], 1.0, rtol=1e-12)
    assert np.abs(d.x_test.mean(axis=0)).max() > 1e-3      # fitted on train only
    again, other = digits(seed=0), digits(seed=1)
    np.testing.assert_array_equal(d.x_test, again.x_test)
    assert not np.array_equal(d.t_test, other.t_test)


def test_load_dataset_names():
    assert load_dataset("synthetic-classification", d_in=3, d_out=2, n_train=8, n_test=4).d_in == 3
    with pytest.raises(ValueError, match="unknown dataset 'nope'"):
        load_dataset("nope")
    with pytest.raises(ValueError, match="n_train must be a positive integer"):
        synthetic_regression(0, 10)


# -- batching (no MPI: every rank of a dp group simulated) ----------------------------------------
@pytest.mark.parametrize("dp,k", [(1, 1), (2, 1), (4, 2), (8, 1), (2, 4)])
def test_batcher_ranks_cover_each_global_batch_once(dp, k):
    n, batch = 100, 32
    x = np.arange(n, dtype=np.float64).reshape(n, 1)
    t = np.arange(n)
    ranks = [DistributedBatcher(x, t, batch, dp, r, seed=3, accumulate=k) for r in range(dp)]
    b0 = ranks[0]
    assert b0.steps_per_epoch == 3 and b0.local_rows == batch // (k * dp)
    seen_epoch = []
    for step in range(b0.steps_per_epoch):
        epoch, index = b0.position(step)
        rows = []
        for micro in range(k):
            for b in ranks:
                xs, ts = b.micro_batches(step)[micro]
                assert xs.shape == (batch // (k * dp), 1)
                np.testing.assert_array_equal(xs[:, 0].astype(int), ts)   # rows stay paired
                rows.extend(ts.tolist())
        assert rows == b0.global_indices(epoch, index).tolist()       # rank r: block r
        seen_epoch.extend(rows)
    assert len(set(seen_epoch)) == len(seen_epoch) == 3 * batch      # no row twice per epoch


def test_batcher_reshuffles_per_epoch_from_the_seed():
    x, t = np.zeros((50, 2)), np.zeros(50)
    b = DistributedBatcher(x, t, 10, seed=7)
    again = DistributedBatcher(x, t, 10, seed=7)
    other = DistributedBatcher(x, t, 10, seed=8)
    assert b.steps_per_epoch == 5 and b.position(12) == (2, 2)
    e0, e1 = b.permutation(0).copy(), b.permutation(1).copy()
    assert sorted(e0) == list(range(50)) and not np.array_equal(e0, e1)
    np.testing.assert_array_equal(again.permutation(1), e1)
    assert not np.array_equal(other.permutation(0), e0)
    assert DistributedBatcher(x, t, 10, shuffle=False).global_indices(1, 0).tolist() == \
        list(range(10))


def test_batcher_rejects_bad_sizes():
    x, t = np.zeros((50, 2)), np.zeros(50)
    with pytest.raises(ValueError, match="global batch 10 must divide by accumulate 3 x 1"):
        DistributedBatcher(x, t, 10, accumulate=3)
    with pytest.raises(ValueError, match="divide by accumulate 1 x 4 data-parallel"):
        DistributedBatcher(x, t, 10, dp_size=4, dp_rank=0)
    with pytest.raises(ValueError, match="larger than the 50 training rows"):
        DistributedBatcher(x, t, 64)
    with pytest.raises(ValueError, match="inputs have 50 rows but targets have 49"):
        DistributedBatcher(x, t[:49], 10)


@pytest.mark.parametrize("n,chunk,dp", [(10, 4, 2), (7, 8, 4), (16, 8, 8), (5, 1, 1)])
def test_eval_chunks_cover_every_row_once(n, chunk, dp):
    real = []
    for r in range(dp):
        for i, (idx, count) in enumerate(eval_chunks(n, chunk, dp, r)):
            assert len(idx) == chunk // dp
            if r == 0:
                real.append(count)
    got = []
    for c, count in enumerate(real):
        rows = np.concatenate([list(eval_chunks(n, chunk, dp, r))[c][0] for r in range(dp)])
        got.extend(rows[:count].tolist())
    assert got == list(range(n))


# -- under MPI: the batcher feeds exactly what shard_batch would --------------------------------
@pytest.mark.mpi(min_size=1)
def test_batcher_matches_engine_shard_batch():
    n = world().Get_size()
    data = synthetic_classification(96, 8, d_in=4, n_classes=3, seed=2)
    layouts = [f"dp={n}", f"tp={n}"] + ([f"dp=2,tp={n // 2}"] if n >= 4 and n % 2 == 0 else [])
    for layout in layouts:
        e = ms.make_engine(ms.MLP([4, 8, 3]), layout, comm=world())
        b = DistributedBatcher.for_engine(e, data.x_train, data.t_train, 16, seed=1,
                                          accumulate=2)
        for step in (0, 5, 6):                                # crosses into epoch 1
            epoch, index = b.position(step)
            g = b.global_indices(epoch, index)
            for micro, (xl, tl) in enumerate(b.micro_batches(step)):
                mb = g[micro * 8:(micro + 1) * 8]
                np.testing.assert_array_equal(xl, e.shard_batch(data.x_train[mb]))
                np.testing.assert_array_equal(tl, e.shard_batch(data.t_train[mb]))

"""Gradient sync optimisations (data_parallel.py): buckets, gradients as bucket views, and
overlapping the all-reduce with the backward (layout options bucket_mb=, overlap=1), plus
engine.all_reduce_async. Each switch must give the numbers of the plain path and of the
single-device reference (float64, rtol 1e-9), at any world size.
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.parallel.data_parallel import GradientSync, plan_buckets

from conftest import assert_close, assert_dicts_close, group_comm, world

DIMS = [12, 16, 16, 8, 4]          # 4 layers, 8 tensors of 16..256 floats
# bucket caps: 0 = one tensor per bucket, 0.0008 MiB ~ 840 B = a few tensors, 25 = one bucket
BUCKETS = [0, 0.0008, 25]


# -- the bucket plan (no MPI) ------------------------------------------------------------------
def test_plan_buckets_caps_and_order():
    names = ["w2", "b2", "w1", "b1", "w0"]
    nbytes = {"w2": 400, "b2": 40, "w1": 800, "b1": 80, "w0": 300}
    axes = {n: ("dp",) for n in names}
    assert plan_buckets(names, nbytes, axes, 10_000) == [(("dp",), names)]
    assert plan_buckets(names, nbytes, axes, 0) == [(("dp",), [n]) for n in names]
    # 440 fits; w1 alone (800 > cap 500 still gets its own bucket); b1 + w0 = 380
    assert plan_buckets(names, nbytes, axes, 500) == [
        (("dp",), ["w2", "b2"]), (("dp",), ["w1"]), (("dp",), ["b1", "w0"])]
    # tensors over different axes never share a bucket; unreplicated ones are skipped
    axes2 = dict(axes, b2=("dp", "fsdp"), b1=())
    assert plan_buckets(names, nbytes, axes2, 10_000) == [
        (("dp",), ["w2", "w1", "w0"]), (("dp", "fsdp"), ["b2"])]


def test_negative_bucket_size_is_refused():
    engine = ms.SingleDevice(ms.MLP([4, 4]))
    engine.load_checkpoint(ms.MLP([4, 4]).init(0))
    with pytest.raises(ValueError, match="bucket_mb must be >= 0.*got -1"):
        GradientSync(engine.store, engine.comm, bucket_mb=-1)


# -- MPI: the same numbers with every switch ---------------------------------------------------
def _data(batch=16, seed=3):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((batch, DIMS[0])), rng.standard_normal((batch, DIMS[-1]))


def _reference(steps=1, accumulate=1):
    model = ms.MLP(DIMS, activation="tanh")
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(model.init(seed=1))
    x, t = _data()
    k = accumulate
    rows = x.shape[0] // k
    for i in range(k):
        loss, grads = ref.train_step(x[i * rows:(i + 1) * rows], t[i * rows:(i + 1) * rows],
                                     ms.losses.MSE(), grad_scale=1.0 / k, accumulate=i > 0,
                                     sync=i == k - 1)
    return {n: np.array(g) for n, g in grads.items()}


def _run(layout, comm, accumulate=1):
    model = ms.MLP(DIMS, activation="tanh")
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(model.init(seed=1))
    sync, engine.launched_early = engine.grad_sync.sync, []

    def spy(grads):     # how many buckets were already in flight when sync() was reached
        engine.launched_early.append(sum(b.future is not None for b in engine.grad_sync.buckets))
        sync(grads)
    engine.grad_sync.sync = spy
    x, t = _data()
    # gradient accumulation: micro-step i takes rows block i of every rank's rows
    xl, tl = engine.shard_batch(x), engine.shard_batch(t)
    k = accumulate
    rows = xl.shape[0] // k
    for i in range(k):
        before = engine.comm_calls["all_reduce"]
        engine.train_step(xl[i * rows:(i + 1) * rows], tl[i * rows:(i + 1) * rows],
                          ms.losses.MSE(), grad_scale=1.0 / k, accumulate=i > 0,
                          sync=i == k - 1)
        if i < k - 1:   # a sync=False step must not communicate, overlap or not
            assert engine.comm_calls["all_reduce"] == before
    return engine, engine.gather_grads()


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("bucket_mb", BUCKETS)
@pytest.mark.parametrize("overlap", [0, 1])
def test_dp_sync_matches_single_and_plain(bucket_mb, overlap):
    n = world().Get_size()
    want = _reference()
    engine, got = _run(f"dp={n},bucket_mb={bucket_mb},overlap={overlap}", world())
    assert engine.grad_sync.overlap_active == bool(overlap)
    # overlap: every bucket's all-reduce was started during the backward, before sync()
    assert engine.launched_early == [len(engine.grad_sync.buckets) if overlap else 0]
    assert_dicts_close(got, want, what=f"dp={n} bucket_mb={bucket_mb} overlap={overlap}")
    if n > 1:
        expect_buckets = {0: 2 * (len(DIMS) - 1), 25: 1}.get(bucket_mb)
        if expect_buckets:
            assert len(engine.grad_sync.buckets) == expect_buckets
    _, plain = _run(f"dp={n},bucket_mb=0,overlap=0", world())
    assert_dicts_close(got, plain, what="vs plain per-tensor sync")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("overlap", [0, 1])
def test_accumulation_starts_no_communication(overlap):
    n = world().Get_size()
    want = _reference(accumulate=2)
    engine, got = _run(f"dp={n},bucket_mb=0.0008,overlap={overlap}", world(), accumulate=2)
    # the sync=False step reached no sync(); the syncing one had all buckets in flight
    assert engine.launched_early == [len(engine.grad_sync.buckets) if overlap else 0]
    assert_dicts_close(got, want, what=f"dp={n} accumulate=2 overlap={overlap}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("overlap", [0, 1])
def test_dp_tp_overlap(overlap):
    comm = group_comm(4)
    want = _reference()
    engine, got = _run(f"dp=2,tp=2,bucket_mb=0.0008,overlap={overlap}", comm)
    assert engine.grad_sync.overlap_active == bool(overlap)
    assert_dicts_close(got, want, what=f"dp=2,tp=2 overlap={overlap}")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["dp=2,pp=2,microbatches=2", "dp=2,fsdp=2"])
def test_overlap_falls_back_where_unsupported(layout):
    """Pipelines and FSDP call add_grad per microbatch / through their own access: overlap=1
    there reduces buckets in sync(), with the same numbers."""
    comm = group_comm(4)
    want = _reference()
    engine, got = _run(f"{layout},bucket_mb=0.0008,overlap=1", comm)
    assert not engine.grad_sync.overlap_active
    assert engine.launched_early == [0]
    assert_dicts_close(got, want, what=f"{layout} overlap=1")


@pytest.mark.mpi(min_size=2)
def test_replaced_gradient_array_falls_back_to_packing():
    """Someone swapping an engine.grads entry for a new array must not lose its average."""
    n = world().Get_size()
    model = ms.MLP(DIMS, activation="tanh")
    engine = ms.make_engine(model, f"dp={n}", comm=world())
    engine.load_checkpoint(model.init(seed=1))
    x, t = _data()
    engine.train_step(engine.shard_batch(x), engine.shard_batch(t), ms.losses.MSE(),
                      sync=False)
    name = "layer_1/weights"
    engine.grads[name] = engine.grads[name].copy()          # no longer a bucket view
    engine.sync_grads()
    assert_dicts_close(engine.gather_grads(), _reference(), what="after replacing a grad")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("op", ["sum", "avg", "max"])
def test_all_reduce_async_and_in_place(op):
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    engine = ms.make_engine(ms.MLP([4, 4]), f"dp={n}", comm=comm)
    base = np.arange(24, dtype=np.float64).reshape(4, 6)
    a = base * (r + 1)
    want = {"sum": base * n * (n + 1) / 2, "avg": base * (n + 1) / 2, "max": base * n}[op]
    fut = engine.all_reduce_async(a, op=op, group="dp")
    assert_close(fut.result(), want, what=f"async {op}")
    assert_close(a, base * (r + 1), what="input untouched")
    b = a.copy()
    got = engine.all_reduce_async(b, op=op, group="dp", out=b).result()
    assert got is b
    assert_close(b, want, what=f"async in place {op}")
    c = a.copy()
    assert engine.all_reduce(c, op=op, out=c) is c
    assert_close(c, want, what=f"blocking in place {op}")
    out = np.empty_like(a)
    assert engine.all_reduce(a, op=op, out=out) is out
    assert_close(out, want, what=f"blocking out= {op}")
    assert engine.comm_calls["all_reduce"] == 4
    assert engine.comm_bytes["all_reduce"] == pytest.approx(4 * 2 * (n - 1) / n * a.nbytes)
    with pytest.raises(ValueError, match=r"out= must be C-contiguous with shape \(4, 6\)"):
        engine.all_reduce(a, out=np.empty((6, 4)))


@pytest.mark.mpi(min_size=1)
def test_in_place_really_is_in_place():
    """out=arr must reach MPI as MPI_IN_PLACE (an aliased send buffer is an MPI error)."""
    comm = world()
    n = comm.Get_size()
    engine = ms.make_engine(ms.MLP([4, 4]), f"dp={n}", comm=comm, dtype=np.float32)
    for shape in [(), (7,), (3, 5)]:
        a = np.full(shape, 2.0, dtype=np.float32)
        assert engine.all_reduce(a, op="avg", out=a) is a
        assert_close(a, np.full(shape, 2.0), what=f"in place avg {shape}")
        assert engine.all_reduce_async(a, op="sum", out=a).result() is a
        assert_close(a, np.full(shape, 2.0 * n), what=f"async in place sum {shape}")
    with pytest.raises(ValueError, match="out= must be C-contiguous"):
        b = np.zeros((4, 6))[:, ::2]
        engine.all_reduce(b, out=b)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("cols", [3, 50_000])   # small, and >= 1 MiB (mmap-backed buffers)
def test_a_collective_never_overwrites_a_held_result(cols):
    """Results are the caller's: a later call never writes into one, or into a view of one."""
    comm = world()
    n = comm.Get_size()
    engine = ms.make_engine(ms.MLP([4, 4]), f"dp={n}", comm=comm)
    a = np.arange(3.0 * cols).reshape(3, cols)
    held = [engine.all_reduce(a * k) for k in range(4)]       # all alive at once
    rs_view = engine.reduce_scatter(np.ones((2 * n, cols)) * 5, axis=0)[:, :2]
    ar_view = engine.all_reduce(a * 7)[1:, :2]                # only a view survives
    y = None
    for k in range(4):                                         # y = all_reduce(...) loop
        y = engine.all_reduce(a * (10 + k))
        x = engine.all_to_all(np.ones((n, cols)) * k)
        assert_close(x, np.full((n, cols), float(k)), what="all_to_all")
        engine.reduce_scatter(np.ones((2 * n, cols)), axis=0)
    for k, h in enumerate(held):
        assert_close(h, a * k * n, what=f"held result {k}")
    assert_close(rs_view, np.full((2, 2), 5.0 * n), what="view of a reduce_scatter result")
    assert_close(ar_view, a[1:, :2] * 7 * n, what="view of an all_reduce result")
    assert_close(y, a * 13 * n, what="last loop result")

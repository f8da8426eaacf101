"""ShardedEngine collectives at any world size: expected values are written in terms of the
group size n and this rank's index r, so the same test passes at 1, 2, 4 and 8 ranks.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_collectives.py
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.engine import MeshEngine

from conftest import world

DTYPES = [np.float32, np.float64, np.int64]


class Engine(ms.ShardedEngine):
    """The smallest concrete engine: collectives only (the model hooks are not used here)."""

    def load_checkpoint(self, params):
        self.params = dict(params)

    def forward(self, x):
        return x

    def backward(self, grads):
        return grads


def engine(debug=False):
    comm = world()
    return Engine(f"dp={comm.Get_size()}", comm=comm, debug=debug)


def nr(e):
    return e.num_devices, e.device_id


def test_engine_is_abstract():
    with pytest.raises(TypeError):
        ms.ShardedEngine("single")


# -- all_reduce --------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_reduce_ops(dtype):
    e = engine()
    n, r = nr(e)
    base = np.arange(6, dtype=dtype).reshape(2, 3)
    a = base * (r + 1)                                  # rank r holds (r + 1) * base
    np.testing.assert_array_equal(e.all_reduce(a, op="sum"), base * (n * (n + 1) // 2))
    np.testing.assert_array_equal(e.all_reduce(a, op="max"), base * n)
    np.testing.assert_array_equal(e.all_reduce(a, op="min"), base)
    np.testing.assert_array_equal(a, base * (r + 1))    # input untouched
    for op in ("sum", "max", "min"):
        assert e.all_reduce(a, op=op).dtype == np.dtype(dtype)
    if np.dtype(dtype).kind == "f":
        got = e.all_reduce(a, op="avg")
        assert got.dtype == np.dtype(dtype)
        np.testing.assert_allclose(got, base * (n + 1) / 2, rtol=1e-6)
    else:
        with pytest.raises(TypeError, match="floating dtype"):
            e.all_reduce(a, op="avg")


@pytest.mark.mpi(min_size=1)
def test_all_reduce_shapes_and_non_contiguous_input():
    e = engine()
    n, r = nr(e)
    for shape in [(), (1,), (7,), (2, 3, 4)]:
        a = np.full(shape, float(r))
        got = e.all_reduce(a)
        assert got.shape == shape
        np.testing.assert_array_equal(got, np.full(shape, n * (n - 1) / 2))
    base = np.arange(12.0).reshape(3, 4) + r
    got = e.all_reduce(base.T)                           # a transposed (Fortran-order) view
    np.testing.assert_array_equal(got, (n * np.arange(12.0).reshape(3, 4) + n * (n - 1) / 2).T)
    got = e.all_reduce(base[:, ::2])                     # a strided view
    np.testing.assert_array_equal(got, n * np.arange(12.0).reshape(3, 4)[:, ::2] + n * (n - 1) / 2)


@pytest.mark.mpi(min_size=1)
def test_all_reduce_out_and_bad_op():
    e = engine()
    n, r = nr(e)
    out = np.empty(3)
    got = e.all_reduce(np.full(3, r + 1.0), out=out)
    assert got is out
    np.testing.assert_array_equal(out, np.full(3, n * (n + 1) / 2))
    with pytest.raises(ValueError, match="op must be one of.*'prod'"):
        e.all_reduce(np.ones(2), op="prod")


# -- all_gather --------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_gather_axis0_and_axis1(dtype):
    e = engine()
    n, r = nr(e)
    a = np.full((2, 3), r, dtype=dtype)
    got = e.all_gather(a, axis=0)
    assert got.shape == (2 * n, 3) and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, np.repeat(np.arange(n, dtype=dtype), 2)[:, None]
                                  * np.ones((1, 3), dtype=dtype))
    got = e.all_gather(a.T, axis=1)                      # (3, 2) per rank -> (3, 2n)
    assert got.shape == (3, 2 * n)
    np.testing.assert_array_equal(got, np.repeat(np.arange(n, dtype=dtype), 2)[None, :]
                                  * np.ones((3, 1), dtype=dtype))
    got = e.all_gather(a, axis=-1)                       # negative axis: the last one
    np.testing.assert_array_equal(got, np.concatenate([np.full((2, 3), i, dtype=dtype)
                                                       for i in range(n)], axis=1))


@pytest.mark.mpi(min_size=1)
def test_all_gather_uneven_lengths():
    e = engine()
    n, r = nr(e)
    # rank i contributes i + 1 rows / columns (and rank 0 none in the second case)
    a = np.full((r + 1, 2), 10.0 * r)
    want = np.concatenate([np.full((i + 1, 2), 10.0 * i) for i in range(n)])
    np.testing.assert_array_equal(e.all_gather(a, axis=0), want)
    b = np.arange(3 * r, dtype=np.int64).reshape(3, r) + 100 * r
    want = np.concatenate([np.arange(3 * i, dtype=np.int64).reshape(3, i) + 100 * i
                           for i in range(n)], axis=1)
    got = e.all_gather(b, axis=1)
    assert got.shape == (3, n * (n - 1) // 2)
    np.testing.assert_array_equal(got, want)


@pytest.mark.mpi(min_size=1)
def test_all_gather_non_contiguous_and_scalar():
    e = engine()
    n, r = nr(e)
    base = np.arange(6.0).reshape(3, 2) + 10 * r
    view = base.T                                        # (2, 3), not C-contiguous
    assert not view.flags.c_contiguous
    want0 = np.concatenate([(np.arange(6.0).reshape(3, 2) + 10 * i).T for i in range(n)], axis=0)
    np.testing.assert_array_equal(e.all_gather(view, axis=0), want0)
    want1 = np.concatenate([(np.arange(6.0).reshape(3, 2) + 10 * i).T for i in range(n)], axis=1)
    np.testing.assert_array_equal(e.all_gather(view, axis=1), want1)
    np.testing.assert_array_equal(e.all_gather(np.float64(r)), np.arange(n, dtype=np.float64))


# -- reduce_scatter ----------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_reduce_scatter_divisible(dtype):
    e = engine()
    n, r = nr(e)
    full = np.arange(2 * n * 3, dtype=dtype).reshape(2 * n, 3)
    got = e.reduce_scatter(full * (r + 1), op="sum")
    assert got.shape == (2, 3) and got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, full[2 * r:2 * r + 2] * (n * (n + 1) // 2))
    if np.dtype(dtype).kind == "f":
        got = e.reduce_scatter(full * (r + 1), op="avg")
        np.testing.assert_allclose(got, full[2 * r:2 * r + 2] * (n + 1) / 2, rtol=1e-6)


@pytest.mark.mpi(min_size=1)
def test_reduce_scatter_uneven_and_axis1():
    e = engine()
    n, r = nr(e)
    for length in (2 * n + 1, 3 * n - 1, 1):
        full = np.arange(length * 2, dtype=np.float64).reshape(length, 2)
        mine = np.array_split(full, n, axis=0)[r]        # numpy.array_split's blocks
        got = e.reduce_scatter(full * (r + 1), op="sum")
        np.testing.assert_array_equal(got, mine * (n * (n + 1) / 2))
        np.testing.assert_allclose(e.reduce_scatter(full + r, op="avg"),
                                   mine + (n - 1) / 2, rtol=1e-14)
    full = np.arange(3 * (2 * n + 1), dtype=np.float64).reshape(3, 2 * n + 1)
    got = e.reduce_scatter(full * (r + 1), op="sum", axis=1)
    np.testing.assert_array_equal(got, np.array_split(full, n, axis=1)[r] * (n * (n + 1) / 2))
    got = e.reduce_scatter((full * (r + 1)).T.T[:, :2 * n], axis=-1)   # divisible, a view
    np.testing.assert_array_equal(got, full[:, 2 * r:2 * r + 2] * (n * (n + 1) / 2))
    with pytest.raises(ValueError, match="'sum' or 'avg'"):
        e.reduce_scatter(full, op="max")


# -- all_to_all --------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_to_all(dtype):
    e = engine()
    n, r = nr(e)
    # block j (2 rows) of rank r holds 100 r + j; after the exchange block i holds 100 i + r
    a = np.repeat(100 * r + np.arange(n, dtype=dtype), 2)[:, None] * np.ones((1, 3), dtype=dtype)
    got = e.all_to_all(a, axis=0)
    want = np.repeat(100 * np.arange(n, dtype=dtype) + r, 2)[:, None] * np.ones((1, 3), dtype)
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, want)
    got = e.all_to_all(a.T, axis=1)                      # a transposed view, columns exchanged
    np.testing.assert_array_equal(got, want.T)
    np.testing.assert_array_equal(e.all_to_all(e.all_to_all(a)), a)   # its own adjoint


@pytest.mark.mpi(min_size=2)
def test_all_to_all_needs_divisible_length():
    e = engine()
    n, _ = nr(e)
    with pytest.raises(ValueError, match=rf"length {n + 1} along axis 0 .* group size {n}"):
        e.all_to_all(np.zeros((n + 1, 2)))


@pytest.mark.mpi(min_size=1)
def test_all_to_all_v():
    e = engine()
    n, r = nr(e)

    def count(src, dst):
        return (src + dst) % 3                           # includes zero-row messages

    sc = [count(r, j) for j in range(n)]
    a = np.concatenate([np.full((sc[j], 2), 1000.0 * r + j) for j in range(n)]).reshape(-1, 2)
    got, rc = e.all_to_all_v(a, sc)
    np.testing.assert_array_equal(rc, [count(i, r) for i in range(n)])
    want = np.concatenate([np.full((count(i, r), 2), 1000.0 * i + r) for i in range(n)])
    np.testing.assert_array_equal(got, want.reshape(-1, 2))
    back, rc2 = e.all_to_all_v(got, rc)                  # adjoint: counts swapped
    np.testing.assert_array_equal(rc2, sc)
    np.testing.assert_array_equal(back, a)
    with pytest.raises(ValueError, match="send_counts"):
        e.all_to_all_v(a, [a.shape[0] + 1] + [0] * (n - 1))


# -- broadcast ---------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES)
def test_broadcast_non_root_passes_none(dtype):
    e = engine()
    n, r = nr(e)
    for root in sorted({0, n - 1}):
        want = (np.arange(12, dtype=dtype).reshape(2, 3, 2) + root)
        got = e.broadcast(want.copy() if r == root else None, root=root)
        assert got.dtype == np.dtype(dtype) and got.shape == (2, 3, 2)
        np.testing.assert_array_equal(got, want)
    view = np.arange(6.0).reshape(2, 3).T
    np.testing.assert_array_equal(e.broadcast(view if r == 0 else None, root=0), view)


# -- point to point ----------------------------------------------------------------------------
def payload(src, dtype=np.float64):
    """What rank `src` sends: shape and values depend on the sender."""
    return (np.arange((src + 1) * 2, dtype=dtype).reshape(src + 1, 2) + 10 * src).astype(dtype)


@pytest.mark.mpi(min_size=2)     # a blocking Send to oneself may wait forever (MPI standard)
@pytest.mark.parametrize("dtype", DTYPES)
def test_send_receive_ring(dtype):
    e = engine()
    n, r = nr(e)
    nxt, prv = (r + 1) % n, (r - 1) % n
    if r % 2 == 0:        # even ranks send first, odd ranks receive first: no cycle of waits
        e.send(nxt, payload(r, dtype))
        got = e.receive(prv)
    else:
        got = e.receive(prv)
        e.send(nxt, payload(r, dtype))
    assert got.dtype == np.dtype(dtype)
    np.testing.assert_array_equal(got, payload(prv, dtype))


@pytest.mark.mpi(min_size=1)
def test_send_async_receive_async_header_form():
    e = engine()
    n, r = nr(e)
    nxt, prv = (r + 1) % n, (r - 1) % n
    recv = e.receive_async(prv, tag=5)
    send = e.send_async(payload(r).T, nxt, tag=5)        # non-contiguous input
    assert isinstance(send, ms.Future) and isinstance(recv, ms.Future)
    got = recv.result()
    np.testing.assert_array_equal(got, payload(prv).T)
    send.result()
    assert send.done() and recv.done()
    assert recv.result() is got                          # result() is idempotent


@pytest.mark.mpi(min_size=1)
def test_send_async_seed_form_lands_in_out():
    """The seed API: send_async(src, dst, target) with receive_async(src, out=dst)."""
    e = engine()
    n, r = nr(e)
    nxt, prv = (r + 1) % n, (r - 1) % n
    src = np.full((4, 3), float(r))
    dst = np.empty((4, 3))                               # this rank's receive buffer
    recv = e.receive_async(prv, out=dst)
    send = e.send_async(src, dst, nxt)
    while not recv.done():                               # polling completes the transfer
        pass
    assert recv.result() is dst
    np.testing.assert_array_equal(dst, np.full((4, 3), float(prv)))
    send.result()
    with pytest.raises(ValueError, match="C-contiguous"):
        e.receive_async(prv, out=np.empty((3, 4)).T)


@pytest.mark.mpi(min_size=1)
def test_tags_keep_messages_apart():
    e = engine()
    n, r = nr(e)
    nxt, prv = (r + 1) % n, (r - 1) % n
    s1 = e.send_async(np.full(2, 1.0 + r), nxt, tag=1)
    s2 = e.send_async(np.full(3, 2.0 + r), nxt, tag=2)
    got2 = e.receive(prv, tag=2)                         # out of order on purpose
    got1 = e.receive(prv, tag=1)
    s1.result(), s2.result()
    np.testing.assert_array_equal(got1, np.full(2, 1.0 + prv))
    np.testing.assert_array_equal(got2, np.full(3, 2.0 + prv))


# -- group= on a 2-D mesh ----------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_group_on_a_2d_mesh():
    comm = world()
    size = comm.Get_size()
    if size % 2:
        pytest.skip("needs an even world size")
    k = size // 2
    e = ms.make_engine(ms.MLP([4, 4]), f"dp=2,tp={k}", comm=comm)
    r = e.device_id
    d, t = divmod(r, k)                                  # rank = dp * k + tp (tp innermost)
    assert (e.group_rank("dp"), e.group_rank("tp")) == (d, t)
    assert (e.group_size("dp"), e.group_size("tp")) == (2, k)
    a = np.array([float(r)])
    tp_ranks = [d * k + j for j in range(k)]
    dp_ranks = [i * k + t for i in range(2)]
    np.testing.assert_array_equal(e.all_reduce(a, group="tp"), [sum(tp_ranks)])
    np.testing.assert_array_equal(e.all_reduce(a, group="dp"), [sum(dp_ranks)])
    np.testing.assert_array_equal(e.all_reduce(a, group=("tp", "dp")), [size * (size - 1) / 2])
    np.testing.assert_array_equal(e.all_reduce(a, op="max", group="tp"), [max(tp_ranks)])
    np.testing.assert_array_equal(e.all_gather(a, group="tp"), tp_ranks)
    np.testing.assert_array_equal(e.all_gather(a, group="dp"), dp_ranks)
    full = np.arange(2 * 3.0).reshape(2, 3)
    np.testing.assert_array_equal(e.reduce_scatter(full * (r + 1), group="dp"),
                                  full[d:d + 1] * (sum(dp_ranks) + 2))
    got = e.broadcast(np.array([r]) if t == 0 else None, root=0, group="tp")
    np.testing.assert_array_equal(got, [d * k])
    # send/receive address ranks inside the group
    nxt, prv = (t + 1) % k, (t - 1) % k
    fut = e.send_async(np.array([r]), nxt, group="tp")
    np.testing.assert_array_equal(e.receive(prv, group="tp"), [d * k + prv])
    fut.result()
    e.barrier(group="tp")
    e.barrier()


# -- counters ----------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_comm_bytes_counters():
    e = engine()
    n, r = nr(e)
    e.reset_comm_stats()
    e.all_reduce(np.ones(10))                            # 80 bytes
    e.all_reduce(np.ones(10, dtype=np.float32))          # 40 bytes
    e.all_gather(np.ones((2, 3)))                        # 48 bytes per rank
    e.reduce_scatter(np.ones((2 * n, 3)))                # 48 n bytes in
    e.all_to_all(np.ones((n, 2)))                        # 16 n bytes
    e.broadcast(np.ones(5) if r == 0 else None, root=0)  # 40 bytes
    nxt, prv = (r + 1) % n, (r - 1) % n
    fut = e.send_async(np.ones(7), nxt)                  # 56 bytes
    e.receive(prv)
    fut.result()
    assert e.comm_calls["all_reduce"] == 2
    assert e.comm_bytes["all_reduce"] == int(2 * (n - 1) / n * 80) + int(2 * (n - 1) / n * 40)
    assert e.comm_bytes["all_gather"] == int((n - 1) / n * (48 * n))
    assert e.comm_bytes["reduce_scatter"] == int((n - 1) / n * (48 * n))
    assert e.comm_bytes["all_to_all"] == int((n - 1) / n * (16 * n))
    assert e.comm_bytes["broadcast"] == (int((n - 1) / n * 40) if r == 0 else 0)
    assert e.comm_bytes["send"] == 56
    assert all(e.comm_time[k] >= 0 for k in e.comm_calls)
    e.reset_comm_stats()
    assert not e.comm_bytes and not e.comm_calls


# -- debug mode --------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_debug_mode_names_a_shape_mismatch_on_every_rank():
    e = engine(debug=True)
    n, r = nr(e)
    with pytest.raises(ms.CollectiveMismatchError) as info:
        e.all_reduce(np.ones(3 if r == 0 else 4))
    msg = str(info.value)
    assert "all_reduce" in msg
    assert "group rank 0: all_reduce(op=sum, dtype=float64, shape=(3,)" in msg
    assert f"group rank {n - 1}: all_reduce(op=sum, dtype=float64, shape=(4,)" in msg
    assert len(set(world().allgather(msg))) == 1          # the same message everywhere
    # the engine is still usable: a matching call goes through
    np.testing.assert_array_equal(e.all_reduce(np.ones(2)), np.full(2, n))


@pytest.mark.mpi(min_size=2)
def test_debug_mode_from_the_environment(monkeypatch):
    monkeypatch.setenv("MPISHARD_DEBUG", "1")
    e = engine(debug=None)
    assert e.debug
    n, r = nr(e)
    with pytest.raises(ms.CollectiveMismatchError, match=r"float32.*float64|float64.*float32"):
        e.all_reduce(np.ones(3, dtype=np.float32 if r == n - 1 else np.float64))
    with pytest.raises(ms.CollectiveMismatchError, match=r"op=max.*op=sum|op=sum.*op=max"):
        e.all_reduce(np.ones(3), op="sum" if r else "max")
    with pytest.raises(ms.CollectiveMismatchError, match=r"all_gather"):
        e.all_gather(np.ones((2, 3 if r == 0 else 2)))   # non-axis dims must agree
    with pytest.raises(ms.CollectiveMismatchError, match=r"reduce_scatter"):
        e.reduce_scatter(np.ones((2 * n, 3)), axis=0 if r == 0 else 1)
    # uneven lengths along the gather axis are legal, not a mismatch
    assert e.all_gather(np.ones((r + 1, 2))).shape == (n * (n + 1) // 2, 2)


@pytest.mark.mpi(min_size=1)
def test_debug_mode_off_by_default(monkeypatch):
    monkeypatch.delenv("MPISHARD_DEBUG", raising=False)
    assert not engine(debug=None).debug
    monkeypatch.setenv("MPISHARD_DEBUG", "0")
    assert not engine(debug=None).debug


# -- adversarial regressions -------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_header_receives_complete_in_posting_order():
    """Two header-form receives from one source with one tag: finishing the second first
    (result() or done()) must not pair its header with the first message's data."""
    e = engine()
    n, r = nr(e)
    nxt, prv = (r + 1) % n, (r - 1) % n
    for finish_second_first in (lambda f: f.result(), lambda f: [0 for _ in iter(f.done, True)],
                                None):
        sends = [e.send_async(np.full(2, 1.0 + r), nxt, tag=3),
                 e.send_async(np.full((3, 2), 2.0 + r), nxt, tag=3)]
        first = e.receive_async(prv, tag=3)
        if finish_second_first is None:                  # a blocking receive in between
            second = e.receive(prv, tag=3)
        else:
            fut = e.receive_async(prv, tag=3)
            finish_second_first(fut)
            second = fut.result()
        np.testing.assert_array_equal(second, np.full((3, 2), 2.0 + prv))
        np.testing.assert_array_equal(first.result(), np.full(2, 1.0 + prv))
        for s in sends:
            s.result()
    assert e.comm.pending_receives == {}                 # nothing pending is kept
    with pytest.raises(ValueError, match="tag must be an integer >= 0, got -1"):
        e.receive_async(prv, out=np.empty(2), tag=-1)    # -1 would be MPI_ANY_TAG


@pytest.mark.mpi(min_size=1)
def test_broadcast_a_bad_root_array_raises_on_every_rank():
    e = engine()
    n, r = nr(e)
    with pytest.raises(TypeError, match="broadcast from group rank 0: dtype object"):
        e.broadcast(None, root=0)                        # the root forgot its array
    with pytest.raises(ValueError, match=f"broadcast from group rank {n - 1}: .*11"):
        e.broadcast(np.zeros((1,) * 11) if r == n - 1 else None, root=n - 1)
    np.testing.assert_array_equal(e.broadcast(np.arange(3) if r == 0 else None), np.arange(3))


@pytest.mark.mpi(min_size=2)
def test_debug_mode_catches_mistakes_that_one_rank_would_raise_alone():
    """A dtype, length or axis that only one rank gets wrong is compared before that rank's
    own checks, so every rank raises CollectiveMismatchError (none is left waiting)."""
    e = engine(debug=True)
    n, r = nr(e)
    last = r == n - 1
    cases = [
        (lambda: e.all_reduce(np.ones(3, np.int64 if last else np.float64), op="avg"),
         r"dtype=int64"),
        (lambda: e.all_reduce(np.ones(3, np.longdouble if last else np.float64)),
         r"dtype=unsupported float128|dtype=unsupported longdouble"),
        (lambda: e.all_to_all(np.ones((n + 1 if last else n, 2))), r"all_to_all"),
        (lambda: e.all_gather(np.ones(2) if last else np.ones((2, 3)), axis=1), r"all_gather"),
        (lambda: e.reduce_scatter(np.ones((n, 2)), op="max" if last else "sum"), r"op=max"),
        (lambda: e.all_to_all_v(np.ones(n, np.float32 if last else np.float64), [1] * n),
         r"all_to_all_v.*float32"),
        (lambda: e.broadcast(np.ones(2), root=r), r"broadcast.*root=1"),
    ]
    for call, message in cases:
        with pytest.raises(ms.CollectiveMismatchError, match=message) as info:
            call()
        assert len(set(world().allgather(str(info.value)))) == 1
    with pytest.raises(ValueError, match=rf"group rank {n - 1}: all_to_all_v: send_counts"):
        e.all_to_all_v(np.ones(n), [2] * n if last else [1] * n)
    np.testing.assert_array_equal(e.all_reduce(np.ones(2)), np.full(2, n))   # still in step


def test_engine_calls_are_the_comms_with_their_signature_and_doc():
    """engine.all_to_all calls the Comm's all_to_all (same signature and docstring); an
    engine class that defines one of them keeps its own."""
    import inspect

    from mpishard.comm.collectives import Comm

    e = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
    for name in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "barrier"):
        assert inspect.signature(getattr(type(e), name)) == inspect.signature(getattr(Comm, name))
        assert getattr(type(e), name).__doc__ == getattr(Comm, name).__doc__
    np.testing.assert_array_equal(e.all_gather(np.arange(3.0)), np.arange(3.0))

    class Mine(MeshEngine):
        def all_reduce(self, arr, op="sum", group=None, out=None):
            return "mine"

    m = Mine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
    assert m.all_reduce(np.ones(2)) == "mine"
    np.testing.assert_array_equal(m.all_gather(np.ones(2)), np.ones(2))


def test_bfloat16_moves_as_words_but_never_sums():
    """A bfloat16 array goes through MPI's non-reducing calls as its 2-byte words (mpi4py has
    no bfloat16 buffer), and a reduction of one raises before any communication: MPI would
    add its words as float16 numbers (16-bit gradients reduce through LowPrecisionComm)."""
    import ml_dtypes

    e = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
    a = np.arange(6.0, dtype=np.float32).astype(ml_dtypes.bfloat16)
    got = e.all_gather(a)
    assert got.dtype == a.dtype and np.array_equal(got, a)
    for call in (e.all_reduce, e.reduce_scatter, e.all_reduce_async):
        with pytest.raises(TypeError, match="no bfloat16 sum"):
            call(a)


def test_comm_stats_columns_read_zero_for_unused_kinds():
    e = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
    e.all_reduce(np.ones(4))
    e.all_reduce(np.ones(4))
    assert e.comm_calls["all_reduce"] == 2 and e.comm_calls["all_to_all"] == 0
    assert e.comm_bytes["broadcast"] == 0 and e.comm_time["all_reduce"] >= 0.0
    e.reset_comm_stats()
    assert e.comm_calls["all_reduce"] == 0


# -- result buffers: ownership is the caller's, never inferred from reference counts ----------
class _ViewsWithoutBase:
    """Makes a device double (tests/device_double.py) whose views do not hold the array they
    view, as a device array library may: then nothing but the caller's own reference to a
    view says that a collective's result is still in use."""

    @staticmethod
    def module(cuda_aware):
        from device_double import DeviceArray, DeviceModule

        class Module(DeviceModule):
            def wrap(self, r, sources=()):
                out = super().wrap(r, sources)
                if isinstance(out, DeviceArray) and not any(out is s for s in sources):
                    out._base = None
                return out
        return Module(cuda_aware=cuda_aware)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", ["staged", "cuda_aware"])
def test_tp_gradients_are_right_when_views_do_not_hold_their_base(mode):
    """Issue 31 defect 3: a result pool that reused a buffer once its reference count said
    nobody held it handed tp=2 a buffer that activations (views of it) still used, and the
    weight gradients came out wrong while the loss was right. Results are fresh arrays now."""
    from conftest import RTOL64, assert_close, group_comm

    from mpishard.comm.backend import Backend

    comm = group_comm(2)
    xp = _ViewsWithoutBase.module(mode == "cuda_aware")
    backend = Backend("gpu", comm, cuda_aware=mode == "cuda_aware", array_module=xp)
    rng = np.random.default_rng(1)
    model = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    loss_fn = ms.losses.CrossEntropy()
    x, t = (rng.integers(0, 16, (4, 8)) for _ in range(2))
    params = model.init(seed=0)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    want_loss, want = ref.train_step(x, t, loss_fn)

    engine = ms.make_engine(model, "tp=2", comm=comm, device=backend)
    engine.load_checkpoint(params)
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), loss_fn)
    full = {k: backend.to_host(v) for k, v in engine.gather_grads(grads).items()}
    assert_close(loss, want_loss, rtol=RTOL64, what=f"GPT tp=2 {mode} loss")
    for name in want:
        assert_close(full[name], want[name], rtol=RTOL64, what=f"GPT tp=2 {mode} {name}")

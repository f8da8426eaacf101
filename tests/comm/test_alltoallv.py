"""all_to_all_v as matched point-to-point messages (comm/alltoallv.py) equals MPI Alltoallv
bit for bit, at any world size: counts learnt from the messages or given, every dtype the
engine moves, rows of any trailing shape (empty ones too), back-to-back calls whose counts
differ, a user message with the same tag in flight, the watchdog off, a group axis.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_alltoallv.py
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import world
from mpishard.comm.alltoallv import mpi_type

DTYPES = [np.float64, np.float32, np.int64, np.int32, np.float16, np.uint8, np.bool_,
          np.complex128, np.complex64]


def make(layout=None, timeout=600.0, debug=False):
    comm = world()
    return ms.make_engine(ms.MLP([4, 8, 4]), layout or f"dp={comm.Get_size()}", comm=comm,
                          timeout=timeout, debug=debug)


def counts(r, n, salt=0):
    return [(3 * r + 2 * j + salt) % 4 for j in range(n)]        # zero-row blocks included


def rows(r, n, trailing, dtype, salt=0):
    """Rank r's rows: block j holds the values 1000 r + 10 j + salt."""
    sc = counts(r, n, salt)
    parts = [np.full((c,) + trailing, (1000 * r + 10 * j + salt) % 97) for j, c in
             enumerate(sc)]
    return np.concatenate(parts).astype(dtype).reshape((sum(sc),) + trailing), sc


def reference(comm, a, sc):
    """MPI Alltoallv with the counts exchanged first: (rows, recv_counts)."""
    n = comm.Get_size()
    row = int(np.prod(a.shape[1:], dtype=np.int64))
    rc = np.empty(n, dtype=np.int64)
    comm.Alltoall(np.array(sc, dtype=np.int64), rc)
    out = np.empty((int(rc.sum()),) + a.shape[1:], dtype=a.dtype)
    sd = np.concatenate([[0], np.cumsum(sc)[:-1]]).astype(np.int64) * row
    rd = np.concatenate([[0], np.cumsum(rc)[:-1]]).astype(np.int64) * row
    t = mpi_type(a.dtype)
    comm.Alltoallv([a, np.array(sc, np.int64) * row, sd, t], [out, rc * row, rd, t])
    return out, rc


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("trailing", [(), (3,), (2, 5), (0,)], ids=str)
def test_equals_alltoallv(dtype, trailing):
    e = make()
    comm = e.mesh.comm("dp")
    n, r = comm.Get_size(), comm.Get_rank()
    a, sc = rows(r, n, trailing, dtype)
    want, want_rc = reference(comm, a, sc)
    got, rc = e.all_to_all_v(a, sc)
    assert rc.dtype == np.int64 and rc.tolist() == want_rc.tolist()
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got, want)
    given, rc2 = e.all_to_all_v(a, np.array(sc), recv_counts=want_rc)    # counts known
    np.testing.assert_array_equal(given, want)
    assert rc2.tolist() == want_rc.tolist()
    back, _ = e.all_to_all_v(got, rc)                                    # the adjoint
    np.testing.assert_array_equal(back, a)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("timeout", [600.0, 0.0], ids=["watchdog", "no-watchdog"])
def test_back_to_back_calls_and_a_user_message_do_not_mix(timeout):
    """Ten calls with different counts in a row, a user send/receive on tag 0 in flight
    around them (the private communicator keeps them apart)."""
    e = make(timeout=timeout)
    comm = e.mesh.comm("dp")
    n, r = comm.Get_size(), comm.Get_rank()
    pending = e.receive_async((r - 1) % n, tag=0)
    e.send_async(np.full(4, float(r)), dest=(r + 1) % n, tag=0)
    for salt in range(10):
        a, sc = rows(r, n, (2,), np.float64, salt)
        want, _ = reference(comm, a, sc)
        got, _ = e.all_to_all_v(a, sc)
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(pending.result(), np.full(4, float((r - 1) % n)))


@pytest.mark.mpi(min_size=2)
def test_on_a_group_axis_and_in_debug_mode():
    n = world().Get_size()
    if n % 2:
        pytest.skip("needs an even world size")
    for e in (make(f"dp={n // 2},tp=2"), make(debug=True)):
        for group in (["tp"] if e.layout.size("tp") > 1 else []) + ["dp"]:
            comm = e.mesh.comm(group)
            a, sc = rows(comm.Get_rank(), comm.Get_size(), (3,), np.float32)
            want, _ = reference(comm, a, sc)
            np.testing.assert_array_equal(e.all_to_all_v(a, sc, group=group)[0], want)


@pytest.mark.mpi(min_size=1)
def test_counts_are_checked_before_any_message():
    e = make()
    n = e.mesh.comm("dp").Get_size()
    with pytest.raises(ValueError, match=rf"must be {n} non-negative counts summing to the 2"):
        e.all_to_all_v(np.ones((2, 3)), [3] + [0] * (n - 1))
    with pytest.raises(ValueError, match="send_counts"):
        e.all_to_all_v(np.ones((2, 3)), [[2] * n])
    a, sc = rows(e.mesh.comm("dp").Get_rank(), n, (), np.float64)
    e.all_to_all_v(a, sc)                      # nothing was left in flight by the errors
    assert MPI.Is_initialized()


@pytest.mark.mpi(min_size=1)
def test_results_whose_shape_changes_are_plain_arrays_of_their_own():
    """Issue 31 defect 4: a result pool kept results in huge-page mappings and churned when
    the row count changed every call (MoE's dispatch), 3-5x slower than np.empty. Every
    result is now a fresh array that owns its memory: no kept buffer, no mapping, and two
    calls never share memory."""
    e = make()
    comm = world()
    n, r = comm.Get_size(), comm.Get_rank()
    cols = (4 << 20) // 8 // (2 * n)                  # up to ~4 MiB of float64 rows
    results = []
    for step in range(12):                            # the row count differs per call
        sc = [(step + r + j) % 3 for j in range(n)]
        a = np.full((sum(sc), 2 * cols), float(r))
        out, rc = e.all_to_all_v(a, sc)
        assert out.base is None and out.flags.owndata, "a result that is not its own array"
        assert out.shape == (int(rc.sum()), 2 * cols)
        results.append(out)
    x = np.ones((2 * n, cols))
    for out in (e.all_reduce(x), e.all_gather(x), e.reduce_scatter(x), e.all_to_all(x)):
        assert out.base is None and out.flags.owndata
        results.append(out)
    held = [res for res in results if res.size]
    for i, res in enumerate(held):
        assert not any(np.shares_memory(res, other) for other in held[i + 1:])

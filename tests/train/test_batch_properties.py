"""Property-based tests (hypothesis) of shard_batch / gather_batch under MPI, every world size.

    mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_batch_properties.py

- round trip: for any global batch (rows a multiple of the data-parallel size, any trailing
  shape, float32/float64/int64) and any layout of the world (dp, fsdp, tp, pp and their
  products), every rank is fed exactly its block of rows (`shard_batch`), and `gather_batch`
  of those blocks gives the whole batch back on every rank, bit for bit, in the engine's dtype
  for floats and unchanged for integers. Under pp the gather broadcasts from the last stage,
  so the other stages' blocks are replaced by garbage first: the result must not depend on them.
- a batch whose rows do not divide raises the same ValueError on every rank, before any
  communication (the next collective still lines up).

Every rank must draw the same examples, so hypothesis runs derandomized (a fixed seed, no
example database) and the batch is built from the drawn seed on every rank alike. cp is left
out: `gather_batch` concatenates rows and does not undo `shard_sequence` (cp's sequence
chunks), by contract.
"""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mpishard as ms

from conftest import world

pytestmark = pytest.mark.mpi(min_size=1)

SETTINGS = settings(max_examples=40, deadline=None, database=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])
DIMS = [4, 8, 8, 8, 3]                   # 4 layers: up to pp=4; hidden 8: up to tp=8


def layouts(n):
    """Layouts of an n-rank world over the data axes and their products with tp and pp."""
    out = [f"dp={n}", f"fsdp={n}", f"tp={n}"]
    if n <= 4:
        out.append(f"pp={n}")
    if n >= 2 and n % 2 == 0:
        out += [f"dp={n // 2},tp=2", f"dp={n // 2},pp=2", f"fsdp={n // 2},tp=2"]
    if n >= 4 and n % 4 == 0:
        out.append(f"dp={n // 4},pp=2,tp=2")
    return out


@pytest.fixture(scope="module")
def engines():
    """One engine per layout for the module (each owns split communicators)."""
    comm = world()
    return {layout: ms.make_engine(ms.MLP(DIMS), layout, comm=comm)
            for layout in layouts(comm.Get_size())}


def batch(seed, rows, tail, dtype):
    rng = np.random.default_rng(seed)
    if dtype == "int64":
        return rng.integers(-1000, 1000, size=(rows, *tail))
    return rng.standard_normal((rows, *tail)).astype(dtype)


@SETTINGS
@given(data=st.data())
def test_shard_then_gather_is_the_batch(engines, data):
    layout = data.draw(st.sampled_from(sorted(engines)), label="layout")
    e = engines[layout]
    n = e.data_parallel_size
    rows = n * data.draw(st.integers(1, 4), label="rows per rank")
    tail = tuple(data.draw(st.lists(st.integers(1, 5), max_size=2), label="trailing shape"))
    dtype = data.draw(st.sampled_from(["float32", "float64", "int64"]), label="dtype")
    x = batch(data.draw(st.integers(0, 2**31 - 1), label="seed"), rows, tail, dtype)

    local = e.shard_batch(x)
    i = e.data_parallel_rank
    want_local = x[rows // n * i:rows // n * (i + 1)]
    assert local.shape == want_local.shape
    if dtype == "int64":
        assert local.dtype == np.int64
        np.testing.assert_array_equal(local, want_local)
    else:
        assert local.dtype == e.dtype
        np.testing.assert_array_equal(local, want_local.astype(e.dtype))

    pp = e.layout.size("pp")
    if pp > 1 and e.mesh.coord("pp") != pp - 1:
        local = np.full_like(local, 7)       # only the last stage's output is gathered
    back = e.gather_batch(local)
    want = x if dtype == "int64" else x.astype(e.dtype)
    assert back.shape == x.shape and back.dtype == want.dtype
    np.testing.assert_array_equal(back, want)


@SETTINGS
@given(data=st.data())
def test_rows_that_do_not_divide_raise_the_same_error_everywhere(engines, data):
    comm = world()
    layout = data.draw(st.sampled_from(sorted(engines)), label="layout")
    e = engines[layout]
    n = e.data_parallel_size
    if n == 1:
        return                               # every row count divides
    rows = data.draw(st.integers(1, 5 * n).filter(lambda r: r % n), label="rows")
    with pytest.raises(ValueError) as info:
        e.shard_batch(np.zeros((rows, 3)))
    message = str(info.value)
    assert f"batch of {rows} rows does not divide by the {n} data-parallel ranks" in message
    assert comm.allgather(message) == [message] * comm.Get_size()

"""The fast staged path (mpishard/comm/staging.py) on the device double.

A large staged all_reduce goes in pipelined chunks: its result must equal the one-piece
staged all_reduce exactly (integer-valued floats, so any reduction order gives the same
sums), in place too, with the same staged byte counters and every staged byte one counted copy
of the double; pinned host buffers come from the module's `alloc_pinned_memory` when it has
one. MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/comm/test_staging.py` for N in 2, 4.
"""
import types

import numpy as np
import pytest
from conftest import group_comm
from test_device_double import device_backend

from mpishard.comm.collectives import Comm
from mpishard.comm.mesh import DeviceMesh, parse_layout
from mpishard.comm.staging import pinned_empty


def test_pinned_buffers_where_the_module_can_pin():
    taken = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        alloc_pinned_memory=lambda n: taken.append(n) or bytearray(n)))
    a = pinned_empty(fake, (3, 4), np.float32)
    assert a.shape == (3, 4) and a.dtype == np.float32 and taken == [48]
    a[...] = 1.0                                   # writable host memory
    plain = pinned_empty(types.SimpleNamespace(cuda=types.SimpleNamespace()), (2,), np.int64)
    assert isinstance(plain, np.ndarray) and plain.shape == (2,)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("in_place", [False, True])
def test_chunked_staged_all_reduce_equals_one_piece(n, in_place):
    comm = group_comm(n)
    mesh = DeviceMesh(comm, parse_layout(f"dp={n}"))
    rng = np.random.default_rng(comm.Get_rank())
    host = rng.integers(-1000, 1000, (37, 11)).astype(np.float64)
    want = sum(comm.allgather(host))
    results, counters = {}, {}
    for chunked in (False, True):
        backend, xp = device_backend(comm, "staged")
        backend.pipeline.chunk_bytes = 160 if chunked else 1 << 30     # 20 float64 a chunk
        engine = Comm(mesh, backend)
        d = xp.asarray(host)
        xp.copies.reset()
        got = engine.all_reduce(d, "sum", out=d if in_place else None)
        results[chunked] = xp.asnumpy(got)
        counters[chunked] = dict(backend.staged)
        assert xp.copies.staging == backend.staged          # one counted copy per byte
        assert backend.pipeline.chunks == (-(-host.size // 20) if chunked else 0)
        if in_place:
            assert got is d
    np.testing.assert_array_equal(results[True], want)
    np.testing.assert_array_equal(results[True], results[False])
    assert counters[True] == counters[False] == {"to_host": host.nbytes,
                                                 "to_device": host.nbytes}

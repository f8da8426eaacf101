"""Control data between ranks (comm/objects.py): JSON gather/scatter and agree on an engine's
Comm, at any world size. That a late rank times out naming it is tested where the checkpoint
uses these (tests/checkpoint/test_checkpoint_deadlines.py).

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_objects.py
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.comm.objects import agree, gather_json, scatter_json

from conftest import world


def engine_comm():
    n = world().Get_size()
    return ms.make_engine(ms.MLP([2, 2]), f"dp={n}" if n > 1 else "single", comm=world()).comm


@pytest.mark.mpi(min_size=1)
def test_gather_and_scatter_carry_json_of_any_length():
    comm = engine_comm()
    rank, size = comm.rank(), comm.size()
    mine = {"rank": rank, "names": ["w"] * (3 * rank), "step": np.int64(7), "x": 0.1 * rank}
    for root in range(size):
        got = gather_json(comm, mine, "test gather", root=root)
        if rank == root:
            assert got == [{"rank": r, "names": ["w"] * (3 * r), "step": 7, "x": 0.1 * r}
                           for r in range(size)]
        else:
            assert got is None
        objs = [[r, "é" * r, None] for r in range(size)] if rank == root else None
        assert scatter_json(comm, objs, "test scatter", root=root) == [rank, "é" * rank, None]


@pytest.mark.mpi(min_size=1)
def test_agree_raises_the_first_failing_message_on_every_rank():
    comm = engine_comm()
    rank, size = comm.rank(), comm.size()
    agree(comm, None, ValueError, "test agree")                 # everyone fine: no error
    with pytest.raises(KeyError, match=f"rank {size - 1} failed"):
        agree(comm, f"rank {rank} failed" if rank == size - 1 else None, KeyError, "test")


@pytest.mark.mpi(min_size=1)
def test_arrays_are_not_control_data():
    comm = engine_comm()
    with pytest.raises(TypeError, match="ndarray is not control data"):
        gather_json(comm, np.zeros(3), "test")          # refused before any message is sent

"""comm/gpu.device_rank: the node-local rank that picks a rank's GPU is its rank among the
job's ranks on the node, also for an engine built on a smaller communicator (a serve
replica's), whose own numbering would put every replica on the node's first GPUs.

MPI tests: `mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi
tests/comm/test_device_rank.py` (any rank count; the split needs 2).
"""
import pytest
from mpi4py import MPI

from mpishard.comm.backend import Backend
from mpishard.comm.gpu import LOCAL_RANK_VARIABLES, device_rank, node_local_rank
from device_double import DeviceModule


@pytest.mark.mpi(min_size=2)
def test_a_replica_s_ranks_keep_their_place_on_the_node():
    world = MPI.COMM_WORLD
    job_local = node_local_rank(world)
    assert device_rank(world) == job_local == device_rank(world, environ={})
    half = world.Split(world.Get_rank() % 2, world.Get_rank())       # two "replicas"
    try:
        launcher = {name: str(job_local) for name in LOCAL_RANK_VARIABLES[:1]}
        assert device_rank(half, environ=launcher) == job_local
        for name in LOCAL_RANK_VARIABLES:                # each launcher's variable alone
            assert device_rank(half, environ={name: str(job_local)}) == job_local
        assert device_rank(half, environ={}) == node_local_rank(half)  # none set: its own
        assert device_rank(half, environ={"MPI_LOCALRANKID": "x"}) == node_local_rank(half)
        # the engine's Backend takes the same rank (this launcher sets one of the variables)
        backend = Backend("gpu", half, array_module=DeviceModule())
        assert backend.local_rank == device_rank(half)
    finally:
        half.Free()

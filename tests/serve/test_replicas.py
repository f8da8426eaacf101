"""serve/replicas: a serving layout's dp axis split into replicas, the rest refused or kept,
and each replica's communicator a contiguous block of world ranks.

Serial: `pytest tests/serve/test_replicas.py -m "not mpi"`.
MPI, N in 1, 2, 4, 8: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi \
    tests/serve/test_replicas.py`
"""
import pytest
from conftest import world

from mpishard.serve.replicas import replica_comm, split_replicas


@pytest.mark.parametrize("layout,size,want", [
    ("single", 1, (1, "single")), ("tp=2", 2, (1, "tp=2")), ("dp=2", 2, (2, "single")),
    ("dp=2,tp=2", 4, (2, "tp=2")), ("tp=2,dp=3", 6, (3, "tp=2")),
    ("dp=2,pp=2,microbatches=4,schedule=gpipe", 4, (2, "pp=2,microbatches=4,schedule=gpipe")),
    ("dp=4,bucket_mb=8,overlap=0", 4, (4, "single")), ("pp=2,tp=2", 4, (1, "pp=2,tp=2"))])
def test_dp_becomes_replicas_of_the_rest(layout, size, want):
    assert split_replicas(layout, size) == want


@pytest.mark.parametrize("layout,size,what", [
    ("fsdp=2", 2, "fsdp=2"), ("dp=2,ep=2", 4, "ep=2"), ("cp=2", 2, "cp=2"),
    ("tp=2,sequence_parallel=1", 2, "sequence_parallel=1"), ("dp=2,tp=2", 2, "needs 4 ranks"),
    ("tp=two", 2, "integer")])
def test_what_serve_cannot_run_is_refused(layout, size, what):
    with pytest.raises(ValueError, match=what):
        split_replicas(layout, size)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("replicas", [1, 2, 4])
def test_a_replica_is_a_contiguous_block_of_world_ranks(replicas):
    comm = world()
    size, rank = comm.Get_size(), comm.Get_rank()
    if size % replicas:
        pytest.skip(f"{replicas} replicas do not divide {size} ranks")
    sub, index = replica_comm(comm, replicas)
    try:
        per = size // replicas
        assert index == rank // per and sub.Get_size() == per and sub.Get_rank() == rank % per
        assert sub.allgather(rank) == list(range(index * per, (index + 1) * per))
    finally:
        sub.Free()
    with pytest.raises(ValueError, match="do not divide"):
        replica_comm(comm, size + 1)

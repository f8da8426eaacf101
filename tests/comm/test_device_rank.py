"""Which GPU an engine on part of a job takes: by default its rank among its communicator's
ranks on the node (comm/gpu.py), and with `device_rank=` (serve gives each replica's engine
its rank among the whole job's ranks on the node) that one, so the parts of a job take
different GPUs instead of all starting at the node's first.

MPI tests: `mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi
tests/comm/test_device_rank.py` (2 ranks or more).
"""
import argparse

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.cli.device_options import engine_options
from mpishard.comm.backend import Backend
from mpishard.comm.gpu import gpu_for_rank, node_local_rank
from device_double import DeviceModule


@pytest.mark.mpi(min_size=2)
def test_a_part_of_the_job_takes_the_gpu_of_its_place_in_the_job():
    world = MPI.COMM_WORLD
    job_local = node_local_rank(world)
    half = world.Split(world.Get_rank() % 2, world.Get_rank())       # two "replicas"
    try:
        own = node_local_rank(half)
        assert own != job_local or world.Get_rank() < 2    # halves number from 0 again
        assert Backend("gpu", half, array_module=DeviceModule()).local_rank == own
        given = Backend("gpu", half, array_module=DeviceModule(), local_rank=job_local)
        assert given.local_rank == job_local
        assert given.device_index == gpu_for_rank(job_local, 1)          # the double: 1 GPU
        layout = "single" if half.Get_size() == 1 else f"dp={half.Get_size()}"
        engine = ms.make_engine(ms.MLP([2, 2]), layout, comm=half, dtype=np.float64,
                                device=Backend("gpu", half, array_module=DeviceModule(),
                                               local_rank=job_local))
        assert engine.backend.local_rank == job_local
        engine.close()
    finally:
        half.Free()


def test_engine_options_carry_a_command_s_device_rank():
    args = argparse.Namespace(device="auto", cuda_aware="auto", gpu_comm="auto",
                              compute_dtype=None, tf32=False, timeout=30.0)
    assert engine_options(args, "float32")["device_rank"] is None
    args.device_rank = 3                                   # serve sets it
    assert engine_options(args, "float32")["device_rank"] == 3
    engine = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF, device_rank=3)
    assert engine.backend.local_rank == 0                  # numpy: no GPU to pick
    engine.close()

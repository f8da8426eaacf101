"""Communicators of collected meshes are freed later, never by the finalizer itself
(comm/retired.py): the garbage collector may run a finalizer inside mpi4py's lock-table lock,
where MPI_Comm_free hangs for good.

    pytest tests/comm/test_retired.py
"""
import subprocess
import sys
import textwrap

from mpi4py import MPI

from mpishard.comm.alltoallv import PrivateComms
from mpishard.comm.mesh import DeviceMesh
from mpishard.comm.retired import free_retired

# A mesh whose communicator carries mpi4py's lock attribute (a lowercase collective ran on it)
# becomes cyclic garbage; then the garbage collector is set to run at the k-th allocation of a
# lowercase collective on a new communicator, for k past the point where mpi4py holds its
# lock-table lock (PyMPI_Lock allocating a Lock). Before comm/retired.py it hung within the
# first dozen k.
GC_INSIDE_MPI4PY = textwrap.dedent("""
    import gc
    from mpi4py import MPI
    from mpishard.comm.mesh import DeviceMesh
    for k in range(12):
        gc.disable()
        fresh = MPI.COMM_WORLD.Dup()
        gather = fresh.allgather
        gc.collect()                        # the mesh below is young: a gen-0 pass sees it
        mesh = DeviceMesh(MPI.COMM_WORLD, "dp=1")
        mesh.comm("dp").allgather(0)
        mesh.cycle = mesh
        del mesh
        gc.set_threshold(gc.get_count()[0] + k, 10, 10)
        gc.enable()
        gather(k)
        gc.disable()
        gc.set_threshold(700, 10, 10)
        fresh.Free()
    print("ok")
""")


def test_a_mesh_collected_inside_mpi4py_s_lock_does_not_hang():
    try:
        run = subprocess.run([sys.executable, "-c", GC_INSIDE_MPI4PY], capture_output=True,
                             text=True, timeout=60)
    except subprocess.TimeoutExpired:
        raise AssertionError("a mesh's finalizer hung inside mpi4py's commlock") from None
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]


def test_a_collected_mesh_s_communicators_are_freed_at_the_next_split():
    mesh = DeviceMesh(MPI.COMM_WORLD, "dp=1")
    comm = mesh.comm("dp")
    assert comm != MPI.COMM_NULL and comm is not MPI.COMM_WORLD
    del mesh                                  # no cycle: collected here, by reference count
    assert comm != MPI.COMM_NULL              # retired, not freed by the finalizer
    other = DeviceMesh(MPI.COMM_WORLD, "dp=1")
    other.comm("dp")                          # a Split frees what was retired first
    assert comm == MPI.COMM_NULL
    assert free_retired() == 0


def test_all_to_all_v_duplicates_are_retired_too():
    dups = PrivateComms()
    dup = dups.of(MPI.COMM_WORLD, MPI.Request.Wait)
    del dups
    assert dup != MPI.COMM_NULL
    assert free_retired() == 1 and dup == MPI.COMM_NULL

"""Communicator lifetimes: `engine.close()` (and `with make_engine(...) as engine:`) frees an
engine's communicators; an engine never closed hands them over to be freed later, never by the
finalizer itself (comm/retired.py): the garbage collector may run a finalizer inside mpi4py's
lock-table lock, where MPI_Comm_free hangs for good.

    pytest tests/comm/test_retired.py
"""
import gc
import subprocess
import textwrap

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import group_comm, run_mpi, run_python
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
        run = run_python(["-c", GC_INSIDE_MPI4PY], capture_output=True,
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


def test_close_frees_the_engine_s_communicators_and_later_calls_raise():
    engine = ms.make_engine(ms.MLP([2, 2]), "single")
    comms = list(engine.mesh._comms.values())
    assert comms and all(c != MPI.COMM_NULL for c in comms)
    engine.close()
    assert all(c == MPI.COMM_NULL for c in comms)
    for call in (lambda: engine.all_reduce(np.ones(2)), lambda: engine.barrier(),
                 lambda: engine.send_async(np.ones(2), dest=0)):
        with pytest.raises(ms.CommUnusable, match=r"closed \(engine.close\(\)\): build a new"):
            call()
    engine.close()                            # a second close does nothing


def test_the_context_manager_closes_the_engine_also_on_an_exception():
    with ms.make_engine(ms.MLP([2, 2]), "single") as engine:
        assert np.array_equal(engine.all_reduce(np.ones(2)), np.ones(2))
    assert engine.mesh.closed
    with pytest.raises(ZeroDivisionError):
        with ms.make_engine(ms.MLP([2, 2]), "single") as engine:
            comms = list(engine.mesh._comms.values())
            1 / 0
    with pytest.raises(ms.CommUnusable):      # refused, but its communicators are kept for
        engine.barrier()                      # good: perhaps this rank alone left (Comm.close)
    engine.close()
    assert engine.mesh.closed and all(c != MPI.COMM_NULL for c in comms)


def test_engines_built_and_closed_in_a_loop_do_not_exhaust_communicator_ids():
    """MPICH has about 2,000 communicator ids per process; every engine is kept alive (so no
    finalizer can free anything): only close() gives the ids back."""
    engines = []
    for _ in range(2200):
        engine = ms.make_engine(ms.MLP([2, 2]), "single", timeout=5)
        engine.all_reduce(np.ones(1))
        engine.close()
        engines.append(engine)
    assert free_retired() == 0


UNWAITED_SEND = """
import sys
import numpy as np
import mpishard as ms

engine = ms.make_engine(ms.MLP([2, 2]), "single")
pending = engine.receive_async(0)
engine.send_async(np.ones(4), dest=0)        # its Future is never waited for
assert np.array_equal(pending.result(), np.ones(4))
if sys.argv[1] == "close":
    engine.close()
print("exits", flush=True)
"""


@pytest.mark.parametrize("close", ["close", "no-close"])
def test_a_send_never_waited_for_leaves_no_pending_reference(tmp_path, close):
    """Defect 11: a 1-rank job whose send_async was never waited for ended with MPICH's
    `Builtin communicator ... has pending 2 references` (its header and data Isend, on the
    caller's COMM_WORLD). The engine's calls now run on communicators of its own, and close()
    completes the sends still in flight."""
    script = tmp_path / "unwaited_send.py"
    script.write_text(UNWAITED_SEND)
    proc = run_mpi(1, script, close, timeout=60)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "exits" in out, out[-3000:]
    assert "has pending" not in out, out[-3000:]


def _bases(engine, comm):
    """Every rank's arrival-counter block of `engine` (the same on all, or late ranks are
    misnamed: health/arrivals.py)."""
    return comm.allgather(engine.comm.watchdog.base)


@pytest.mark.mpi(min_size=2)
def test_a_rank_closing_alone_keeps_the_ranks_counter_blocks_aligned():
    """A rank's own timeout, or an exception leaving its `with` block, closes its engine on
    that rank alone: it must neither wait for peers (a send nobody receives) nor give its
    arrival block back, or the ranks' next engines count in different blocks and a timeout
    names the wrong late ranks (review of issue 31: the old close gave it back on a timeout)."""
    comm = group_comm(2)
    rank = comm.Get_rank()
    engine = ms.make_engine(ms.MLP([2, 2]), "dp=2", comm=comm, timeout=1.0,
                            report_errors=False)
    if rank == 0:                              # a receive rank 1 never sends: polled, caught
        with pytest.raises(ms.CollectiveTimeout):
            engine.receive(1)
    comm.Barrier()
    after_timeout = ms.make_engine(ms.MLP([2, 2]), "dp=2", comm=comm, timeout=1.0,
                                   report_errors=False)
    assert len(set(_bases(after_timeout, comm))) == 1, _bases(after_timeout, comm)
    kept = list(after_timeout.mesh._comms.values())
    t0 = MPI.Wtime()
    with pytest.raises(ZeroDivisionError):
        with after_timeout:
            if rank == 0:                      # 8 MiB: not sent eagerly, never received
                after_timeout.send_async(np.ones(1 << 20), dest=1)
                1 / 0
            raise ZeroDivisionError
    assert MPI.Wtime() - t0 < 0.9              # nothing waited for the 1 s timeout
    comm.Barrier()
    again = ms.make_engine(ms.MLP([2, 2]), "dp=2", comm=comm, timeout=1.0, report_errors=False)
    assert len(set(_bases(again, comm))) == 1, _bases(again, comm)
    again.close()
    # the 8 MiB message rank 1 never received stays on a communicator that is never freed,
    # not even once the engine is collected: freed, its context id could go to a later
    # communicator on rank 1, whose receive from its rank 0 would take this message instead
    # (seen: wrong fsdp+tp gradients at 8 ranks in the tests that ran after this one)
    del after_timeout
    gc.collect()
    free_retired()
    assert kept and all(c != MPI.COMM_NULL for c in kept)

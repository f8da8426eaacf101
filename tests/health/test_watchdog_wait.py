"""How a rank waits (health/watchdog.py): blocking collectives under the guard's deadline, polled
waits below MPI_THREAD_MULTIPLE, the late ranks read with one deadline for all of them, and an
engine that timed out refusing every later call.

    pytest tests/comm/test_watchdog_wait.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_watchdog_wait.py
"""
import os
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import run_mpi, world
from mpishard.health import arrivals
from mpishard.health.arrivals import Arrivals
from mpishard import CommUnusable
from mpishard.health.watchdog import Watchdog


def make(timeout=600.0):
    comm = world()
    return ms.make_engine(ms.MLP([2, 2]), f"dp={comm.Get_size()}", comm=comm, timeout=timeout)


@pytest.mark.mpi(min_size=1)
def test_blocking_collectives_run_under_the_guard_where_threads_may_call_mpi():
    """MPI_THREAD_MULTIPLE (mpi4py's default): the guard's thread is running and the
    collectives are the blocking calls; timeout=0 or a lower thread level: no guard."""
    with make() as e:
        guard = e.comm.watchdog.guard
        assert (guard is not None) == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
        if guard is not None:
            assert guard.thread.is_alive() and guard.period <= 600.0 / 4
        assert np.array_equal(e.all_reduce(np.ones(3), group="dp"), np.full(3, e.num_devices))
        if guard is not None:
            assert guard.in_flight is None             # cleared after the call
    with make(timeout=0) as e:
        assert e.comm.watchdog.guard is None
        assert np.array_equal(e.all_reduce(np.ones(3)), np.full(3, e.num_devices))


@pytest.mark.mpi(min_size=1)
def test_mpi_runs_at_the_thread_level_mpi4py_was_asked_for():
    """`make test-serialized` sets MPI4PY_RC_THREAD_LEVEL=serialized: that stage must run
    the polled waits (no guard thread), never MPI_THREAD_MULTIPLE unnoticed."""
    asked = os.environ.get("MPI4PY_RC_THREAD_LEVEL", "multiple")
    assert MPI.Query_thread() == getattr(MPI, f"THREAD_{asked.upper()}")
    with make() as e:
        assert (e.comm.watchdog.guard is None) == (asked != "multiple")


@pytest.mark.mpi(min_size=2)
def test_a_polled_timeout_names_the_late_rank_and_the_engine_then_refuses_every_call():
    """The last rank never enters an all_reduce_async: the others' wait (polled in every
    thread mode) raises CollectiveTimeout naming it; afterwards every call on that engine
    raises CommUnusable, saying it timed out and must be rebuilt."""
    e = make(timeout=1.0)
    comm = e.mesh.comm("dp")
    last = comm.Get_size() - 1
    ranks = e.comm.watchdog.group(comm)[1]
    if comm.Get_rank() != last:
        fut = e.all_reduce_async(np.ones(4), group="dp")
        with pytest.raises(ms.CollectiveTimeout) as caught:
            fut.result()
        assert re.match(rf"all_reduce_async on group \w+ \(ranks {re.escape(str(ranks))}\) "
                        rf"timed out after 1 s on rank {ranks[comm.Get_rank()]}: "
                        rf"late ranks: \[{ranks[last]}\] ", str(caught.value)), caught.value
        for call in (lambda: e.all_reduce(np.ones(2)), lambda: e.barrier(),
                     lambda: e.all_gather(np.ones(2)), lambda: e.all_reduce_async(np.ones(2))):
            with pytest.raises(CommUnusable, match="timed out earlier .* build a new engine"):
                call()
    world().Barrier()
    e.close()


class _Request:
    """An Rget that completes (writing `value`) or never does (`value` None)."""

    def __init__(self, buf, value):
        self.buf, self.value = buf, value

    def Test(self):
        if self.value is None:
            return False
        self.buf[0] = self.value
        return True


class _Window:
    """A window whose reads of `silent` ranks never complete; the others read `counts`."""

    def __init__(self, counts, silent):
        self.counts, self.silent = counts, silent

    def Sync(self):
        pass

    def Rget(self, buf, rank, target=None):
        return _Request(buf, None if rank in self.silent else self.counts[rank])


def test_late_ranks_are_read_with_one_deadline_for_all(monkeypatch):
    """Defect 8: a report used to wait READ_TIMEOUT for each rank that does not answer, one
    after the other (group size x 1 s on a TCP job); now all reads share one deadline."""
    deadline = 0.5                       # one per silent rank, as before the fix: 2 s
    monkeypatch.setattr(arrivals, "READ_TIMEOUT", deadline)
    window = Arrivals.__new__(Arrivals)
    window.win = _Window({1: 5, 2: 4, 3: 5, 4: 4}, silent={5, 6, 7, 8})
    wd = Watchdog.__new__(Watchdog)
    wd.arrivals, wd.mesh = window, type("Mesh", (), {"rank": 0})()
    comm = type("Comm", (), {"py2f": lambda self: 7})()
    wd.groups = {7: (3, list(range(9)), "dp")}
    t0 = time.monotonic()
    text = wd.late(comm, (3, 5))
    took = time.monotonic() - t0
    print(f"late ranks read in {took:.2f} s, {len(window.win.silent)} silent, deadline "
          f"{deadline} s: {text}")
    assert text == "[2, 4] (not yet in this collective); ranks [5, 6, 7, 8] did not answer"
    assert deadline <= took < 3 * deadline         # room for a stalled test process


SERIALIZED_TIMEOUT = """
import os, sys, time
import numpy as np
from mpi4py import MPI
import mpishard as ms
from mpishard import CommUnusable

assert MPI.Query_thread() == MPI.THREAD_SERIALIZED, MPI.Query_thread()
comm = MPI.COMM_WORLD
rank, late, caught = comm.Get_rank(), sys.argv[1] == "late", sys.argv[2]
engine = ms.make_engine(ms.MLP([2, 2]), "dp=2", comm=comm, timeout=1.0)
assert engine.comm.watchdog.guard is None
engine.all_reduce(np.ones(3))
if rank == 0:
    try:
        engine.all_reduce(np.ones(3))
    except ms.CollectiveTimeout as exc:
        print("rank 0 caught:", exc, flush=True)
    open(caught, "w").close()        # rank 1 may come now: past rank 0's timeout
    try:
        engine.barrier()
    except ms.CommUnusable as exc:
        print("rank 0 then:", exc, flush=True)
else:
    deadline = time.monotonic() + 45
    while not os.path.exists(caught):    # past rank 0's timeout, however slow the machine
        assert time.monotonic() < deadline, "rank 0 never timed out"
        time.sleep(0.01)
    if late:                         # meets rank 0's abandoned all_reduce
        print("rank 1 late:", engine.all_reduce(np.ones(3)), flush=True)
print(f"rank {rank} exits", flush=True)
"""


@pytest.mark.parametrize("peer", ["never", "late"])
def test_a_caught_polled_timeout_ends_the_job_cleanly(tmp_path, peer):
    """Defect 9: below MPI_THREAD_MULTIPLE (no guard thread) a timeout is raised where the
    wait polls; caught, the engine refuses later calls, and the job still exits 0 without
    MPICH's "pending references" (before: a hang at exit, or rc != 0), whether the late rank
    never comes or comes after the timeout (its all_reduce completes against the abandoned
    request while rank 0 exits)."""
    script = tmp_path / "serialized_timeout.py"
    script.write_text(SERIALIZED_TIMEOUT)
    proc = run_mpi(2, script, peer, tmp_path / "caught", timeout=60,
                   env={"MPI4PY_RC_THREAD_LEVEL": "serialized"})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "rank 0 caught: all_reduce on group world (ranks [0, 1]) timed out" in out, out
    assert "late ranks: [1]" in out
    assert "rank 0 then: this engine timed out earlier (all_reduce on group world)" in out
    assert "rank 0 exits" in out and "rank 1 exits" in out
    assert ("rank 1 late: [2. 2. 2.]" in out) == (peer == "late")
    assert "has pending" not in out, out[-3000:]     # MPICH: "... has pending N references"


def test_the_guard_still_fires_when_naming_the_late_ranks_fails():
    """Building the timeout's message makes MPI calls (the peers' counters); if that raises,
    the guard thread must still report and abort, not die and leave every later blocking
    call unbounded (review of issue 31: the exception ended the daemon thread silently)."""
    from mpishard.health.guard import Guard

    guard = Guard()                          # a guard of its own, not the process's
    fired = []
    guard.fire = lambda message: (fired.append(message), setattr(guard, "fired", True))
    guard.period = 0.01

    def describe():
        raise RuntimeError("window freed")
    guard.in_flight = (time.monotonic_ns() - 10**9, 10**8, describe, ())
    guard.thread.join(timeout=5)
    assert fired and "timed out after 0.1 s" in fired[0] and "window freed" in fired[0], fired

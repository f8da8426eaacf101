"""How a waiting rank waits (comm/watchdog.py): `oversubscribed` tells, the same on every rank
of a node, whether the node has more ranks than CPUs; `everyone_in` sees a member that has not
entered the collective yet (the wait then sleeps instead of yielding) and sees it arrive.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_watchdog_wait.py
"""
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import world
from mpishard.comm.threads import oversubscribed
from mpishard.comm.watchdog import FAST, LEARN, YIELD, CollectiveTimeout


def make(timeout=600.0):
    comm = world()
    return ms.make_engine(ms.MLP([2, 2]), f"dp={comm.Get_size()}", comm=comm, timeout=timeout)


def gated(timeout=600.0):
    """(engine, its watchdog, the dp group); skips where there is no gate."""
    e = make(timeout)
    if not e.comm.watchdog.gated:
        pytest.skip("the gate is for oversubscribed nodes (more ranks than CPUs)")
    return e, e.comm.watchdog, e.mesh.comm("dp")


@pytest.mark.mpi(min_size=1)
def test_oversubscribed_counts_the_node_s_ranks_against_its_cpus():
    comm = world()
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    sets = {frozenset(s) for s in node.allgather(os.sched_getaffinity(0))}
    want = node.Get_size() > len(next(iter(sets))) if len(sets) == 1 else None
    node.Free()
    got = oversubscribed(comm)
    assert comm.allgather(got) == [got] * comm.Get_size()
    if want is not None:            # every rank on the same CPUs: the simple count
        assert got == want


@pytest.mark.mpi(min_size=1)
def test_the_fast_phase_is_short_only_when_oversubscribed():
    e = make()
    assert e.comm.watchdog.fast == (FAST if oversubscribed(world()) else YIELD)
    assert make(timeout=0).comm.watchdog.fast == YIELD


@pytest.mark.mpi(min_size=2)
def test_everyone_in_sees_a_missing_member_then_its_arrival():
    e = make()
    wd, comm = e.comm.watchdog, e.mesh.comm("dp")
    last = comm.Get_size() - 1
    seen = None
    if comm.Get_rank() != last:
        ticket = wd.arrive(comm)
        comm.Barrier()                          # every rank but the last has arrived
        seen = wd.everyone_in(comm, ticket)
        comm.Barrier()                          # the last one arrives
        comm.Barrier()
        deadline = time.monotonic() + 30
        while not wd.everyone_in(comm, ticket):   # a passive read: eventually visible
            assert time.monotonic() < deadline
            time.sleep(1e-3)
    else:
        comm.Barrier()
        comm.Barrier()
        ticket = wd.arrive(comm)
        comm.Barrier()
        assert wd.everyone_in(comm, ticket)
    assert seen in (None, False)
    e.barrier()                                 # the engine's collectives still line up


@pytest.mark.mpi(min_size=1)
def test_blocking_collectives_run_under_the_guard_where_threads_may_call_mpi():
    """MPI_THREAD_MULTIPLE (mpi4py's default): the guard's thread is running and the
    collectives are the blocking calls; timeout=0: no guard."""
    e = make()
    guard = e.comm.watchdog.guard
    assert (guard is not None) == (MPI.Query_thread() == MPI.THREAD_MULTIPLE)
    if guard is not None:
        assert guard.thread.is_alive() and guard.period <= 600.0 / 4
        e.all_reduce(np.ones(3), group="dp")
        assert guard.watched is None                # cleared after the call
    assert make(timeout=0).comm.watchdog.guard is None


@pytest.mark.mpi(min_size=2)
def test_the_gate_learns_a_late_member_and_forgets_it_when_everyone_comes_together():
    """On an oversubscribed node: after an all_reduce the last rank enters 50 ms late, every
    other rank has learnt the group is `lagging` (it will wait at the gate, sleeping); after
    calls where everyone comes together the flag goes off again."""
    e, wd, comm = gated()
    index, last = wd.group(comm)[0], comm.Get_size() - 1
    x = np.ones(4)
    for call in range(2 * LEARN):           # the calls after the LEARN-th: at the gate
        comm.Barrier()
        if comm.Get_rank() == last:
            time.sleep(0.05)
        assert np.array_equal(e.all_reduce(x, group="dp"), x * comm.Get_size())
        learnt = comm.allgather(bool(wd.lagging.get(index)))
        if call + 1 >= LEARN:
            assert learnt[:last] == [True] * last, (call, learnt)
    for _ in range(200):                            # punctual calls: the flag goes off
        comm.Barrier()
        e.all_reduce(x, group="dp")
        if not any(comm.allgather(bool(wd.lagging.get(index)))):
            break
    assert not wd.lagging.get(index)


@pytest.mark.mpi(min_size=2)
def test_a_rank_that_is_always_last_unlearns_lagging():
    """The last rank to arrive never meets the gate (nobody is missing): finding everyone in
    before it turns its `lagging` flag off (else it would stay on for good; seen on Open MPI,
    whose barrier released the same rank last call after call)."""
    e, wd, comm = gated()
    index, last = wd.group(comm)[0], comm.Get_size() - 1
    x = np.ones(4)
    e.all_reduce(x, group="dp")                     # the group's slot exists everywhere
    peers, cells = wd.slots[comm.py2f()][1], wd.arrivals.cells
    if comm.Get_rank() == last:
        wd.lagging[index] = True
    for _ in range(LEARN):
        comm.Barrier()
        if comm.Get_rank() == last:                 # wait until the others are all in
            deadline = time.monotonic() + 30
            while any(view[index] <= cells[index] for view in peers):
                assert time.monotonic() < deadline
                time.sleep(1e-3)
        e.all_reduce(x, group="dp")
    if comm.Get_rank() == last:
        assert not wd.lagging.get(index)


@pytest.mark.mpi(min_size=2)
def test_a_lagging_group_times_out_at_the_gate_with_an_error_that_can_be_caught():
    """A group marked lagging waits at the gate, outside MPI: when the last member never
    comes, the others raise CollectiveTimeout naming it (no MPI call is left pending)."""
    e, wd, comm = gated(timeout=1.0)
    index, ranks = wd.group(comm)[:2]
    last = comm.Get_size() - 1
    wd.lagging[index] = True
    if comm.Get_rank() != last:
        with pytest.raises(CollectiveTimeout, match=rf"late ranks: \[{ranks[last]}\]"):
            e.all_reduce(np.ones(4), group="dp")
        wd.arrivals.broken = False          # the test goes on: the window is freed as usual
    comm.Barrier()

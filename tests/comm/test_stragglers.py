"""The straggler line (comm/stragglers.py): the rule on hand-made waits, and on real
collectives where one rank sleeps before each (any world size of 2 or more; serial: skipped)."""
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.comm.flight import FlightRecorder
from mpishard.comm.stragglers import report, straggler

WORLD = MPI.COMM_WORLD


def rows(waits_of, calls=10, ranks=(0, 1)):
    """Every rank's rows for `calls` world all_reduces; waits_of(rank, i) gives the waits."""
    return [(r, [["world", list(ranks), i + 1, waits_of(r, i)] for i in range(calls)])
            for r in ranks]


def test_the_rule():
    slow = rows(lambda r, i: 0.0 if r == 1 else 0.040 + 0.001 * i)
    assert straggler(slow) == "rank 1 arrived last in 100% of collectives (10 of 10), " \
                              "median +44 ms"
    assert straggler(rows(lambda r, i: 0.0 if r == i % 2 else 0.04)) is None     # balanced
    assert straggler(rows(lambda r, i: 0.0 if r == 1 else 2e-4)) is None          # too close
    assert straggler(rows(lambda r, i: 0.0 if r == 1 else 0.04, calls=7)) is None  # too few
    mostly = rows(lambda r, i: 0.0 if r == (1 if i < 8 else 0) else 0.02)         # 8 of 10
    assert straggler(mostly) == "rank 1 arrived last in 80% of collectives (8 of 10), " \
                                "median +20 ms"
    partial = slow[:1] + [(1, slow[1][1][:5])]     # rank 1's ring lost half: those left out
    assert straggler(partial) is None


@pytest.mark.skipif(WORLD.Get_size() < 2, reason="needs 2 ranks or more")
@pytest.mark.parametrize("who", ["last", "alternate"])
def test_a_rank_that_sleeps_before_each_collective_is_named(who):
    model = ms.MLP([4, 8, 2])
    with ms.make_engine(model, f"dp={WORLD.Get_size()}", comm=WORLD) as engine:
        engine.load_checkpoint(model.init(seed=0))
        engine.comm.flight = recorder = FlightRecorder()
        since, rank, n = time.time(), WORLD.Get_rank(), WORLD.Get_size()
        for i in range(12):
            if rank == (n - 1 if who == "last" else i % n):
                time.sleep(0.02)
            engine.comm.all_reduce(np.ones(3))
        line = report(engine.comm, recorder, since)
    if rank != 0 or who == "alternate":
        assert line is None
    else:
        assert line.startswith(f"rank {n - 1} arrived last in 100% of collectives (12 of 12), "
                               "median +"), line

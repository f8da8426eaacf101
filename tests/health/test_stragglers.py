"""The straggler line (health/stragglers.py): the rule on hand-made waits, and on real
collectives where one rank sleeps before each (marked mpi: 2 ranks or more), and in `train`
(serial: it launches 2- and 4-rank jobs): a healthy pipeline prints none, a slow rank among the
peers of its stage still stands out."""
import re
import time

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.health.flight import FlightRecorder
from mpishard.health.stragglers import report, straggler, waits

WORLD = MPI.COMM_WORLD


def rows(waits_of, calls=10, ranks=(0, 1)):
    """Every rank's rows for `calls` world all_reduces; waits_of(rank, i) gives the waits."""
    return [(r, [["world", list(ranks), i + 1, waits_of(r, i)] for i in range(calls)])
            for r in ranks]


def test_the_rule():
    slow = rows(lambda r, i: 0.0 if r == 1 else 0.040 + 0.001 * i)
    assert straggler(slow) == "rank 1 arrived last in 100% of collectives (10 of 10 with a " \
                              "late rank), median +44 ms"
    assert straggler(rows(lambda r, i: 0.0 if r == i % 2 else 0.04)) is None     # balanced
    assert straggler(rows(lambda r, i: 0.0 if r == 1 else 2e-4)) is None          # too close
    assert straggler(rows(lambda r, i: 0.0 if r == 1 else 0.04, calls=7)) is None  # too few
    mostly = rows(lambda r, i: 0.0 if r == (1 if i < 8 else 0) else 0.02)         # 8 of 10
    assert straggler(mostly) == "rank 1 arrived last in 80% of collectives (8 of 10 with a " \
                                "late rank), median +20 ms"
    # a slow loss: late to the gradient all_reduce, with the loss's all_reduce right after it
    # (arriving together): those do not count
    pairs = rows(lambda r, i: (0.0 if r == 1 else 0.02) if i % 2 == 0 else 1e-5 * (r + i % 4),
                 calls=16)
    assert straggler(pairs) == "rank 1 arrived last in 100% of collectives (8 of 8 with a " \
                               "late rank), median +20 ms"
    partial = slow[:1] + [(1, slow[1][1][:5])]     # rank 1's ring lost half: those left out
    assert straggler(partial) is None


def test_only_groups_inside_one_pipeline_stage_are_compared():
    """On a group across stages the first stage arrives last by the schedule: left out. A
    wait there, or on a send or receive, counts into the next compared collective's wait."""
    recorder = FlightRecorder(rank=0)
    recorder.table = [{"name": n, "ranks": [0, 1]} for n in ("world", "pp", "dp+pp", "dp", "tp")]
    events = [("all_reduce", 3, None, 10.0, 10.5, 0.0), ("all_reduce", 0, None, 11, 11.25, 0.0),
              ("receive", 1, 1, 11.5, 11.5, 0.0), ("all_reduce", 2, None, 12, 12.125, 0.0625),
              ("all_reduce", 4, None, 13.0, 13.5, 0.5)]
    for i, (op, g, peer, enter, out, peer_wait) in enumerate(events):
        recorder.ring[i] = [op, g, 1, peer, 8, None, None, enter, out, 1, None, peer_wait]
    recorder.count = len(events)
    assert waits(recorder, 0.0, ("dp", "pp")) == [["dp", [0, 1], 1, 0.5],
                                                  ["tp", [0, 1], 1, 0.5 + 0.25 + 0.125 + 0.5]]
    assert [w[0] for w in waits(recorder, 0.0, ("dp",))] == ["dp", "world", "tp"]


@pytest.mark.mpi(min_size=2)
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
    else:               # the margin: the 20 ms sleep less what an oversubscribed core takes
        found = re.fullmatch(rf"rank {n - 1} arrived last in \d+% of collectives \(\d+ of \d+ "
                             r"with a late rank\), median \+(\d+) ms", line)
        assert found and int(found[1]) >= 15, line


SLOW_LOSS = '''
import sys, time
from mpi4py import MPI
import mpishard as ms
from mpishard.cli import exit_cleanly, main

if sys.argv[1] == "slow":
    def slow_on_the_last_rank(self, y, t, call=ms.losses.MSE.__call__):
        if MPI.COMM_WORLD.Get_rank() == MPI.COMM_WORLD.Get_size() - 1:
            time.sleep(0.02)
        return call(self, y, t)
    ms.losses.MSE.__call__ = slow_on_the_last_rank
exit_cleanly(main(["train", "--dataset", "synthetic-regression", "--steps", sys.argv[4],
                   "--log-every", "12", "--no-progress", "--flight-dir", sys.argv[2],
                   "--layout", sys.argv[3]]))
'''


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="launches its own 2-rank jobs")
@pytest.mark.parametrize("mode, layout", [("slow", "dp=2"), ("even", "dp=2"), ("even", "pp=2")])
def test_train_logs_the_straggler_line_only_when_a_rank_stands_out(tmp_path, mode, layout):
    """pp=2: the first stage reaches every world collective last, by the schedule, which is
    no straggler: no line. dp=2: the slow last rank is named. (A slow rank under dp=2,pp=2 is
    compared with its stage's dp peers, test_only_groups_inside_one_pipeline_stage_are_compared;
    end to end on oversubscribed cores its share of late arrivals sits at the rule's 75%
    threshold, so a run there names it in some windows and in none in others.)"""
    from conftest import run_mpi

    n = 2
    script = tmp_path / "train.py"
    script.write_text(SLOW_LOSS)
    proc = run_mpi(n, script, mode, tmp_path / "flight", layout, 48, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-2000:]
    lines = [ln for ln in out.splitlines() if "arrived last in" in ln]
    if mode == "slow":
        # each microbatch's loss sleeps 20 ms: the margin is that less what a busy core takes
        line = (rf"rank {n - 1} arrived last in \d+% of collectives \(\d+ of \d+ with a late "
                r"rank\), median \+(\d+) ms")
        margins = [re.search(line, ln) for ln in lines]
        named = [m for m in margins if m and int(m[1]) >= 15]
        # a window whose noise collectives fall the other way may stay under the rule's
        # share: of the 4 windows of 12 steps, at least one names it
        assert named and len(named) == len(lines) <= 4, lines
    else:           # no rank stands out; a loaded host's noise may name one by a few ms
        line = (r"arrived last in \d+% of collectives \(\d+ of \d+ with a late rank\), "
                r"median \+(\d+) ms")
        assert all(m and int(m[1]) < 15 for m in (re.search(line, ln) for ln in lines)), lines

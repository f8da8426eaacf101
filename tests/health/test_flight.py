"""The flight recorder (health/flight.py) and its reader (cli/flight.py).

Recording runs at any world size (the tests marked mpi, under mpiexec -n 1, 2, 4): every
rank's events name the op, the group, its sequence number, the array, the step, and a receive
is one event; the ring keeps the last N. Dumps write the ring and the stacks; SIGUSR2 dumps.
The reader's verdicts on hand-made dumps (serial) cover what the fault-injection jobs
(tests/hpc/test_flight_faults.py) cannot make deterministic: two ranks calling different ops,
and a rank that dumped but never entered. A fatal signal's stacks (serial: its own process).
"""
import json
import os
import signal

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.cli.flight import verdict
from mpishard.health.flight import FlightRecorder

WORLD = MPI.COMM_WORLD


@pytest.fixture
def engine():
    model = ms.MLP([4, 8, 2])
    eng = ms.make_engine(model, f"dp={WORLD.Get_size()}", comm=WORLD)
    eng.load_checkpoint(model.init(seed=0))
    eng.comm.flight = FlightRecorder(size=8)
    yield eng
    eng.close()


@pytest.mark.mpi(min_size=1)
def test_events_name_the_op_group_sequence_and_array(engine):
    comm, rank, n = engine.comm, WORLD.Get_rank(), WORLD.Get_size()
    comm.context(step=7, microbatch=1)
    comm.all_reduce(np.ones((2, 3)))
    comm.barrier()
    comm.broadcast(np.arange(5, dtype=np.int32) if rank == 0 else None, root=0)
    if n > 1:
        fut = comm.send_async(np.zeros(4), dest=(rank + 1) % n)
        comm.receive((rank - 1) % n)
        fut.result()
    events = comm.flight.events()
    ops = [e["op"] for e in events]
    assert ops == ["all_reduce", "barrier", "broadcast"] + (["send_async", "receive"] if n > 1
                                                           else [])
    assert [e["seq"] for e in events[:3]] == [1, 2, 3]
    assert events[0]["bytes"] == 48 and events[0]["dtype"] == "float64"
    assert events[0]["shape"] == [2, 3]
    assert events[2]["dtype"] == ("int32" if rank == 0 else None)
    assert all(e["step"] == 7 and e["microbatch"] == 1 and e["exit"] >= e["enter"]
               for e in events)
    assert comm.flight.table[events[0]["group"]] == {"name": "world", "ranks": list(range(n))}
    if n > 1:
        assert events[3]["peer"] == (rank + 1) % n and events[4]["peer"] == (rank - 1) % n
        assert events[3]["seq"] == events[4]["seq"] == 1        # per peer and direction


@pytest.mark.mpi(min_size=1)
def test_the_ring_keeps_the_last_events(engine):
    comm = engine.comm
    for _ in range(11):
        comm.barrier()
    events = comm.flight.events()
    assert [e["seq"] for e in events] == list(range(4, 12))
    assert comm.flight.count == 11


@pytest.mark.mpi(min_size=1)
def test_dump_writes_ring_and_stacks_once_and_on_sigusr2(engine, tmp_path):
    rec = engine.comm.flight
    engine.comm.barrier()
    assert rec.dump("nowhere to go") is None                  # no directory yet
    rec.redirect(tmp_path / str(WORLD.Get_rank()))
    path = rec.dump("first")
    data = json.load(open(path))
    assert data["reason"] == "first" and data["events"][0]["op"] == "barrier"
    assert data["rank"] == WORLD.Get_rank() and data["groups"][0]["name"] == "world"
    stacks = open(path.replace(".json", ".stacks.txt")).read()
    assert "first" in stacks and "test_flight.py" in stacks
    assert rec.dump("second") is None                       # the first reason is kept
    os.kill(os.getpid(), signal.SIGUSR2)
    assert json.load(open(path))["reason"] == "SIGUSR2"
    rec.close_fatal()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


@pytest.mark.mpi(min_size=1)
def test_a_sigusr2_look_does_not_stop_the_failure_dump(engine, tmp_path):
    rec = engine.comm.flight
    rec.redirect(tmp_path / str(WORLD.Get_rank()))
    engine.comm.barrier()
    os.kill(os.getpid(), signal.SIGUSR2)                    # a look at a live rank
    path = os.path.join(rec.directory, f"flight-rank{WORLD.Get_rank()}.json")
    assert json.load(open(path))["reason"] == "SIGUSR2"
    assert rec.dump("CollectiveTimeout: later") == path     # the failure still dumps
    assert json.load(open(path))["reason"] == "CollectiveTimeout: later"
    assert rec.dump("third") is None
    rec.close_fatal()
    signal.signal(signal.SIGUSR2, signal.SIG_DFL)


def dump(rank, events, size=2, reason="CollectiveTimeout: late ranks: [1]", at=100.0,
         late=(1,), entered=()):
    """A hand-made dump: events (op, seq, exit or None) on the world group of `size` ranks;
    the arrival counters its timeout read (`late`, `entered`) when the reason is a timeout."""
    arrivals = {"group": "world", "ranks": list(range(size)), "late": list(late),
                "entered": list(entered), "silent": []}
    return {"rank": rank, "world_size": size, "reason": reason, "time": at,
            "arrivals": arrivals if reason.startswith("CollectiveTimeout") else None,
            "groups": [{"name": "world", "ranks": list(range(size))}],
            "events": [{"op": op, "group": 0, "seq": seq, "peer": None, "bytes": 24,
                        "dtype": "float64" if op == "all_reduce" else None,
                        "shape": [3] if op == "all_reduce" else None, "enter": 10.0 + seq,
                        "exit": out, "step": 5, "microbatch": None}
                       for op, seq, out in events]}


def test_the_reader_names_a_different_op_and_a_rank_that_never_entered():
    tie = verdict({0: dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, None)]),
                   1: dump(1, [("barrier", 1, 11.5), ("broadcast", 2, None)])}, 2)
    assert ("verdict: the ranks disagree at #2 on group world: rank 0 called all_reduce "
            "(float64 (3,), step 5); rank 1 called broadcast (step 5)") in tie
    behind = verdict({0: dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, None)]),
                      1: dump(1, [("barrier", 1, 11.5)])}, 2)
    assert ("rank 1: never entered it: outside communication for 88.50 s, since barrier #1 "
            "(step 5) on group world [0, 1] (see flight-rank1.stacks.txt)") in behind
    assert ("verdict: rank 1 never entered all_reduce #2 (float64 (3,), step 5) on group "
            "world; rank 0 waited in it (the timeout's arrival counters: late ranks [1])") in behind
    agree = verdict({0: dump(0, [("barrier", 1, 11.5)]), 1: dump(1, [("barrier", 1, 11.5)])}, 2)
    assert "verdict: the dumped ranks' collectives agree everywhere" in agree


def test_a_rank_stopped_inside_a_call_is_not_said_to_have_never_entered_it():
    """Rank 1 was stopped (kill -STOP) inside all_reduce #2: it left no dump, and rank 0's
    timeout found its counter in the call ('late ranks: none: ...'). The reader says so and
    does not blame rank 1 for never entering it, which the timeout line contradicts."""
    timed_out = "CollectiveTimeout: ... late ranks: none: every other member ([1]) entered"
    text = verdict({0: dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, None)],
                            reason=timed_out, late=(), entered=(1,))}, 2)
    print(text)
    assert "never entered" not in text
    assert ("  rank 1: no dump: entered it and never left: stopped or hung inside it (the "
            "arrival counters of the ranks waiting in it)") in text
    assert text.endswith("verdict: rank 1 entered all_reduce #2 (float64 (3,), step 5) on group "
                         "world and never left it (no dump: stopped or hung inside it); rank 0 "
                         "waited in it (the timeout's arrival counters: every member entered it)")
    late = verdict({0: dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, None)])}, 2)
    assert "  rank 1: no dump: never entered it (the arrival counters" in late
    assert "verdict: rank 1 never entered all_reduce #2" in late
    silent = dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, None)], late=())
    silent["arrivals"]["silent"] = [1]         # its counter could not be read: 'unknown: ...'
    text = verdict({0: silent}, 2)
    assert "never entered" not in text and "  rank 1: no dump: killed before it could write " \
        "one; its arrival counter did not answer" in text
    assert text.endswith("verdict: rank 1 left no dump, and no arrival counter says whether it "
                         "entered all_reduce #2 (float64 (3,), step 5) on group world; rank 0 "
                         "waited in it"), text


def test_a_sigusr2_snapshot_of_a_healthy_job_is_a_snapshot():
    """Each rank dumps on SIGUSR2 at its own moment: rank 1 one call behind rank 0 is no
    fault. Different collectives at one point are still named."""
    text = verdict({0: dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, None)], reason="SIGUSR2"),
                    1: dump(1, [("barrier", 1, 11.5)], reason="SIGUSR2")}, 2)
    print(text)
    assert "never entered" not in text and "divergence" not in text
    assert text.splitlines()[-1].startswith("verdict: a snapshot (SIGUSR2) of a running job, "
                                            "not a failure")
    odd = verdict({0: dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, None)], reason="SIGUSR2"),
                   1: dump(1, [("barrier", 1, 11.5), ("broadcast", 2, None)], reason="SIGUSR2")},
                  2)
    assert odd.endswith("; but at #2 on group world (ranks [0, 1]) the ranks called different "
                        "collectives"), odd


def test_a_rank_whose_ring_wrapped_past_a_group_is_not_blamed_for_it():
    """Rank 1's ring dropped its world calls (overwritten by its sends); both ranks wait in a
    receive. Before, rank 1 'never entered all_reduce #2': a false verdict."""
    ring0 = dump(0, [("barrier", 1, 11.5), ("all_reduce", 2, 12.5)])
    ring1 = dump(1, [])
    ring1["dropped"] = 300
    ring1["events"] = [{"op": "send", "group": 0, "seq": k, "peer": 0, "bytes": 24,
                        "dtype": "float64", "shape": [3], "enter": 20.0 + k, "exit": 20.5 + k,
                        "step": 6, "microbatch": None} for k in range(1, 4)]
    text = verdict({0: ring0, 1: ring1}, 2)
    assert "verdict: the dumped ranks' collectives agree everywhere" in text, text
    assert "never entered" not in text
    ring1["dropped"] = 0              # a ring that never wrapped: rank 1 did skip them
    assert "verdict: rank 1 never entered barrier #1" in verdict({0: ring0, 1: ring1}, 2)


FATAL = '''
import faulthandler, sys
from mpishard.health.flight import FlightRecorder
rec = FlightRecorder()
rec.redirect(sys.argv[1])
faulthandler._sigsegv()
'''


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own process")
def test_a_fatal_signal_writes_the_stacks_to_the_flight_dir(tmp_path):
    import subprocess
    import sys

    import leftovers

    before = leftovers.mpi_files()
    proc = subprocess.run([sys.executable, "-c", FATAL, str(tmp_path)], capture_output=True,
                          text=True, timeout=60)
    for path in leftovers.left_since(before):    # the crashed singleton's MPI segment
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    assert proc.returncode != 0
    text = (tmp_path / "flight-rank0.fatal.txt").read_text()
    assert "Segmentation fault" in text and "<string>" in text, text


CLEAN = '''
import sys
from mpishard.health.flight import FlightRecorder
FlightRecorder().redirect(sys.argv[1])
FlightRecorder().redirect(sys.argv[2])
'''


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="starts its own process")
def test_a_clean_exit_leaves_no_empty_directory_it_made(tmp_path):
    import subprocess
    import sys

    kept = tmp_path / "kept"
    kept.mkdir()
    import leftovers

    before = leftovers.mpi_files()
    proc = subprocess.run([sys.executable, "-c", CLEAN, str(tmp_path / "made"), str(kept)],
                          capture_output=True, text=True, timeout=60)
    for path in leftovers.left_since(before):    # Open MPI: a singleton keeps its segment
        if os.path.basename(path).startswith("sm_segment."):
            os.unlink(path)
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["kept"]         # made's gone, the user's stays
    assert os.listdir(kept) == []                          # no empty fatal file either


@pytest.mark.skipif(WORLD.Get_size() > 1, reason="serial: two recorders stand for two ranks")
@pytest.mark.parametrize("first", [0, 1])
def test_a_clean_exit_of_every_rank_leaves_no_directory_whichever_exits_last(tmp_path, first):
    """Rank 0 makes DIR and rank 1 finds it there; then they exit in either order. Rank 1's
    fatal file is still open when rank 0 exits first: the directory goes with the last rank
    out, though that rank did not make it. One the user made stays."""
    for directory in (tmp_path / "made", tmp_path / "kept"):
        if directory.name == "kept":
            directory.mkdir()
        ranks = [FlightRecorder(rank=0), FlightRecorder(rank=1)]
        for rec in ranks:
            rec.redirect(directory)
        ranks[first].clean_exit()
        assert directory.is_dir()                     # the other rank's fatal file is open
        ranks[1 - first].clean_exit()
    assert sorted(os.listdir(tmp_path)) == ["kept"] and os.listdir(tmp_path / "kept") == []


def test_a_rank_that_only_relays_a_wait_is_not_the_verdict():
    """dp=2,tp=2 with rank 3 asleep in step 3 (test_flight_faults' case, as one failing run
    had it): rank 1 waits for rank 3 in step 3's dp all_reduce; rank 0, a step ahead, waits for
    rank 1 in step 4's tp all_reduce and entered it first. The verdict follows rank 1's wait to
    rank 3 instead of blaming rank 1."""
    groups = [{"name": "tp", "ranks": [0, 1]}, {"name": "tp", "ranks": [2, 3]},
              {"name": "dp", "ranks": [0, 2]}, {"name": "dp", "ranks": [1, 3]}]

    def events(calls):
        return [{"op": "all_reduce", "group": g, "seq": seq, "peer": None, "bytes": 8,
                 "dtype": "float64", "shape": [4, 4] if g < 2 else [108], "enter": at,
                 "exit": None if last else at + 0.1, "step": step, "microbatch": None}
                for g, seq, step, at, last in calls]

    def rank(r, calls, group, late):
        return {"rank": r, "world_size": 4, "reason": "CollectiveTimeout: ...", "time": 30.0,
                "arrivals": {"group": group["name"], "ranks": group["ranks"], "late": late,
                             "entered": [], "silent": []},
                "groups": groups, "events": events(calls)}
    dumps = {
        0: rank(0, [(0, s, s, 10.0 + s, s == 4) for s in (1, 2, 3, 4)]
                + [(2, s, s, 10.5 + s, False) for s in (1, 2, 3)], groups[0], [1]),
        1: rank(1, [(0, s, s, 10.0 + s, False) for s in (1, 2, 3)]
                + [(3, s, s, 10.5 + s, s == 3) for s in (1, 2, 3)], groups[3], [3]),
        2: rank(2, [(1, s, s, 10.0 + s, s == 4) for s in (1, 2, 3, 4)]
                + [(2, s, s, 10.5 + s, False) for s in (1, 2, 3)], groups[1], [3])}
    dumps[1]["events"][-1]["enter"] = 14.5          # rank 1 entered after rank 0's step-4 call
    text = verdict(dumps, 4)
    print(text)
    assert text.splitlines()[-1].startswith(
        "verdict: rank 3 never entered all_reduce #3 (float64 (108,), step 3) on group dp; "
        "rank 1 waited in it"), text

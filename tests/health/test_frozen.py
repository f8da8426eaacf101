"""Time a rank did not run is not time waited (health/guard.py FROZEN): a job suspended inside a
collective (SIGSTOP, Slurm's `scontrol suspend`) resumes instead of timing out on every rank,
and a stopped rank continued by its launcher does not report its own timeout; a call that
blocks inside MPI is still bounded, since only sleeps are measured.

Serial: the guard's loop and the polled wait on a clock whose sleeps overrun on cue, and real
two-rank jobs stopped for longer than their timeout, then continued.
"""
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import ROOT, mpiexec_cmd
from mpishard.health import guard as guard_module
from mpishard.health import watchdog as watchdog_module
from mpishard.health.guard import FROZEN, Guard, not_running
from mpishard.health.watchdog import YIELD, Watchdog


class Clock:
    """A monotonic clock whose `sleep(s)` advances it by s, plus `overruns[k]` seconds on the
    k-th sleep; every read advances it by `tick` (so a loop that only reads it still ends)."""

    def __init__(self, overruns=None, tick=0.0):
        self.now, self.sleeps, self.tick = 0.0, 0, tick
        self.overruns = overruns or {}

    def sleep(self, seconds):
        self.now += seconds + self.overruns.get(self.sleeps, 0.0)
        self.sleeps += 1

    def monotonic(self):
        self.now += self.tick
        return self.now

    def monotonic_ns(self):
        return int(self.monotonic() * 1e9)


def guard_fires(monkeypatch, clock, timeout=2.0, period=0.25, calls=None):
    """Run the guard's loop on `clock` until it fires: (the clock's time at the firing, the
    line's message). The call in flight is one from time 0 of `timeout` seconds, or with
    `calls` {k: make()}: after the k-th sleep, the call in flight becomes make(clock.now)
    (the calls begin and end between two looks of the guard)."""
    monkeypatch.setattr(guard_module, "time", clock)
    guard = Guard.__new__(Guard)
    guard.period, guard.fired = period, False
    guard.in_flight = None if calls else (0, int(timeout * 1e9), lambda: "all_reduce timed "
                                          "out", ())
    fired = []

    def sleep(seconds, plain=clock.sleep):
        plain(seconds)
        if clock.sleeps in (calls or {}):
            guard.in_flight = calls[clock.sleeps](clock.now)

    def fire(message):
        fired.append((clock.now, message))
        guard.fired = True
    monkeypatch.setattr(clock, "sleep", sleep)
    guard.fire = fire
    guard._run()
    return fired[0]


def call(began: float, timeout: float, name: str) -> tuple:
    """A guard's call in flight: begun at `began` s, timing out after `timeout` s."""
    return (int(began * 1e9), int(timeout * 1e9), lambda: name, ())


def test_the_guard_fires_after_the_timeout_without_a_freeze(monkeypatch):
    at, message = guard_fires(monkeypatch, Clock())
    assert at == pytest.approx(2.25) and message == "all_reduce timed out"


def test_the_guard_does_not_count_a_freeze_and_says_so_when_it_fires(monkeypatch):
    """Stopped for 3 s on the second sleep: it fires 3 s later, naming the 3 s."""
    at, message = guard_fires(monkeypatch, Clock({1: 3.0}))
    assert at == pytest.approx(5.25)
    assert message.endswith("(this rank was itself not running for 3.0 s of the wait: stopped "
                            "or starved; not counted)")


def test_a_freeze_counts_for_the_call_it_stopped_only(monkeypatch):
    """The 3 s freeze of the second sleep is taken off the first call's wait; the call after
    it starts with nothing taken off."""
    at, message = guard_fires(monkeypatch, Clock({1: 3.0}), calls={
        1: lambda now: call(0.0, 60.0, "first"),
        3: lambda now: call(now, 2.0, "second")})          # begun at 3.75 s
    assert message == "second" and at == pytest.approx(3.75 + 2.25)


def test_a_freeze_is_capped_at_the_call_s_age(monkeypatch):
    """A call that began 0.1 s before the end of a 3 s freeze has only 0.1 s taken off."""
    at, message = guard_fires(monkeypatch, Clock({0: 3.0}), calls={
        1: lambda now: call(now - 0.1, 1.9, "late")})      # begun at 3.15 s
    assert at == pytest.approx(5.25)                       # 3.15 + 0.1 + 1.9 s, next look
    assert "not running for 0.1 s" in message


def test_the_guard_counts_an_overrun_under_frozen_as_waiting(monkeypatch):
    """A thread woken late by less than FROZEN (a busy core) still waits on its peers."""
    at, message = guard_fires(monkeypatch, Clock({k: FROZEN * 0.8 for k in range(20)}))
    assert at < 2.25 + 3 * FROZEN and "not running" not in message


def polled_waits(monkeypatch, clock, timeout=2.0) -> float:
    """The polled wait (`Watchdog.poll_until`) on `clock` for a test that never passes: the
    clock's time when it gives up."""
    monkeypatch.setattr(watchdog_module, "time", clock)
    watchdog = Watchdog.__new__(Watchdog)
    watchdog.timeout = timeout
    assert watchdog.poll_until(lambda: False) is False
    assert (watchdog.stopped_s > 0) == bool(clock.overruns)
    if clock.overruns:                    # what the polled timeout's message then adds
        assert "not running for 3.0 s" in not_running(watchdog.stopped_s)
    return clock.now


def test_a_polled_wait_does_not_count_a_freeze(monkeypatch):
    plain = polled_waits(monkeypatch, Clock(tick=1e-4))
    frozen = polled_waits(monkeypatch, Clock({5: 3.0}, tick=1e-4))
    assert 2.0 < plain < 2.2
    assert frozen - plain == pytest.approx(3.0, abs=0.05)


def test_a_polled_wait_does_not_count_a_freeze_in_its_yielding_polls(monkeypatch):
    """Stopped while yielding (before the first sleep): the yield phase's overrun past its
    YIELD seconds is taken off (the freeze less at most YIELD counts as waiting)."""
    clock = Clock(tick=1e-4)
    calls = []

    def test():
        calls.append(None)
        if len(calls) == 40:
            clock.now += 3.0
        return False
    monkeypatch.setattr(watchdog_module, "time", clock)
    watchdog = Watchdog.__new__(Watchdog)
    watchdog.timeout = 2.0
    assert watchdog.poll_until(test) is False
    assert 2.0 + 3.0 - YIELD < clock.now < 2.0 + 3.0 + 0.1


SUSPENDED = '''
import os, signal, sys, threading, time
from pathlib import Path
import numpy as np
from mpi4py import MPI
import mpishard as ms

comm = MPI.COMM_WORLD
rank, directory = comm.Get_rank(), Path(sys.argv[1])
engine = ms.make_engine(ms.MLP([2, 2]), "dp=2", comm=comm, timeout=2.0)
(directory / f"pid{rank}").write_text(str(os.getpid()))
engine.comm.barrier()
peer = int((directory / "pid1").read_text())
if rank == 0:                          # both pids, written whole
    (directory / "pids.part").write_text(f"{os.getpid()} {peer}")
    os.replace(directory / "pids.part", directory / "pids")


def stop_both():                       # 0.3 s into rank 0's wait: rank 1, then all of rank 0
    time.sleep(0.3)
    os.kill(peer, signal.SIGSTOP)
    os.kill(os.getpid(), signal.SIGSTOP)


def entering(wait):                    # the wait's entry (the guarded blocking call, or the
    def enter(*args):                  # polled wait): the stop is timed from in there
        if stopper.ident is None:      # the first wait only
            stopper.start()
        return wait(*args)
    return enter


if rank == 0:
    stopper, watchdog = threading.Thread(target=stop_both, daemon=True), engine.comm.watchdog
    watchdog.call_with_deadline = entering(watchdog.call_with_deadline)
    watchdog.poll_until = entering(watchdog.poll_until)
else:                                  # its peer waits in the all_reduce meanwhile; the test
    while not (directory / "go").exists():     # writes go just before it continues them both
        time.sleep(0.01)
total = engine.all_reduce(np.ones(3))
print(f"rank {rank} done {total.tolist()}", flush=True)
'''


def stopped(pid) -> bool:
    """Is process `pid` stopped (SIGSTOP)? Its state in /proc/PID/stat."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


@pytest.mark.parametrize("level", ["multiple", "serialized"])
def test_a_job_suspended_inside_a_collective_resumes(tmp_path, level):
    """Both ranks stopped 0.3 s into rank 0's wait (rank 0 stops them itself, timed from the
    entry of its wait, so the test's own speed cannot add to that wait), for 3.5 s (the timeout
    is 2 s), then continued, rank 1 entering the all_reduce at once: it completes, no rank
    times out. `multiple`: the guard bounds the blocking call; `serialized`: the polled wait."""
    script = tmp_path / "suspended.py"
    script.write_text(SUSPENDED)
    env = dict(os.environ, OMP_NUM_THREADS="1", MPI4PY_RC_THREAD_LEVEL=level,
               PYTHONPATH=str(ROOT))
    job = subprocess.Popen([*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", str(script),
                            str(tmp_path)], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    pids = []
    try:
        deadline = time.monotonic() + 90
        while not (tmp_path / "pids").exists():
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.01)
        pids = [int(pid) for pid in (tmp_path / "pids").read_text().split()]
        while not all(stopped(pid) for pid in pids):
            assert job.poll() is None and time.monotonic() < deadline, job.communicate()
            time.sleep(0.01)
        time.sleep(3.5)
        (tmp_path / "go").write_text("")              # before SIGCONT: rank 1 enters at once
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        out, err = job.communicate(timeout=60)
    finally:
        if job.poll() is None:
            for pid in pids:           # a stopped rank left behind must not stay stopped
                try:
                    os.kill(pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
            job.kill()
            job.wait()
    assert job.returncode == 0, out + err
    assert "rank 0 done [2.0, 2.0, 2.0]" in out and "rank 1 done" in out, out + err
    assert "CollectiveTimeout" not in out + err

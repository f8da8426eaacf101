"""The guard: a thread that bounds blocking MPI calls without polling them.

A blocking collective (`comm.Allreduce`, ...) waits inside MPI, where no Python code runs, so
it cannot time out by itself, and polling its non-blocking form from Python instead would cost
every call a poll loop. The guard keeps the blocking call: before it, the watchdog hands the
guard the call's deadline and how to describe it (`Guard.in_flight`), after it clears them:
two stores. One daemon thread per process wakes every PERIOD seconds (at most a quarter of the
shortest timeout), and when a call is still in flight past its deadline it prints the
CollectiveTimeout line (the operation, the group, the step, the late ranks) and aborts the job
with MPI_Abort: peers stuck in the collective can never leave it cleanly.

mpi4py releases the GIL inside MPI calls, so the thread runs while the main thread waits, and
reads the arrival counters (arrivals.py) with MPI calls of its own: it needs
MPI_THREAD_MULTIPLE (mpi4py's default); below it the watchdog polls instead.

Time the process did not run is not time waited on the peers. A sleep of the thread that
overruns by more than FROZEN seconds means the whole process was stopped (SIGSTOP, Slurm's
`scontrol suspend`, a debugger) or starved, and the overrun is taken off the call's clock. So a
suspended job resumes instead of timing out on every rank at once, and a rank stopped inside a
collective does not time out itself when it is continued (Open MPI's abort sends SIGCONT before
SIGTERM): its peers, which did wait, are the ones that report. This thread makes no MPI call
between two looks, so a call that blocks inside MPI is still bounded: every turn counts at
least its `period`. A process starved of its core (swapping, a throttled cgroup) is counted
the same way, so there the timeout stretches with the starvation.
"""
from __future__ import annotations

import threading
import time

from mpi4py import MPI

from .flight import dump_all
from .lines import write_line
from .signals import remove_mpi_files

PERIOD = 0.25         # seconds between two looks at the call in flight (at most)
ABORT_GRACE = 0.5     # seconds between the error line and MPI_Abort (cli/usage.py abort_job)
FROZEN = 0.25         # seconds a sleep may overrun before the overrun counts as not running


def not_running_part(overrun: float) -> float:
    """Of `overrun` seconds past a sleep's length, how many the process was not running (all
    of it past FROZEN, else none: a thread woken a little late by a busy core still waits)."""
    return overrun if overrun > FROZEN else 0.0


def not_running(seconds: float) -> str:
    """What a timeout's line adds when the process was stopped or starved for `seconds` of the
    wait (not counted into it); '' for none."""
    if not seconds:
        return ""
    return (f" (this rank was itself not running for {seconds:.1f} s of the wait: stopped or "
            "starved; not counted)")


def thread_multiple() -> bool:
    """Whether a thread may make MPI calls while the main thread is in one."""
    return MPI.Query_thread() == MPI.THREAD_MULTIPLE


class Guard:
    """The deadline of the blocking call in flight on this process, and its watching thread.

    `in_flight` is None between calls, else (start, timeout, describe, args): start and
    timeout in nanoseconds of `time.monotonic_ns`; `describe(*args)` returns the timeout's
    message, called on the guard's thread, only on a timeout.
    """

    SHARED = None         # the process's Guard, started by the first engine that needs one

    def __init__(self):
        self.in_flight = None
        self.period = PERIOD
        self.fired = False
        self.thread = threading.Thread(target=self._run, name="mpishard-guard", daemon=True)
        self.thread.start()

    @classmethod
    def shared(cls, timeout: float) -> "Guard":
        """The process's guard, looking often enough for `timeout`."""
        if cls.SHARED is None:
            cls.SHARED = cls()
        cls.SHARED.period = min(cls.SHARED.period, timeout / 4)
        return cls.SHARED

    def _run(self) -> None:
        seen, frozen = None, 0          # the call in flight, and how long the process was not
        last = time.monotonic_ns()      # running since it began (ns)
        while not self.fired:
            period = self.period
            time.sleep(period)
            call = self.in_flight       # (read first: a call is never younger than `now`)
            now = time.monotonic_ns()   # the overrun of the whole turn since the last look
            overrun, last = now - last - int(period * 1e9), now
            if call is not seen:
                seen, frozen = call, 0
            if call is not None:        # (a freeze before the call began is not its own)
                frozen += min(int(not_running_part(overrun / 1e9) * 1e9), max(0, now - call[0]))
            if call is not None and now - call[0] - frozen > call[1]:
                if self.in_flight is call:            # still the same call, still in it
                    self.fire(self._describe(call) + not_running(frozen / 1e9))

    @staticmethod
    def _describe(call) -> str:
        """The timeout's message; if making it fails (it reads the peers' counters with MPI
        calls), a plainer one: the guard thread must still abort, or no later call is bounded."""
        try:
            return call[2](*call[3])
        except Exception as exc:       # noqa: BLE001 -- any failure: still report and abort
            return (f"a blocking call timed out after {call[1] / 1e9:g} s (naming the late "
                    f"ranks failed: {type(exc).__name__}: {exc})")

    def fire(self, message: str) -> None:
        """The call timed out: one line, then MPI_Abort (exit code 1)."""
        self.fired = True
        write_line(f"mpishard: error: CollectiveTimeout: {message}")     # one write (lines.py)
        dump_all(f"CollectiveTimeout: {message}")      # the flight recorder (flight.py)
        remove_mpi_files()                       # MPI_Abort leaves MPI's own files behind
        time.sleep(ABORT_GRACE)
        MPI.COMM_WORLD.Abort(1)

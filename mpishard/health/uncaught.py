"""One readable error per distinct cause when ranks end on an uncaught exception.

Under `python -m mpi4py`, an exception that leaves the script is printed by every failing rank
(full tracebacks, interleaved on one terminal), then mpi4py's exit handler calls MPI_Abort,
which leaves the MPI library's files behind. `install()` -- called by `make_engine` unless it
is given `report_errors=False` -- replaces `sys.excepthook` (process-wide: logged once on the
"mpishard" logger) with `report`; each engine that installed it calls `release()` when it is
closed, and the last release puts the previous hook back, so an error after the engines are
closed is not reported as one of theirs (`uninstall()` puts it back at once). `report`

- exchanges the error with the other failing ranks for at most REPORT_WINDOW seconds: each
  failing rank sends (type, first line of the message, traceback) to rank 0 of COMM_WORLD with
  non-blocking sends; rank 0, if it failed too, collects until every rank reported or the window
  closes, acknowledging each report, then prints and tells the reporters it is done;
- prints, from rank 0, the traceback of each distinct cause once (from its lowest rank) and then
  one line per cause: `mpishard: error: ValueError: bad size (ranks 0-3)`. A rank whose report
  rank 0 does not acknowledge within the window (rank 0 is still running, or stuck in a
  collective) prints its own. A reporter waits for rank 0's "done" before going on to abort,
  since the first MPI_Abort ends every rank of the job;
- when mpi4py's runner is going to abort, removes this job's MPI files (signals.py).

Python's own hook still handles KeyboardInterrupt, and any exception once MPI is finalized.
The exchange uses COMM_WORLD with tags of its own (REPORT_TAG, ...) and only point-to-point
calls, so it works while peers sit in a collective.
"""
from __future__ import annotations

import logging
import os
import sys
import time
import traceback

from mpi4py import MPI

from ..comm.retired import abandon
from .flight import dump_all
from .lines import write_line
from .signals import remove_mpi_files

__all__ = ["install", "held_by", "release", "uninstall", "installed", "report", "format_report",
           "rank_ranges", "REPORT_WINDOW"]

REPORT_WINDOW = 1.0        # seconds rank 0 collects reports; a reporter waits for its ack
DONE_WAIT = 2.0            # seconds a reporter whose report was acknowledged waits for "done"
REPORT_TAG, ACK_TAG, DONE_TAG = 27_731, 27_732, 27_733
MAX_TRACEBACK = 16_000     # characters of a traceback sent to rank 0 (the last ones)
POLL = 0.002               # seconds between two looks for a message
LAUNCHER_FILES = ("/runpy.py", "/mpi4py/run.py", "/mpi4py/__main__.py")

log = logging.getLogger("mpishard")
_previous = None           # the hook `install` replaced; None while not installed
_users = 0                 # installs not yet released (engines open that asked for the report)
_pending = None            # the error of a make_engine that raised, while it may still be uncaught


def install() -> None:
    """Make `report` the process's sys.excepthook (once; logged); each call is one user,
    to be given back with `release`."""
    global _previous, _users, _pending
    _users += 1
    _pending = None
    if _previous is not None:
        return
    _previous = sys.excepthook
    sys.excepthook = report
    log.info("sys.excepthook: an uncaught exception is reported once per distinct cause over "
             "the job's ranks (make_engine(..., report_errors=False) keeps Python's)")


def held_by(build, report_errors: bool):
    """make_engine's engine: `build()`, with the report installed first when `report_errors`
    (one user, released when the engine closes). When `build` raises (a bad argument, the same
    error on every rank), no engine holds that user: the hook stays only for that error, which
    the report still handles if it goes uncaught (every rank's files removed, one report);
    any other exception goes to the hook it replaced, as if none were installed."""
    global _users, _pending
    if report_errors:
        install()
    try:
        engine = build()
    except BaseException as exc:
        if report_errors:
            _users = max(0, _users - 1)
            if _users == 0:
                _pending = exc           # the hook stays, for this error only
        raise
    engine.error_report = bool(report_errors)
    return engine


def release(engine=None) -> None:
    """One user of `install` is done (`engine` closed: only if it is one; None: a user), the
    last one puts the previous hook back."""
    global _users
    if engine is not None:
        if not getattr(engine, "error_report", False):
            return
        engine.error_report = False
    _users = max(0, _users - 1)
    if _users == 0:
        uninstall()


def uninstall() -> None:
    """Put back the hook `install` replaced, whoever still uses it."""
    global _previous, _users, _pending
    _users, _pending = 0, None
    if _previous is not None:
        sys.excepthook, _previous = _previous, None


def _caused_by(exc, cause) -> bool:
    """Whether `exc` is `cause` or was raised from or while handling it."""
    seen = 0
    while exc is not None and seen < 64:
        if exc is cause:
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def installed() -> bool:
    return _previous is not None


def report(exc_type, exc, tb) -> None:
    """sys.excepthook: the exchange and the report of the module docstring."""
    if (_previous is None or issubclass(exc_type, KeyboardInterrupt)
            or (_users == 0 and not _caused_by(exc, _pending))      # no engine's error
            or not MPI.Is_initialized() or MPI.Is_finalized()):     # no MPI left to ask
        (_previous or sys.__excepthook__)(exc_type, exc, tb)
        return
    dump_all(f"{exc_type.__name__}: {_first_line(exc)}")     # the flight recorder (flight.py)
    for stream in (sys.stdout, sys.stderr):      # what the script printed goes out first
        try:
            stream.flush()
        except Exception:
            pass
    world = MPI.COMM_WORLD
    mine = (world.Get_rank(), exc_type.__name__, _first_line(exc), _traceback(exc_type, exc, tb))
    try:
        failures = _exchange(world, mine) if world.Get_size() > 1 else [mine]
    except Exception:                            # MPI unusable: say at least this rank's error
        failures = [mine]
    if failures:
        _write_report(failures)
    if "mpi4py.run" in sys.modules:              # python -m mpi4py: MPI_Abort comes next
        remove_mpi_files()


def _first_line(exc) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def _traceback(exc_type, exc, tb) -> str:
    """The traceback as Python prints it, without the launcher's frames (runpy, mpi4py.run)."""
    while tb is not None and _launcher_frame(tb.tb_frame.f_code.co_filename):
        tb = tb.tb_next
    text = "".join(traceback.format_exception(exc_type, exc, tb))
    return text[-MAX_TRACEBACK:]


def _launcher_frame(filename: str) -> bool:
    name = filename.replace(os.sep, "/")
    return name == "<frozen runpy>" or name.endswith(LAUNCHER_FILES)


def _exchange(world, mine) -> list:
    """The failures this rank prints: rank 0 all it collected, another rank [] when rank 0
    acknowledged its report (and said it is done, or DONE_WAIT passed), else its own."""
    if world.Get_rank() == 0:
        return _collect(world, mine)
    report = world.isend(mine, dest=0, tag=REPORT_TAG)  # holds the pickled bytes until sent
    if _receive(world, ACK_TAG, REPORT_WINDOW) is None:
        abandon([report])            # rank 0 may still read it while this rank goes on
        return [mine]
    report.Wait()                    # acknowledged: rank 0 has received it
    _receive(world, DONE_TAG, DONE_WAIT)
    return []


def _collect(world, mine) -> list:
    """Rank 0: every report that arrives within REPORT_WINDOW (all ranks: at once)."""
    reports, size, acks = {0: mine}, world.Get_size(), []
    deadline = time.monotonic() + REPORT_WINDOW
    while len(reports) < size:
        status = MPI.Status()
        if world.Iprobe(source=MPI.ANY_SOURCE, tag=REPORT_TAG, status=status):
            source = status.Get_source()
            reports[source] = world.recv(source=source, tag=REPORT_TAG)
            acks.append(world.isend(None, dest=source, tag=ACK_TAG))
        elif time.monotonic() > deadline:
            break
        else:
            time.sleep(POLL)
    failures = [reports[r] for r in sorted(reports)]
    _write_report(failures)
    sends = acks + [world.isend(None, dest=r, tag=DONE_TAG) for r in sorted(reports) if r]
    deadline = time.monotonic() + DONE_WAIT
    while not MPI.Request.Testall(sends) and time.monotonic() < deadline:
        time.sleep(POLL)
    abandon(sends)                   # the ones a reporter never received stay alive
    return []


def _receive(world, tag: int, seconds: float):
    """A message with `tag` from rank 0 within `seconds`, else None (a bounded wait)."""
    deadline = time.monotonic() + seconds
    while not world.Iprobe(source=0, tag=tag):
        if time.monotonic() > deadline:
            return None
        time.sleep(POLL)
    world.recv(source=0, tag=tag)
    return True


def _write_report(failures) -> None:
    """format_report's text to stderr, each traceback and each error line one write
    (lines.py), so another rank's output never runs into a line of it."""
    for part in report_parts(failures):
        write_line(part)


def format_report(failures) -> str:
    """The text printed for [(rank, type name, first line, traceback)]: each distinct cause's
    traceback once (its lowest rank's), then one `mpishard: error:` line per cause."""
    return "".join(report_parts(failures))


def report_parts(failures) -> list:
    """format_report's text as its parts: each traceback (with its heading), each line."""
    causes = {}
    for rank, name, line, text in sorted(failures):
        causes.setdefault((name, line), (text, []))[1].append(rank)
    out = []
    for (name, line), (text, ranks) in causes.items():
        out.append(f"mpishard: {name} on {rank_ranges(ranks)}; the traceback of rank "
                   f"{ranks[0]}:\n{text.rstrip()}\n")
    for (name, line), (_, ranks) in causes.items():
        out.append(f"mpishard: error: {name}{': ' + line if line else ''} "
                   f"({rank_ranges(ranks)})\n")
    return out


def rank_ranges(ranks) -> str:
    """'rank 2', 'ranks 0-3', 'ranks 0-1,3': sorted ranks with runs folded."""
    ranks = sorted(ranks)
    runs = [[ranks[0], ranks[0]]]
    for r in ranks[1:]:
        if r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    runs = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs]
    return ("rank " if len(ranks) == 1 else "ranks ") + ",".join(runs)

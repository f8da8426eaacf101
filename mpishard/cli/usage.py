"""User mistakes on the command line: one error line and exit code 2 on every rank.

Bad input is a user mistake, not a crash: every rank parses the same argv and validates it
before any collective, so all ranks fail the same way. A command builds what it needs inside
`agreed(comm, build)`: a ValueError/TypeError raised there on any rank becomes a `UsageError` on
every rank (`comm.objects.agree_mpi`: one flag Allreduce). `cli.main` catches UsageError at the
top: rank 0 prints one line, `mpishard: error: ...`, and every rank returns exit code 2 (no
traceback, no hang; `cli.exit_cleanly` finalizes MPI before exiting so mpi4py does not abort).
A ValueError raised later, in the middle of collectives, is not caught: it may be raised on some
ranks only, and finishing those ranks would leave the others waiting, so it propagates, is
reported once per distinct cause (health/uncaught.py) and `python -m mpi4py` aborts the job.
"""
from __future__ import annotations

import argparse
import os
import time

from mpi4py import MPI

from ..comm.mesh import check_world_size, parse_layout
from ..comm.objects import agree_mpi
from ..health.flight import dump_all
from ..health.guard import ABORT_GRACE
from ..health.lines import write_line
from ..health.signals import remove_mpi_files
from ..models import ARCHITECTURES
from ..validate import check_number

PROG = "mpishard"


class UsageError(ValueError):
    """Bad command-line or config input (printed as one line, exit code 2)."""


def world_comm():
    """The communicator every command runs on: MPI.COMM_WORLD."""
    return MPI.COMM_WORLD


def world_rank() -> int:
    return world_comm().Get_rank()


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage from every rank, and prints
    help (and any exit message) on rank 0 only."""

    def error(self, message):
        raise UsageError(message)

    def print_help(self, file=None):
        if world_rank() == 0:
            super().print_help(file)

    def print_usage(self, file=None):
        if world_rank() == 0:
            super().print_usage(file)

    def exit(self, status=0, message=None):
        super().exit(status, message if world_rank() == 0 else None)


def agreed(comm, build):
    """Run `build()` on every rank of `comm`; if it raised a user error (ValueError/TypeError)
    on any rank, every rank raises UsageError with the first failing rank's message, so no
    rank is left waiting alone."""
    error, result = None, None
    try:
        result = build()
    except (ValueError, TypeError) as exc:        # UsageError is a ValueError
        error = str(exc) or type(exc).__name__
    agree_mpi(comm, error, exc=UsageError)
    return result


# -- argument checks (no MPI; identical on every rank) -------------------------------------------
def check_flags(args, names, **bounds):
    """`check_number` on each option in `names` that is set in `args` (None: not given),
    raising UsageError that names the flag: `--batch must be > 0, got 0`."""
    for name in names:
        value = getattr(args, name)
        if value is not None:
            check_number("--" + name.replace("_", "-"), value, error=UsageError, **bounds)


def check_directory(flag: str, path) -> None:
    """UsageError unless `path` (the value of `flag`) is a directory: a mistyped path reads
    'does not exist', not as the first file that the command looks for inside it."""
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path}: " + ("not a directory" if os.path.exists(path) else
                                               "the directory does not exist"))


def refuse_flags(args, flags: dict, where: str) -> None:
    """UsageError for the first of `flags` ({dest: flag}) given in `args` (not None): it
    applies to `where` only."""
    given = [flag for dest, flag in flags.items() if getattr(args, dest) is not None]
    if given:
        raise UsageError(f"{given[0]} applies to {where}")


# The architectures a `--model KIND:KEY=VALUE,...` (or a bare KIND) builds; any other --model
# text is an MLP's dims.
KEYED = {kind: cls for kind, cls in ARCHITECTURES.items() if cls.flag_defaults is not None}


def parse_dims(text) -> list:
    """An MLP's --model dims; UsageError (naming the keyed kinds for a KIND: text)."""
    kind, colon, _ = str(text).partition(":")
    if colon:
        raise UsageError(f"--model {text!r}: {kind.strip()!r} is not a model kind; "
                         f"KIND:KEY=VALUE,... takes KIND {', '.join(KEYED)} (an MLP's dims "
                         f"are comma-separated integers like 64,128,10)")
    try:
        dims = [int(s) for s in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--model {text!r}: expected comma-separated integers like "
                         f"64,128,10") from None
    if len(dims) < 2 or min(dims) < 1:
        raise UsageError(f"--model {text!r}: need at least two positive dims (input, output)")
    return dims


def default_layout(world_size: int) -> str:
    """The layout when --layout is not given: plain data parallel over every rank."""
    return f"dp={world_size}" if world_size > 1 else "single"


def checked_layout(text, world_size: int):
    """--layout parsed and checked against the world size (UsageError naming the numbers)."""
    try:
        layout = parse_layout(text)
        check_world_size(layout, world_size)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"--layout: {exc}") from None
    return layout


def abort_job(exc) -> None:
    """After a CollectiveTimeout: one line from this rank, the MPI library's files removed
    (health/signals.py), then MPI_Abort (exit code 1). Not a clean exit: a stalled peer would
    keep MPI_Finalize (and collective frees) waiting. The line gets ABORT_GRACE to pass
    through the launcher before the abort tears the job down (otherwise a loaded node can end
    the job before the reason is printed)."""
    write_line(f"{PROG}: error: {type(exc).__name__}: {exc}")     # one write (health/lines.py)
    dump_all(f"{type(exc).__name__}: {exc}")        # the flight recorder (health/flight.py)
    remove_mpi_files()
    time.sleep(ABORT_GRACE)
    world_comm().Abort(1)


def print_report(text) -> int:
    """Rank 0 prints `text` (every rank computed it); exit code 0."""
    if world_rank() == 0:
        print(text, flush=True)
    return 0

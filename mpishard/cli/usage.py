"""User mistakes on the command line: one error line and exit code 2 on every rank.

Bad input is a user mistake, not a crash: every rank parses the same argv and validates it
before any collective, so all ranks fail the same way. A command builds what it needs inside
`agreed(build)`: a ValueError/TypeError raised there on any rank becomes a `UsageError` on every
rank (one flag Allreduce). `cli.main` catches UsageError at the top: rank 0 prints one line,
`mpishard: error: ...`, and every rank returns exit code 2 (no traceback, no hang; `__main__`
finalizes MPI before exiting so mpi4py does not abort). A ValueError raised later, in the middle
of collectives, is not caught: it may be raised on some ranks only, and finishing those ranks
would leave the others waiting, so it propagates and `python -m mpi4py` aborts the job.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

from ..comm.mesh import check_world_size, parse_layout

PROG = "mpishard"


class UsageError(ValueError):
    """Bad command-line or config input (printed as one line, exit code 2)."""


def _world():
    return MPI.COMM_WORLD


def _rank() -> int:
    return _world().Get_rank()


class Parser(argparse.ArgumentParser):
    """argparse that raises UsageError instead of printing usage from every rank, and prints
    help on rank 0 only."""

    def error(self, message):
        raise UsageError(message)

    def _print_message(self, message, file=None):
        if message and _rank() == 0:
            (file or sys.stdout).write(message)


def agreed(comm, build):
    """Run `build()` on every rank; if it raised a user error on any rank, every rank raises
    the first failing rank's message (one Allreduce of a flag, so no rank is left waiting)."""
    err, result = None, None
    try:
        result = build()
    except (ValueError, TypeError) as exc:        # UsageError is a ValueError
        err = str(exc) or type(exc).__name__
    flag = np.array([0 if err is None else 1], dtype=np.int64)
    total = np.empty_like(flag)
    comm.Allreduce(flag, total, op=MPI.SUM)
    if total[0]:
        msgs = comm.allgather(err)                # small control data only
        raise UsageError(next(m for m in msgs if m is not None))
    return result


# -- argument checks (no MPI; identical on every rank) -------------------------------------------
def parse_dims(text) -> list:
    try:
        dims = [int(s) for s in str(text).split(",")]
    except ValueError:
        raise UsageError(f"--model {text!r}: expected comma-separated integers like "
                         f"64,128,10") from None
    if len(dims) < 2 or min(dims) < 1:
        raise UsageError(f"--model {text!r}: need at least two positive dims (input, output)")
    return dims


def _positive(name, value, allow_zero=False):
    if value is None:
        return
    if value < 0 or (value == 0 and not allow_zero) or value != value:
        raise UsageError(f"--{name} must be {'>= 0' if allow_zero else '> 0'}, got {value:g}")


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


def print_report(text) -> int:
    """Rank 0 prints `text` (every rank computed it); exit code 0."""
    if _rank() == 0:
        print(text, flush=True)
    return 0

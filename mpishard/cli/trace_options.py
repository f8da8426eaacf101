"""train's --trace DIR and --trace-steps A:B (the window: train/trace_steps.py).

    mpiexec -n 4 python -m mpi4py -m mpishard train --layout dp=2,tp=2 ... --trace runs/t
    python -m mpishard trace-summary runs/t        # table per rank, runs/t/timeline.png
"""
from __future__ import annotations

import os

from ..train.trace_steps import DEFAULT_STEPS, TraceSteps, parse_steps, window
from .usage import UsageError

TRACE_DEFAULTS = {"trace": None, "trace_steps": None}


def add_trace_arguments(add):
    """The two flags, through `add` (an argument group's add_argument)."""
    add("--trace", metavar="DIR", help="record --trace-steps of the run on every rank into "
        "DIR/trace.json (Chrome/Perfetto: ui.perfetto.dev; a table and pictures: "
        "`python -m mpishard trace-summary DIR`)")
    add("--trace-steps", metavar="A:B", help="the optimizer steps --trace records, counted "
        "from 1 and both included; A: runs to the end, all is the whole run (default "
        f"{DEFAULT_STEPS[0]}:{DEFAULT_STEPS[1]}, clipped to the run: step 1 pays one-time "
        "costs)")


def validate_trace_args(args):
    """No MPI, the same on every rank; sets args.trace_window to parse_steps' pair (None: the
    default window). Raises UsageError."""
    args.trace_window = None
    if args.trace is None:
        if args.trace_steps is not None:
            raise UsageError(f"--trace-steps {args.trace_steps} needs --trace DIR")
        return
    if os.path.exists(args.trace) and not os.path.isdir(args.trace):
        raise UsageError(f"--trace {args.trace} exists and is not a directory")
    if args.trace_steps is not None:
        try:
            args.trace_window = parse_steps(args.trace_steps)
        except ValueError as exc:
            raise UsageError(str(exc)) from None


def add_trace_callback(args, trainer) -> None:
    """With --trace: the TraceSteps callback of the window, appended last (so a checkpoint
    save just before the window is not traced). Raises UsageError when an explicit window
    runs none of this run's steps (e.g. after --resume)."""
    if args.trace is None:
        return
    try:
        first, last = window(args.trace_window, trainer.state.step, trainer.total_steps)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    trainer.callbacks.append(TraceSteps(args.trace, first, last))


def trace_lines(trainer) -> str:
    """'\\ntrace: steps A to B in DIR/trace.json' per written trace ('' without --trace)."""
    return "".join(f"\ntrace: steps {cb.first} to {cb.last} in {cb.path}"
                   for cb in trainer.callbacks if isinstance(cb, TraceSteps) and cb.path)

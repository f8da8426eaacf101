"""train's evaluation and report flags, and the start-up lines at the level they call for.

    --eval-every N      evaluate every N steps (0: only at the end)
    --eval-batch B      rows per evaluation batch (default: one training micro-step's rows,
                        --batch / --accumulate, so evaluation never holds more than training)
    --eval-batches N    at most N batches per evaluation, the first ones (default: the whole
                        test split); 0 turns evaluation off
    --metrics-json PATH the end-of-run metrics (rank 0), peak memory per phase included

The host-heap line is INFO when --host-heap was given, DEBUG when it is the train command's own
default (health/heap.py).
"""
from __future__ import annotations

import logging
import os

from .usage import UsageError, check_flags

REPORT_DEFAULTS = {"eval_every": 0, "eval_batch": None, "eval_batches": None,
                   "metrics_json": None}


def add_report_arguments(add):
    """--eval-every, --eval-batch, --eval-batches and --metrics-json through `add` (an
    argument group's add_argument)."""
    add("--eval-every", type=int, metavar="N", help="evaluate every N steps (0: at the end)")
    add("--eval-batch", type=int, metavar="B", help="rows per evaluation batch, a multiple of "
        "the data-parallel ranks (default: the rows of one training micro-step, --batch / "
        "--accumulate)")
    add("--eval-batches", type=int, metavar="N", help="at most N batches per evaluation "
        "(default: the whole test split; 0: no evaluation)")
    add("--metrics-json", metavar="PATH", help="write the end-of-run metrics here (rank 0; "
        "with each rank's peak memory per phase)")


def validate_report_args(args, layout) -> None:
    """No MPI, the same on every rank; raises UsageError."""
    check_flags(args, ("eval_every", "eval_batches"), low=0)
    check_flags(args, ("eval_batch",), low=0, low_open=True)
    dp = layout.data_parallel_size
    if args.eval_batch is not None and args.eval_batch % dp:
        raise UsageError(f"--eval-batch {args.eval_batch} must divide by the {dp} "
                         f"data-parallel ranks of layout {layout.text!r}")
    if args.eval_batches == 0 and args.eval_every:
        raise UsageError(f"--eval-every {args.eval_every} asks for evaluations that "
                         f"--eval-batches 0 turns off")
    if args.metrics_json:
        parent = os.path.dirname(os.path.abspath(args.metrics_json))
        if not os.path.isdir(parent):
            raise UsageError(f"--metrics-json {args.metrics_json}: directory {parent} does "
                             f"not exist")


def log_host_heap(log, engine, asked: bool) -> None:
    """What the engine did with the heap: INFO when the user asked (--host-heap), else DEBUG."""
    log.log(logging.INFO if asked else logging.DEBUG, "host heap: %s", engine.host_heap.why)


__all__ = ["REPORT_DEFAULTS", "add_report_arguments", "log_host_heap", "validate_report_args"]

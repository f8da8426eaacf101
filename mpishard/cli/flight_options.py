"""train's --flight-dir DIR and --checkpoint-async, and the straggler line every --log-every steps.

    mpiexec -n 4 python -m mpi4py -m mpishard train ... --checkpoint-dir ck --checkpoint-async
    python -m mpishard flight ck.flight          # after a stall: where the ranks diverged

--flight-dir: where the flight recorder (health/flight.py) dumps on a timeout, an error,
SIGUSR2 or a fatal signal. Default: $MPISHARD_FLIGHT_DIR, else DIR.flight beside
--checkpoint-dir DIR (not inside it: a checkpoint directory is swapped whole at each save, and
the check of a fresh --checkpoint-dir refuses one that holds other files), else the working
directory.
--checkpoint-async: the interval saves are written by a background thread
(checkpoint/async_writer.py); needs --checkpoint-dir.
Every --log-every steps, rank 0 logs the straggler line when one rank stands out
(health/stragglers.py).
"""
from __future__ import annotations

import os
import time

from ..health.flight import DIR_ENV
from ..health.stragglers import report
from ..train.trainer import Callback
from .usage import UsageError

FLIGHT_DEFAULTS = {"flight_dir": None, "checkpoint_async": False}


def add_flight_arguments(reporting, checkpoints) -> None:
    """The flags, through the argument groups' add_argument."""
    reporting("--flight-dir", metavar="DIR", help="where each rank dumps its last 256 "
              "communication calls and its stacks on a timeout, an error, SIGUSR2 or a fatal "
              "signal (`python -m mpishard flight DIR` reads them; default: CKPT.flight beside "
              "--checkpoint-dir CKPT, else the working directory)")
    checkpoints("--checkpoint-async", action="store_true", default=None, help="write the "
                "--checkpoint-every saves in a background thread while training goes on; each "
                "is finished (verdict, index, atomic swap) at a later step boundary")


def validate_flight_args(args) -> None:
    """No MPI, the same on every rank. Raises UsageError."""
    if args.checkpoint_async and args.checkpoint_dir is None:
        raise UsageError("--checkpoint-async needs --checkpoint-dir DIR")
    if args.flight_dir is not None and os.path.exists(args.flight_dir) and \
            not os.path.isdir(args.flight_dir):
        raise UsageError(f"--flight-dir {args.flight_dir} exists and is not a directory")


def flight_dir(args) -> str:
    """--flight-dir, else $MPISHARD_FLIGHT_DIR, else CKPT.flight, else the working directory."""
    if args.flight_dir is not None:
        return args.flight_dir
    if os.environ.get(DIR_ENV):
        return os.environ[DIR_ENV]
    if args.checkpoint_dir is not None:
        return os.path.abspath(args.checkpoint_dir) + ".flight"
    return os.getcwd()


class StragglerLine(Callback):
    """Every `every` steps (collective): rank 0 logs the straggler line, if one stands out."""

    def __init__(self, every: int):
        self.every, self.since = int(every), time.time()

    def on_step_end(self, trainer) -> None:
        if trainer.state.step % self.every == 0:
            comm = trainer.engine.comm
            line = report(comm, comm.flight, self.since)
            self.since = time.time()
            if line is not None:
                trainer.log.info("%s", line)


def add_flight_callbacks(args, trainer, saver) -> None:
    """Point the recorder's dumps at --flight-dir, make `saver` (the Checkpointer or None)
    asynchronous with --checkpoint-async, add the straggler line with --log-every (the flags
    were checked by validate_flight_args, before any collective)."""
    recorder = trainer.engine.comm.flight
    if recorder is not None:
        recorder.redirect(flight_dir(args))
        if args.log_every:
            trainer.callbacks.append(StragglerLine(args.log_every))
    if saver is not None and args.checkpoint_async:
        saver.asynchronous = True

"""train's cluster flags: --resume auto|PATH, preemption (exit 75), streamed metrics.

    --resume            the newest checkpoint in --checkpoint-dir (it must exist)
    --resume auto       that checkpoint if --checkpoint-dir holds one, else start fresh: the same
                        command line for the first run and every requeued or restarted one
    --resume PATH       the checkpoint at PATH (saves still go to --checkpoint-dir)
    --preempt-check-every K   steps between the ranks' agreement on a stop signal (1)
    --metrics-jsonl FILE / --metrics-csv FILE / --tensorboard DIR   train/metrics.py

With --checkpoint-dir, SIGTERM and SIGUSR1 stop training at the next agreed step boundary
(train/preemption.py), save a checkpoint and exit PREEMPTED_EXIT = 75 (EX_TEMPFAIL) with one
line saying why; the batch script turns 75 into a requeue (examples/hpc/). Without a
checkpoint directory there is nothing to resume from, and the signals keep their meaning
(health/signals.py: clean up and exit 128 + signum).

`stop_signals` holds the handlers for the whole command, not only the steps: a signal while
the data loads, the engine is built or a checkpoint is resumed is recorded, and the ranks
agree on it once before the first step (`preempted_before_training`): no step is trained, no
checkpoint written (a resumed run's checkpoint is already there), exit 75 on every rank. A
second signal during the save or after it changes nothing: the flag is held until the command
returns, and a process that ends then (`python -m mpishard`) ignores the stop signals from
there to its exit, MPI_Finalize included; an in-process caller gets its handlers back.
"""
from __future__ import annotations

import os
import signal
from contextlib import contextmanager

from ..checkpoint import is_checkpoint
from ..health.lines import write_line
from ..train.metrics import CsvSink, JsonlSink, MetricsStream, TensorBoardSink
from ..train.preemption import PREEMPTED_EXIT, Preempted, Preemption, StopFlag, any_rank
from .usage import PROG, UsageError, world_rank

CLUSTER_DEFAULTS = {"metrics_jsonl": None, "metrics_csv": None, "tensorboard": None,
                    "preempt_check_every": 1}
AUTO = "auto"


def add_resume_argument(add):
    """--resume [auto|PATH] through `add` (a group's add_argument)."""
    add("--resume", nargs="?", const=True, metavar="auto|PATH", help="continue from a "
        "checkpoint: parameters, optimizer state, step, data position and shuffle (any layout "
        "or world size). Bare: the newest one in --checkpoint-dir; auto: that one if there is "
        "one, else start fresh (one command line for the first run and every requeue); PATH: "
        "the checkpoint at PATH")
    add("--preempt-check-every", type=int, metavar="K", help="with --checkpoint-dir, SIGTERM "
        "or SIGUSR1 saves a checkpoint at the next step boundary the ranks agree on and exits "
        f"{PREEMPTED_EXIT} (EX_TEMPFAIL: requeue the job); the ranks agree every K steps (1)")


def add_metrics_arguments(add):
    """--metrics-jsonl, --metrics-csv, --tensorboard through `add`."""
    add("--metrics-jsonl", metavar="FILE", help="append a record every --log-every steps "
        "(step, loss, lr, grad norm, samples/s, step time, memory per rank; evaluations), "
        "flushed; a resumed run drops records past its step and appends. Default with "
        "--checkpoint-dir DIR: DIR.metrics.jsonl, beside DIR (a save replaces DIR whole)")
    add("--metrics-csv", metavar="FILE", help="the same records as CSV")
    add("--tensorboard", metavar="DIR", help="the same records as TensorBoard scalars "
        "(needs tensorboardX: pip install 'mpishard[tensorboard]')")


def validate_cluster_args(args, complete: bool) -> None:
    """--resume's forms and the metrics paths (no MPI; the same on every rank). `complete`:
    --checkpoint-dir holds a checkpoint."""
    if args.checkpoint_dir is None and args.resume in (True, AUTO):
        raise UsageError(f"--resume{' auto' if args.resume == AUTO else ''} needs "
                         "--checkpoint-dir DIR")
    if args.resume is True and not complete:
        raise UsageError(f"--resume: {args.checkpoint_dir} holds no checkpoint (no index.json)")
    if isinstance(args.resume, str) and args.resume != AUTO and not is_checkpoint(args.resume):
        raise UsageError(f"--resume {args.resume}: no checkpoint there (no index.json)")
    if complete and args.resume in (None, False) and world_rank() == 0:
        write_line(f"{PROG}: warning: --checkpoint-dir {args.checkpoint_dir} holds a checkpoint; "
                   "without --resume this run starts at step 0, replaces it at its first save "
                   "and starts its metrics file over (--resume auto continues it)")
    if args.preempt_check_every < 1:
        raise UsageError(f"--preempt-check-every must be >= 1, got {args.preempt_check_every}")
    if args.metrics_jsonl is None and args.checkpoint_dir is not None:
        args.metrics_jsonl = os.path.abspath(args.checkpoint_dir) + ".metrics.jsonl"
    for flag, path in (("--metrics-jsonl", args.metrics_jsonl),
                       ("--metrics-csv", args.metrics_csv)):
        parent = os.path.dirname(os.path.abspath(path)) if path else None
        if parent and not os.path.isdir(parent):
            raise UsageError(f"{flag} {path}: directory {parent} does not exist")
    if args.tensorboard:
        try:
            import tensorboardX  # noqa: F401
        except ImportError:
            raise UsageError("--tensorboard needs tensorboardX: pip install "
                             "'mpishard[tensorboard]' (or tensorboardX)") from None


def resume_source(args):
    """The checkpoint to resume from: --resume PATH, the --checkpoint-dir (bare --resume,
    or auto when it holds one), or None (start fresh)."""
    if args.resume is True or (args.resume == AUTO and is_checkpoint(args.checkpoint_dir)):
        return args.checkpoint_dir
    if isinstance(args.resume, str) and args.resume != AUTO:
        return args.resume
    return None


class HeldFlag(StopFlag):
    """The command's StopFlag: the Preemption callback's `restore` leaves it installed;
    `release` gives the previous handlers back."""

    def restore(self) -> None:
        pass

    def release(self) -> None:
        StopFlag.restore(self)


@contextmanager
def stop_signals(args):
    """With --checkpoint-dir, a HeldFlag installed for the block (else None). At its end the
    previous handlers come back, unless `args.exiting` (the process ends with the command's
    code): then SIGTERM/SIGUSR1 are ignored to the exit (SIG_IGN also outlives the
    interpreter's own handler teardown, which runs before MPI_Finalize)."""
    flag = HeldFlag().install() if args.checkpoint_dir is not None else None
    try:
        yield flag
    finally:
        if flag is not None and getattr(args, "exiting", False):
            for signum in flag.signals:
                signal.signal(signum, signal.SIG_IGN)
            flag.previous.clear()
        elif flag is not None:
            flag.release()


def preempted_before_training(trainer, flag, args) -> bool:
    """Collective when `flag` is not None: did any rank get a stop signal before the first
    step (data loading, engine build, resume)? One bounded any_rank; on a stop rank 0 prints
    the Preempted line: saved when the run resumed from --checkpoint-dir, else nothing to save."""
    signum = any_rank(trainer.engine.comm, flag.signum) if flag is not None else 0
    if signum and world_rank() == 0:
        step = trainer.state.step
        saved = step > 0 and resume_source(args) == args.checkpoint_dir
        write_line(f"{PROG}: {Preempted(signum, step, saved)}")     # one write (health/lines.py)
    return bool(signum)


def add_cluster_callbacks(args, trainer, saver, flag=None) -> None:
    """The metrics stream (after `saver`, the Checkpointer or None) and, with a checkpoint
    directory, the preemption callback (last, after every other) on `flag` (default: a
    StopFlag of its own, installed while `fit` runs)."""
    sinks = [cls(path) for cls, path in ((JsonlSink, args.metrics_jsonl),
                                         (CsvSink, args.metrics_csv),
                                         (TensorBoardSink, args.tensorboard)) if path]
    if sinks:
        trainer.callbacks.append(MetricsStream(sinks, saver))
    if saver is not None:
        trainer.callbacks.append(Preemption(flag or StopFlag(), saver, args.preempt_check_every))


def fit_or_preempted(trainer, args):
    """trainer.fit(); None after an agreed preemption stop (rank 0 printed why; the metrics
    sinks, whose on_train_end the stop skipped, synced and closed: a TensorBoard writer's
    buffered scalars are written). The stop signals' handlers are this run's only while it
    runs (an in-process caller keeps its own)."""
    try:
        return trainer.fit(metrics_path=args.metrics_json)
    except Preempted as stop:
        for cb in trainer.callbacks:
            if isinstance(cb, MetricsStream):
                cb.on_train_end(trainer, {})
        if world_rank() == 0:
            write_line(f"{PROG}: {stop}")
        return None
    finally:
        for cb in trainer.callbacks:
            if isinstance(cb, Preemption):
                cb.flag.restore()


__all__ = ["AUTO", "CLUSTER_DEFAULTS", "PREEMPTED_EXIT", "HeldFlag", "add_cluster_callbacks",
           "add_metrics_arguments", "add_resume_argument", "fit_or_preempted",
           "preempted_before_training", "resume_source", "stop_signals", "validate_cluster_args"]

"""`python -m mpi4py tests/hpc/held_train.py DIR HOLD train ...`: `python -m mpishard train ...`
that writes each rank's exit code to DIR/exit.<rank> (a rank killed by a signal writes none)
and, with HOLD a name in mpishard.cli.train (make_engine, resume; "-": none), waits on entry to
that function: it writes DIR/ready.<rank> and returns to the build once DIR/go exists. A test
signals the ranks while they are held: inside the engine build or the resume, deterministically.

HOLD `step:N` holds the ranks mid-run instead: after step N's callbacks (its metrics record
written, its preemption check done) each rank writes DIR/ready.<rank> and waits for DIR/go,
writing DIR/signalled.<rank> once the stop flag holds a signal meanwhile, so a test knows the
signal has reached the rank before it lets the run go on (the stop then comes at step N + 1).
A run that finds DIR/go already there (a restart, a resumed run) does not wait; a rank that
waits 300 s for it exits (3), so a test that failed before writing it leaves no job behind.
"""
import os
import sys
import time

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpishard.cli.train as train  # noqa: E402
from mpishard.__main__ import run  # noqa: E402
from mpishard.train.preemption import Preemption  # noqa: E402
from mpishard.train.trainer import Callback  # noqa: E402

where, hold = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
rank = MPI.COMM_WORLD.Get_rank()
GO = os.path.join(where, "go")


def touch(name):
    open(os.path.join(where, f"{name}.{rank}"), "w").close()


def wait_for_go(poll=lambda: None, limit=300.0):
    """Until DIR/go exists; a test that failed without writing it leaves no job behind: the
    rank exits (3) after `limit` seconds."""
    deadline = time.monotonic() + limit
    while not os.path.exists(GO):
        poll()
        if time.monotonic() > deadline:
            print(f"held_train: no {GO} in {limit:.0f} s, exiting", file=sys.stderr, flush=True)
            os._exit(3)
        time.sleep(0.01)


def held(original):
    def wait_then_run(*args, **kwargs):
        touch("ready")
        wait_for_go()
        return original(*args, **kwargs)
    return wait_then_run


class HoldAt(Callback):
    """After step `step` (the last callback): wait for DIR/go unless it exists already."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, trainer) -> None:
        if trainer.state.step != self.step or os.path.exists(GO):
            return
        flags = [cb.flag for cb in trainer.callbacks if isinstance(cb, Preemption)]
        touch("ready")
        told = []

        def tell():
            if not told and any(f.signum for f in flags):
                touch("signalled")
                told.append(True)
        wait_for_go(tell)


def holding_at(step, build):
    def build_then_hold(*args, **kwargs):
        trainer = build(*args, **kwargs)
        trainer.callbacks.append(HoldAt(step))
        return trainer
    return build_then_hold


if hold.startswith("step:"):
    train.build_training = holding_at(int(hold[len("step:"):]), train.build_training)
elif hold != "-":
    setattr(train, hold, held(getattr(train, hold)))
try:
    run()
except SystemExit as exc:
    with open(os.path.join(where, f"exit.{rank}"), "w") as f:
        f.write(str(exc.code))
    raise

"""engine.trace(DIR): record this engine's compute, communication and pipeline spans on every
rank and write one merged Chrome/Perfetto trace, DIR/trace.json (health/trace.py).

    with engine.trace("runs/trace"):          # collective: enter and leave on every rank
        for step in range(3):
            loss, grads = engine.train_step(x, t, "mse")
            opt.step(grads)

or `tr = engine.trace(DIR); tr.start(); ...; path = tr.stop()`. Starting aligns the ranks'
clocks against rank 0 (a few ping-pongs) and attaches one Tracer to the engine's Comm
statistics (every collective and send), its watchdog (time blocked in each wait, per group)
and its runner (a span per layer or block, the loss, pipeline actions F/B/W and waits); the
optimizer reads it from the Comm statistics. Stopping detaches it and writes the file.
Open it at https://ui.perfetto.dev (or chrome://tracing); `python -m mpishard trace-summary
DIR` prints compute / comm / idle per rank.
"""
from __future__ import annotations

from ..health.trace import Tracer


class Trace:
    """Start/stop (or a `with` block) of one engine's trace into `directory`."""

    def __init__(self, comm, runner, world, directory, meta=None):
        self.comm, self.runner, self.world = comm, runner, world
        self.directory = str(directory)
        self.meta = dict(meta or {})           # written into the file's otherData
        self.tracer = None
        self.path = None

    def start(self) -> "Trace":
        """Collective: align clocks, attach the tracer."""
        if self.tracer is not None:
            raise RuntimeError("this trace is already running")
        tracer = Tracer(self.world.Get_rank())
        tracer.align_clock(self.world)
        self.comm.stats.tracer = self.comm.watchdog.tracer = self.runner.tracer = tracer
        self.tracer = tracer
        return self

    def stop(self) -> str:
        """Collective: detach the tracer and write DIR/trace.json; returns its path."""
        if self.tracer is None:
            raise RuntimeError("this trace is not running")
        self.comm.stats.tracer = self.comm.watchdog.tracer = self.runner.tracer = None
        self.path = self.tracer.write(self.world, self.directory, self.meta)
        self.tracer = None
        return self.path

    def __enter__(self):
        return self.start()

    def __exit__(self, kind, value, tb):
        if kind is None:
            self.stop()
        else:                                  # an error: detach, write nothing (no collective)
            self.comm.stats.tracer = self.comm.watchdog.tracer = self.runner.tracer = None
            self.tracer = None
        return False


def trace_engine(engine, directory) -> Trace:
    """`engine.trace(DIR)`: a Trace of the engine's Comm and runner (start it, or use `with`)."""
    return Trace(engine.comm, engine.runner, engine.mpi_comm, directory,
                 meta={"layout": engine.layout.text})

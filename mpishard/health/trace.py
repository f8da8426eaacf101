"""A per-rank trace of a run: compute, communication and pipeline spans, merged into one
Chrome/Perfetto JSON (open it at https://ui.perfetto.dev or chrome://tracing).

A `Tracer` collects spans as plain tuples (name, category, track, start, end, args) on this
rank's `time.perf_counter` clock. Nothing records unless a tracer is attached: the hooks are one
`if tracer is None` test per call (CommStats.count, the watchdog's waits, the runners' layer
loops, the optimizer step). Categories:

    compute   a layer's (or block's) forward / backward / backward_input / backward_weights,
              the loss, the optimizer step
    action    a pipeline action F/B/W (microbatch, chunk): its compute, around the layer spans
    comm      a collective or a send: op, group, bytes; `blocked_s` is the time spent in the
              MPI wait (peers arriving late + the transfer itself), `local_s` the rest
              (staging, packing, reduction copies)
    wait      a pipeline stage blocked on a neighbour's message (idle)

Tracks in the merged file: pid = rank ("rank 3"), tid 0 compute and pipeline actions (layer
spans nest inside their action), tid 1 communication, tid 2 waits.

Clocks: at `start` every rank measures its offset to rank 0 with a few ping-pongs
(`align_clock`: the round with the smallest round trip, offset = rank 0's time - the midpoint
of the round), so the merged timestamps share rank 0's clock to about half a round trip.
`write` (collective) saves each rank's spans, then rank 0 merges them into DIR/trace.json.
"""
from __future__ import annotations

import json
import os
import time

TRACKS = {"compute": 0, "action": 0, "comm": 1, "wait": 2}
TRACE_FILE = "trace.json"
PING_ROUNDS = 8


class Tracer:
    """This rank's spans; `offset` (seconds) maps its clock onto rank 0's."""

    def __init__(self, rank: int):
        self.rank = rank
        self.events: list = []
        self.offset = 0.0
        self.origin = time.perf_counter()      # rank 0's start, on rank 0's clock, after start
        self._blocked = None          # (group, seconds, end) of the last watchdog wait

    # -- recording -----------------------------------------------------------------------------
    def span(self, name, cat, t0, t1=None, **args) -> None:
        """A finished span from t0 to t1 (default: now), perf_counter seconds."""
        self.events.append((name, cat, t0, time.perf_counter() if t1 is None else t1, args))

    def blocked(self, group: str, seconds: float) -> None:
        """The watchdog waited `seconds` for a request on `group` (read by the next comm)."""
        self._blocked = (group, seconds, time.perf_counter())

    def comm(self, kind, nbytes, t0) -> None:
        """A communication call that started at t0 and ends now (CommStats.count)."""
        t1 = time.perf_counter()
        group, blocked, end = self._blocked or ("", 0.0, 0.0)
        if end < t0:                           # that wait belonged to an uncounted receive
            group, blocked = "", 0.0
        self._blocked = None
        blocked = min(blocked, t1 - t0)
        self.events.append((kind, "comm", t0, t1, {
            "bytes": int(nbytes), "group": group, "blocked_s": blocked,
            "local_s": (t1 - t0) - blocked}))

    def layers_forward(self, layers, x, mb, record):
        """Forward through `layers`, one compute span each (the traced runner loop)."""
        for layer in layers:
            t0 = time.perf_counter()
            x = layer.forward(x, mb, record)
            self.span(f"{layer!r} forward", "compute", t0, mb=mb)
        return x

    def layers_backward(self, layers, dy, mb, method="backward"):
        """`method` ('backward' or 'backward_input') of `layers` in reverse, spans each."""
        for layer in reversed(layers):
            t0 = time.perf_counter()
            dy = getattr(layer, method)(dy, mb)
            self.span(f"{layer!r} {method}", "compute", t0, mb=mb)
        return dy

    def layers_weights(self, layers, mb) -> None:
        """backward_weights (a zero-bubble W) of `layers`, spans each."""
        for layer in reversed(layers):
            t0 = time.perf_counter()
            layer.backward_weights(mb)
            self.span(f"{layer!r} backward_weights", "compute", t0, mb=mb)

    # -- clocks and output ---------------------------------------------------------------------
    def align_clock(self, world) -> None:
        """Collective on the mpi4py communicator `world`: offset to rank 0's clock and the
        common origin (rank 0's time now). Small control messages (pickled floats)."""
        rank, size = world.Get_rank(), world.Get_size()
        if rank == 0:
            for peer in range(1, size):
                for _ in range(PING_ROUNDS):
                    world.recv(source=peer, tag=7)
                    world.send(time.perf_counter(), dest=peer, tag=7)
        else:
            best = None
            for _ in range(PING_ROUNDS):
                t_send = time.perf_counter()
                world.send(None, dest=0, tag=7)
                remote = world.recv(source=0, tag=7)
                t_recv = time.perf_counter()
                if best is None or t_recv - t_send < best[0]:
                    best = (t_recv - t_send, remote - (t_send + t_recv) / 2)
            self.offset = best[1]
        self.origin = world.bcast(time.perf_counter() if rank == 0 else None, root=0)

    def chrome_events(self) -> list:
        """This rank's spans as Chrome trace 'X' events (microseconds from the origin)."""
        out = [{"name": "process_name", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {"name": f"rank {self.rank}"}},
               {"name": "process_sort_index", "ph": "M", "pid": self.rank, "tid": 0,
                "args": {"sort_index": self.rank}}]
        out += [{"name": "thread_name", "ph": "M", "pid": self.rank, "tid": tid,
                 "args": {"name": name}}
                for tid, name in ((0, "compute"), (1, "comm"), (2, "wait"))]
        shift = self.offset - self.origin
        for name, cat, t0, t1, args in self.events:
            out.append({"name": name, "cat": cat, "ph": "X", "pid": self.rank,
                        "tid": TRACKS[cat], "ts": round((t0 + shift) * 1e6, 3),
                        "dur": round((t1 - t0) * 1e6, 3), "args": args})
        return out

    def write(self, world, directory, meta=None) -> str:
        """Collective: every rank saves its events, rank 0 merges DIR/trace.json; `meta` (a
        dict: the layout, ...) goes into its otherData."""
        rank = world.Get_rank()
        if rank == 0:
            os.makedirs(directory, exist_ok=True)
        world.Barrier()
        part = os.path.join(directory, f"trace-rank{rank}.json")
        with open(part, "w") as f:
            json.dump(self.chrome_events(), f)
        world.Barrier()
        path = os.path.join(directory, TRACE_FILE)
        if rank == 0:
            events = []
            for r in range(world.Get_size()):
                name = os.path.join(directory, f"trace-rank{r}.json")
                with open(name) as f:
                    events += json.load(f)
                os.remove(name)
            with open(path, "w") as f:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                           "otherData": {"clock": "rank 0 perf_counter, ping-pong aligned",
                                         **(meta or {})}}, f)
        world.Barrier()
        return path

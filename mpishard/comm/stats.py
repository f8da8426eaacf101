"""Per-rank communication counters: bytes sent, calls and seconds per kind; and the hook of
a trace (health/trace.py): with `tracer` set, every counted call is also a trace span."""
from __future__ import annotations

import time
from collections import defaultdict


class CommStats:
    """Bytes sent, calls and seconds per communication kind (one rank's view); a kind never
    used reads 0. `count` runs on every call, so it updates one list per kind ([calls, bytes,
    seconds]); `bytes`, `calls` and `time` are built from them when read."""

    def __init__(self):
        self.kinds: dict = {}                  # kind -> [calls, bytes, seconds]
        self.tracer = None                     # a health.trace.Tracer while tracing

    def count(self, kind, nbytes, t0) -> None:
        dt = time.perf_counter() - t0
        try:
            k = self.kinds[kind]
        except KeyError:
            k = self.kinds[kind] = [0, 0, 0.0]
        k[0] += 1
        k[1] += int(nbytes)
        k[2] += dt
        if self.tracer is not None:
            self.tracer.comm(kind, nbytes, t0)

    def _column(self, i: int, zero) -> defaultdict:
        return defaultdict(type(zero), {kind: k[i] for kind, k in self.kinds.items()})

    calls = property(lambda self: self._column(0, 0), doc="calls per kind")
    bytes = property(lambda self: self._column(1, 0), doc="bytes sent per kind")
    time = property(lambda self: self._column(2, 0.0), doc="seconds per kind")

    def reset(self) -> None:
        self.kinds.clear()

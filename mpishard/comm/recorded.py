"""The hook through which a recorder hears each communication call of a Comm.

Every entry point (all_reduce, reduce_scatter, all_gather, all_to_all(_v), broadcast, barrier,
agree, send/receive and their `_async` forms) is decorated with `recorded`. When the Comm holds
a recorder (`comm.flight`: health/flight.py's FlightRecorder, which the engine passes in), each
outermost call is one event: `recorder.enter(comm, op, arr, group, peer)` before the call,
`recorder.leave(event)` after it returned (not when it raised: the event stays open). Without a
recorder the call goes straight through. A call made inside another recorded call (receive
inside receive_async's wrapper) is not recorded twice: `recorder.depth` is 1 meanwhile.
"""
from __future__ import annotations

import functools
import inspect

PEER_ARGS = ("dest_id", "src_id", "target_device_id", "dest", "dst")   # a send's or receive's


def recorded(method):
    """`method`, an entry point of the Comm, telling the Comm's recorder of each outermost call:
    its array (`arr`), its `group` and, for a send or a receive, its peer (the group rank)."""
    name = method.__name__
    params = list(inspect.signature(method).parameters)[1:]
    a_at, g_at = (params.index(p) if p in params else 99 for p in ("arr", "group"))
    peers = [(p, params.index(p)) for p in PEER_ARGS if p in params]

    def peer_of(args, kwargs):
        for p, i in peers:
            v = kwargs[p] if p in kwargs else args[i] if i < len(args) else None
            if v is not None:
                return int(v)
        return None

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        rec = self.flight
        if rec is None or rec.depth:
            return method(self, *args, **kwargs)
        n = len(args)
        try:
            event = rec.enter(self, name,
                              kwargs["arr"] if "arr" in kwargs else args[a_at] if a_at < n
                              else None,
                              kwargs["group"] if "group" in kwargs else args[g_at] if g_at < n
                              else None, peer_of(args, kwargs) if peers else None)
        except Exception:                  # a bad group or a closed Comm: the call says why
            return method(self, *args, **kwargs)
        rec.depth = 1
        try:
            out = method(self, *args, **kwargs)
        finally:
            rec.depth = 0
        rec.leave(event)
        return out
    return call

"""Between the HTTP front (asyncio, rank 0) and the decode loop (rank 0's main thread).

    intake = Intake(max_queue=64)
    ticket = intake.submit(ids, params)      # HTTP side; QueueFull / Draining when refused
    token, finish = await ticket.get()       # one (id, None) per new token; the last carries
                                             # finish: "stop" (an eos id), "length" (max_tokens
                                             # or the model's length), "abort" (drained)
    ticket.cancel()                          # a disconnect or a matched stop string

    joins, cancels = intake.take(free)       # loop side, at a step boundary: at most `free`
    intake.deliver(rid, token, finish)       # requests, oldest first, and the rids cancelled

The loop thread never awaits: `deliver` hands each event to the ticket's asyncio loop with
call_soon_threadsafe. `wait(timeout)` lets an idle loop sleep until a request or a cancel
arrives (the heartbeat of serve/loop.py bounds it). Nothing here talks MPI.
"""
from __future__ import annotations

import asyncio
import itertools
import threading
from collections import deque


class QueueFull(Exception):
    """max_queue requests wait beyond the slots the next step frees: answer 429 with
    Retry-After."""

    def __init__(self, waiting: int, retry_after: float = 1.0):
        super().__init__(f"the server's queue is full ({waiting} requests waiting)")
        self.retry_after = retry_after


class Draining(Exception):
    """The server is shutting down (SIGTERM, or the SIGUSR1 launch forwards): answer 503."""


class Ticket:
    """One request as the HTTP side holds it: its id, its events, and a way to cancel it."""

    def __init__(self, intake, rid: int, ids: list, params: dict, loop):
        self.intake, self.rid, self.ids, self.params = intake, rid, list(ids), dict(params)
        self.loop = loop
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished = False

    async def get(self) -> tuple:
        """The next (token id, finish reason or None); a None token comes with "abort" only
        when the row ended before its first token."""
        return await self.events.get()

    def cancel(self) -> None:
        """Ask the loop to drop the row at its next step (idempotent)."""
        if not self.finished:
            self.finished = True
            self.intake.cancel(self.rid)


class Intake:
    """Thread-safe queue of requests waiting for a slot, and of cancellations."""

    def __init__(self, max_queue: int):
        self.max_queue = int(max_queue)
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._waiting: deque = deque()
        self._cancelled: list = []
        self._tickets: dict = {}
        self._ids = itertools.count(1)
        self.draining = False
        self.free = 0                    # slots free after the last step (the loop sets it)

    def submit(self, ids: list, params: dict) -> Ticket:
        """Queue a request (from inside the HTTP server's event loop)."""
        loop = asyncio.get_running_loop()
        with self._lock:
            if self.draining:
                raise Draining("the server is shutting down and accepts no new requests")
            if len(self._waiting) >= self.max_queue + self.free:   # a request for a free
                raise QueueFull(len(self._waiting))                # slot waits a step only
            ticket = Ticket(self, next(self._ids), ids, params, loop)
            self._tickets[ticket.rid] = ticket
            self._waiting.append(ticket)
            self._arrived.notify_all()
        return ticket

    def cancel(self, rid: int) -> None:
        with self._lock:
            self._cancelled.append(rid)
            self._arrived.notify_all()

    @property
    def depth(self) -> int:
        """Requests waiting for a slot."""
        return len(self._waiting)

    def drain(self) -> None:
        """Refuse new requests from now on (in-flight ones run on)."""
        with self._lock:
            self.draining = True
            self._arrived.notify_all()

    def wait(self, timeout: float) -> None:
        """Sleep until a request, a cancel or a drain arrives, at most `timeout` seconds."""
        with self._lock:
            if not (self._waiting or self._cancelled or self.draining):
                self._arrived.wait(timeout)

    def take(self, free: int) -> tuple:
        """(tickets to admit now, oldest first, at most `free`; rids cancelled since the last
        call). A request cancelled while it waited is dropped here, never admitted."""
        with self._lock:
            cancels, self._cancelled = set(self._cancelled), []
            kept = deque(t for t in self._waiting if t.rid not in cancels)
            dropped = [t for t in self._waiting if t.rid in cancels]
            self._waiting = kept
            joins = [self._waiting.popleft() for _ in range(min(free, len(self._waiting)))]
        for t in dropped:
            self.deliver(t.rid, None, "abort")
        return joins, sorted(cancels - {t.rid for t in dropped})

    def deliver(self, rid: int, token, finish) -> None:
        """Hand (token, finish) to the request's ticket (from the loop thread); the ticket is
        forgotten after its last event."""
        with self._lock:
            ticket = self._tickets.get(rid) if finish is None else self._tickets.pop(rid, None)
        if ticket is not None:
            try:
                ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, (token, finish))
            except RuntimeError:         # its event loop has closed: nobody is listening
                pass

    def abort_waiting(self) -> None:
        """End every request still waiting for a slot with "abort" (the drain's grace is up)."""
        with self._lock:
            waiting, self._waiting = list(self._waiting), deque()
        for t in waiting:
            self.deliver(t.rid, None, "abort")

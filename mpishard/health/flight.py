"""The flight recorder: each rank's last N communication calls, dumped when the job goes wrong.

Every call of a Comm's communication entry points (all_reduce, reduce_scatter, all_gather,
all_to_all(_v), broadcast, barrier, agree, send/receive and their `_async` forms: the engine
passes the recorder to its Comm, whose entry points tell it through comm/recorded.py's hook,
`enter` and `leave`) is one event in a ring of the last N (default EVENTS = 256; the
environment's MPISHARD_FLIGHT_EVENTS, 0: off): the op, the group (its name and COMM_WORLD
ranks), the call's sequence number on that group (1, 2, ... per process: the k-th collective on
a group is the same call on every member of a correct program; point-to-point calls count per
peer and direction instead), the peer of a send/receive, the array's bytes, dtype and shape,
the wall-clock enter and exit times (exit None: still inside, or it raised), the step and
microbatch (Comm.context) and the seconds the process had waited on peers in sends and receives
so far (`note_peer_wait`). A call made inside another recorded call (receive inside
receive_async's wrapper) is not recorded twice. Recording costs two clock reads and a list
store per call (docs/reliability.md has the measured overhead); nothing is communicated.

Dumps: `FlightRecorder.dump(reason)` writes DIR/flight-rank<R>.json (the ring, oldest first, the
group table, and after a timeout what its arrival counters found: `note_arrivals`) and
DIR/flight-rank<R>.stacks.txt (every thread's Python stack, by faulthandler), each written to a
temporary name and renamed, so a dump cut short by the abort is absent rather than torn. DIR is
set by `redirect` (train --flight-dir: cli/flight_options.py; a library user calls
`engine.comm.flight.redirect(DIR)` or sets MPISHARD_FLIGHT_DIR): until then nothing is dumped.
It is called by the guard thread on a collective timeout (before the abort), by a polled
CollectiveTimeout, by the uncaught-exception hook and the CLI's abort, and on SIGUSR2 (the rank
goes on; the handler is installed by `redirect`). A fatal signal (SIGSEGV, SIGABRT, ...) writes
the stacks alone to DIR/flight-rank<R>.fatal.txt (faulthandler; removed at a clean exit, and at
a dump, when empty). A directory `redirect` made holds the empty marker MADE: at its clean exit
every rank (not only the one that made it: the others' fatal files may still be open then)
removes DIR when the marker is all that is left in it, so a clean run leaves no empty DIR
whichever rank exits last, and a directory the user made is never removed. A rank that is not in
a bounded wait when the job aborts (asleep, in a loop, past its last collective) is killed
before it can dump: `python -m mpishard flight DIR` (cli/flight.py) reasons from the dumps there
are.
"""
from __future__ import annotations

import atexit
import faulthandler
import json
import os
import signal
import socket
import threading
import time

from mpi4py import MPI

EVENTS = 256
ENV = "MPISHARD_FLIGHT_EVENTS"
DIR_ENV = "MPISHARD_FLIGHT_DIR"
# op, group id, sequence number, peer (world rank) or None, bytes, dtype, shape, enter, exit,
# step, microbatch, the seconds this process had waited on peers' sends and receives at enter
FIELDS = ("op", "group", "seq", "peer", "bytes", "dtype", "shape", "enter", "exit", "step",
          "microbatch", "peer_wait")
P2P = {"send": "send", "send_async": "send", "receive": "recv", "receive_async": "recv"}
MADE = ".mpishard-made"     # in a flight directory that `redirect` made (module docstring)


def file_name(rank: int, kind: str) -> str:
    """flight-rank<R>.json ('json'), .stacks.txt ('stacks') or .fatal.txt ('fatal')."""
    return f"flight-rank{rank}." + {"json": "json", "stacks": "stacks.txt",
                                    "fatal": "fatal.txt"}[kind]


class FlightRecorder:
    """This process's ring of communication events (module docstring); one per process,
    shared by its engines (`shared()`), so one dump holds them all."""

    SHARED = None

    def __init__(self, size: int = EVENTS, rank: int | None = None):
        self.size = int(size)
        self.ring: list = [None] * self.size
        self.count = 0                      # events recorded (the ring holds the last size)
        self.depth = 0                      # > 0 inside a recorded call
        self.seq: dict = {}                 # group id or (group id, direction, peer) -> count
        self.groups: dict = {}              # id(mpi comm) -> (comm, group id)
        self.views: dict = {}               # (view's group, call's group) -> (its Comm's
                                            # _by_group, group id): one lookup per call
        self.table: list = []               # group id -> {"name", "ranks"}
        self.rank = MPI.COMM_WORLD.Get_rank() if rank is None else rank
        self.directory = None               # where dumps go (None: no dumps; redirect)
        self.dumped = None                  # the reason of the first dump
        self.fatal = None                   # the open fatal-signal file (redirect)
        self.made: list = []                # the directories this process's redirect made
        self.arrivals = None                # the last timeout's arrival counts (note_arrivals)
        self.peer_wait = 0.0                # seconds blocked on sends and receives, in all

    @classmethod
    def shared(cls):
        """The process's recorder (made on first use; redirected to MPISHARD_FLIGHT_DIR when
        that is set), or None when MPISHARD_FLIGHT_EVENTS is 0."""
        if cls.SHARED is None:
            size = int(os.environ.get(ENV, EVENTS))
            if size <= 0:
                return None
            cls.SHARED = cls(size)
            if os.environ.get(DIR_ENV):
                cls.SHARED.redirect(os.environ[DIR_ENV])
        return cls.SHARED

    # -- recording ---------------------------------------------------------------------------
    def group_id(self, comm, watchdog) -> int:
        """The id of the group of the mpi4py communicator `comm` in this recorder's table."""
        found = self.groups.get(id(comm))
        if found is not None and found[0] is comm:
            return found[1]
        mine, world = comm.Get_group(), MPI.COMM_WORLD.Get_group()
        ranks = MPI.Group.Translate_ranks(mine, list(range(comm.Get_size())), world)
        mine.Free()
        world.Free()
        entry = {"name": watchdog.group(comm)[2], "ranks": [int(r) for r in ranks]}
        gid = next((i for i, e in enumerate(self.table) if e == entry), None)
        if gid is None:
            gid = len(self.table)
            self.table.append(entry)
        self.groups[id(comm)] = (comm, gid)
        return gid

    def enter(self, host, op, arr, group, peer) -> list:
        """Record the start of `op` by the Comm `host` on `group`; returns the event (a list:
        FIELDS, the dtype kept as numpy's until a dump)."""
        key = (host.default_group, group)
        found = self.views.get(key)
        if found is None or found[0] is not host._by_group:
            found = self.views[key] = (host._by_group, self.group_id(host._mpi(group),
                                                                      host.watchdog))
        gid = found[1]
        if peer is None:
            key = gid
        else:
            ranks = self.table[gid]["ranks"]
            peer = ranks[peer] if 0 <= peer < len(ranks) else peer
            key = (gid, P2P[op], peer)
        seq = self.seq[key] = self.seq.get(key, 0) + 1
        where = host.watchdog.where
        try:
            nbytes, dtype, shape = arr.nbytes, arr.dtype, arr.shape
        except AttributeError:              # None (broadcast off root), a list, no array
            nbytes = dtype = shape = None
        event = [op, gid, seq, peer, nbytes, dtype, shape, time.time(), None,
                 where.get("step"), where.get("microbatch"), self.peer_wait]
        self.ring[self.count % self.size] = event
        self.count += 1
        return event

    def leave(self, event) -> None:
        """Record the end of the call of `event` (it returned)."""
        event[8] = time.time()

    def events(self) -> list:
        """The ring, oldest first, as dicts."""
        n = min(self.count, self.size)
        start = self.count - n
        out = []
        for i in range(start, self.count):
            e = dict(zip(FIELDS, self.ring[i % self.size]))
            e["bytes"] = int(e["bytes"] or 0)
            e["dtype"] = None if e["dtype"] is None else str(e["dtype"])
            e["shape"] = None if e["shape"] is None else [int(d) for d in e["shape"]]
            out.append(e)
        return out

    # -- dumps -------------------------------------------------------------------------------
    def dump(self, reason: str, again: bool = False):
        """Write the ring and every thread's stack (module docstring); returns the JSON path,
        or None when it was not written: no directory set (`redirect`), or after a first
        failure dump unless `again` (SIGUSR2's look at a live rank: it does not count as the
        first, so the failure that comes later still dumps)."""
        if self.dumped is not None and not again or self.directory is None:
            return None
        if not again:
            self.dumped = reason
        directory = self.directory
        try:
            os.makedirs(directory, exist_ok=True)
            path = os.path.join(directory, file_name(self.rank, "json"))
            record = {"rank": self.rank, "world_size": MPI.COMM_WORLD.Get_size(),
                      "host": socket.gethostname(), "pid": os.getpid(), "reason": reason,
                      "time": time.time(), "recorded": self.count,
                      "dropped": max(0, self.count - self.size), "groups": self.table,
                      "arrivals": self.arrivals, "events": self.events()}
            with open(path + ".tmp", "w") as f:
                json.dump(record, f)
            os.replace(path + ".tmp", path)
            stacks = os.path.join(directory, file_name(self.rank, "stacks"))
            with open(stacks + ".tmp", "w") as f:
                f.write(f"rank {self.rank} (pid {os.getpid()}): {reason}\n")
                f.flush()
                faulthandler.dump_traceback(f, all_threads=True)
            os.replace(stacks + ".tmp", stacks)
            if not again:                   # the job is ending: no empty fatal file left
                self.close_fatal()
            return path
        except OSError:
            return None

    def redirect(self, directory) -> None:
        """Dumps go to `directory` from now on (none are written before: a library user opts
        in here or with MPISHARD_FLIGHT_DIR; train always does); SIGUSR2 (when called from the
        main thread) dumps and goes on; a fatal signal writes the stacks to the fatal file."""
        if self.directory is None:
            atexit.register(self.clean_exit)
            if threading.current_thread() is threading.main_thread():
                signal.signal(signal.SIGUSR2, lambda signum, frame: self.dump("SIGUSR2", True))
        self.directory = os.path.abspath(os.fspath(directory))
        self.close_fatal()
        created = not os.path.isdir(self.directory)
        try:
            os.makedirs(self.directory, exist_ok=True)
            if created:                     # every rank's clean exit may remove it (MADE)
                open(os.path.join(self.directory, MADE), "a").close()
                self.made.append(self.directory)
            self.fatal = open(os.path.join(self.directory, file_name(self.rank, "fatal")), "w")
            faulthandler.enable(self.fatal, all_threads=True)
        except OSError:
            self.fatal = None

    def close_fatal(self) -> None:
        """Stop writing fatal-signal stacks to the file; remove it when nothing was written."""
        if self.fatal is None:
            return
        faulthandler.disable()
        name = self.fatal.name
        self.fatal.close()
        self.fatal = None
        if os.path.exists(name) and os.path.getsize(name) == 0:
            os.unlink(name)

    def clean_exit(self) -> None:
        """At exit: close the fatal file, and remove the directory a `redirect` (this rank's
        or another's: MADE) made when nothing else is left there (no empty CKPT.flight left
        beside every run, whichever rank exits last)."""
        self.close_fatal()
        for directory in dict.fromkeys(self.made + [self.directory]):
            if directory is None:               # never redirected: os.listdir(None) is the cwd
                continue
            try:
                if os.listdir(directory) == [MADE]:
                    os.unlink(os.path.join(directory, MADE))
                    os.rmdir(directory)         # fails, as it should, if a file came meanwhile
            except OSError:                     # another rank was first, or a file is there
                pass


def note_arrivals(found: dict) -> None:
    """What a timeout's arrival counters found (watchdog.py: the group's name and ranks, and
    the other members that were late, had entered, or did not answer), for the process's next
    dump: `flight` reads it, so its verdict and the timeout line agree."""
    if FlightRecorder.SHARED is not None:
        FlightRecorder.SHARED.arrivals = found


def note_peer_wait(seconds: float) -> None:
    """A send's or receive's wait on its peer blocked `seconds` (watchdog.wait_peer): the
    straggler line tells a rank that waited on its pipeline neighbour from a slow one."""
    if FlightRecorder.SHARED is not None:
        FlightRecorder.SHARED.peer_wait += seconds


def dump_all(reason: str) -> None:
    """The process's recorder, if any, dumps (the hooks of the module docstring)."""
    if FlightRecorder.SHARED is not None:
        FlightRecorder.SHARED.dump(reason)

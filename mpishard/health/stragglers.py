"""Stragglers: a rank that is consistently the last to arrive at the collectives.

From the flight recorder's events (flight.py): for one collective, no member leaves before the
last one has arrived, and the members leave at about the same moment, so member r's wait
w_r = exit_r - enter_r is how long before the last arrival it came: the last to arrive waited
least. Only durations on each rank's own clock are used (no clocks compared between ranks).
Per collective that every member of its group completed in the window: the last rank (the
least wait) and its margin, the second-least wait minus the least (how long after the
previous member it came). A collective has a late rank when that margin is MIN_MARGIN or more
(back-to-back collectives, where the members arrive together, have none).

Only collectives on groups within one pipeline stage count (groups that do not vary along pp):
on a group that spans stages the members arrive in the order of the pipeline's schedule (the
first stage finishes its backward last), which is no slow rank, so a healthy pipeline prints
nothing; a slow rank still stands out among the members of its own stage (its dp, tp, ...
peers). A rank's wait counts all it waited on others since its previous compared collective
too (in sends, receives and collectives across stages: `waits`), so the rank whose pipeline
neighbour is slow, late in its own stage's groups for having waited for that neighbour, is not
named in its place. With pp alone (no group inside a stage) no rank can stand out.

Rule: a rank stands out when the window holds at least MIN_CALLS collectives with a late rank
among those it took part in, and it was the late rank in at least SHARE of them. Then one
line, `rank 3 arrived last in 87% of collectives (52 of 60 with a late rank), median +41 ms`;
nothing when no rank stands out (in a balanced job the late ranks are spread over the
members). The window is the events recorded since the last report that the ring still holds
(flight.EVENTS per rank).

`report(comm, recorder, since)` is collective (one gather of control data to rank 0, bounded
by the engine's timeout: objects.py); the Trainer calls it every --log-every steps
(cli/flight_options.py).
"""
from __future__ import annotations

import statistics

from ..comm.objects import gather_json

SHARE = 0.75          # the late rank of at least this fraction of its collectives with one
MIN_CALLS = 8         # collectives with a late rank it took part in, at least
MIN_MARGIN = 1e-3     # seconds after the previous arrival: a collective's rank is late


def spans_stages(name: str, active_axes) -> bool:
    """Whether the group `name` (the watchdog's: 'world', 'self' or its axes joined by '+')
    of a mesh with `active_axes` has members in more than one pipeline stage."""
    return "pp" in (active_axes if name == "world" else name.split("+"))


def waits(recorder, since: float, active_axes=()) -> list:
    """[group name, group ranks, sequence number, wait] of this rank's collectives on groups
    of two or more within one pipeline stage of a mesh with `active_axes` (module docstring)
    that entered after `since` (wall clock) and completed. The wait includes all the rank
    waited on others since the previous of those collectives: in sends and receives (the
    events' peer_wait) and in collectives across stages; so a rank late only because it
    waited for its pipeline neighbour (slow in another stage) is not taken for a slow one."""
    out, before, across = [], None, 0.0
    for e in recorder.events():
        if e["peer"] is not None:
            continue
        group = recorder.table[e["group"]]
        if len(group["ranks"]) < 2 or spans_stages(group["name"], active_axes):
            across += e["exit"] - e["enter"] if e["exit"] is not None else 0.0
            continue
        blocked = across + (e["peer_wait"] - before if before is not None else 0.0)
        before, across = e["peer_wait"], 0.0
        if e["exit"] is not None and e["enter"] > since:
            out.append([group["name"], group["ranks"], e["seq"],
                        e["exit"] - e["enter"] + blocked])
    return out


def last_arrivals(per_rank) -> tuple:
    """From every rank's (COMM_WORLD rank, `waits` list): ({rank: collectives with a late
    rank it took part in}, {rank: [margin of each collective it was the late rank of]}), over
    the collectives every member reported."""
    calls: dict = {}
    for rank, rows in per_rank:
        for name, ranks, seq, wait in rows:
            calls.setdefault((name, tuple(ranks), seq), {})[rank] = wait
    taken, last = {}, {}
    for (_, ranks, _), seen in calls.items():
        if set(seen) != set(ranks):
            continue                 # a member's ring no longer holds it, or it is not done
        order = sorted(seen, key=seen.get)
        margin = seen[order[1]] - seen[order[0]]
        if margin < MIN_MARGIN:
            continue                 # the members arrived together: no late rank
        for r in ranks:
            taken[r] = taken.get(r, 0) + 1
        last.setdefault(order[0], []).append(margin)
    return taken, last


def straggler(per_rank):
    """The line of the module docstring for the rank that stands out, or None."""
    taken, last = last_arrivals(per_rank)
    found = []
    for rank, margins in last.items():
        n, share = taken[rank], len(margins) / taken[rank]
        if n >= MIN_CALLS and share >= SHARE:
            found.append((share, rank, len(margins), n, statistics.median(margins)))
    if not found:
        return None
    share, rank, k, n, margin = max(found)
    return (f"rank {rank} arrived last in {share:.0%} of collectives ({k} of {n} with a late "
            f"rank), median +{margin * 1e3:.0f} ms")


def report(comm, recorder, since: float):
    """Collective: the straggler line on rank 0 (None elsewhere, and when none stands out)."""
    axes = comm.mesh.layout.active_axes
    mine = [recorder.rank, waits(recorder, since, axes)] if recorder is not None else [-1, []]
    gathered = gather_json(comm, mine, "straggler report")
    return straggler(gathered) if gathered is not None else None

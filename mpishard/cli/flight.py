"""`python -m mpishard flight DIR`: line up the ranks' flight-recorder dumps (health/flight.py) and
print the first point where they diverge. No MPI needed.

Alignment: a correct program makes the same collectives on a group in the same order on every
member, so the k-th collective on a group (its sequence number) is one call. For every group
(name and ranks) the dumped members' collectives are compared at each sequence number that all
their rings still hold; the first k where they differ is that group's divergence:

- the members' calls at k differ (op, dtype or shape): the odd ones out (fewer than the rest;
  every one when they split evenly) called something else;
- a member has not reached k: it never entered that collective (its own last event says where
  it is: still inside an earlier call, or outside communication since it left one);
- a member left no dump (killed by the abort while asleep, looping, stopped, or past its last
  collective): the arrival counters that the members waiting in that call read at their
  timeout (the dump's "arrivals", the same counts their timeout line printed) say whether it
  never entered the call or entered it and never left (stopped or hung inside it); without
  them it is named as having left no dump. So the verdict never contradicts a timeout line.

A member whose ring wrapped (it dropped events) and holds none of the group's calls is not
compared on that group: its calls there were overwritten by later ones (a middle pipeline
stage makes twice the sends of the others), which is no sign that it never entered them.

Of all the groups' divergences, one whose missing members are themselves waiting in another
group's divergent call only relays that wait (rank 0 waits in step 4 for rank 1, which waits
in step 3 for rank 3): the first point is the earliest of the others, by step, then by the
first member's enter time at k (wall-clock order alone can put the relay first); the
verdict names the rank(s) at fault and what the others were waiting in.
Dumps that are all SIGUSR2 snapshots of a running job are no failure: each rank dumped at its
own moment, so a rank a few calls behind another is expected and not named; only ranks that
called different collectives at the same point are.
"""
from __future__ import annotations

import glob
import json
import os
import re
import time

from ..health.flight import file_name


def add_flight_arguments(p) -> None:
    p.add_argument("dir", metavar="DIR", help="the directory of the flight-rank<R>.json dumps "
                   "(train --flight-dir; default there: CKPT.flight beside --checkpoint-dir "
                   "CKPT, else the working directory)")


def load(directory) -> tuple:
    """({rank: dump}, world size) of the dumps in `directory`."""
    dumps = {}
    for path in glob.glob(os.path.join(directory, "flight-rank*.json")):
        if re.fullmatch(r"flight-rank\d+\.json", os.path.basename(path)):
            with open(path) as f:
                d = json.load(f)
            dumps[int(d["rank"])] = d
    if not dumps:
        raise ValueError(f"no flight-rank<R>.json dumps in {directory}")
    return dumps, max(d["world_size"] for d in dumps.values())


def collectives(dumps) -> dict:
    """(group name, ranks) -> {rank: {seq: event}} of the dumped ranks' collective calls."""
    out = {}
    for rank, d in dumps.items():
        for e in d["events"]:
            if e["peer"] is not None:
                continue
            g = d["groups"][e["group"]]
            key = (g["name"], tuple(g["ranks"]))
            out.setdefault(key, {}).setdefault(rank, {})[e["seq"]] = e
    return out


def signature(e) -> tuple:
    return e["op"], e["dtype"], tuple(e["shape"] or ())


def call_text(e, seq=None) -> str:
    """'all_reduce #11 (float64 (3,), step 5)': the op, its sequence number, what it moved."""
    about = ([f"{e['dtype']} {tuple(e['shape'])}"] if e["dtype"] else []) + [
        f"{k} {e[k]}" for k in ("step", "microbatch") if e.get(k) is not None]
    return (e["op"] + (f" #{seq}" if seq is not None else "")
            + (f" ({', '.join(about)})" if about else ""))


def who(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {ranks}"


def group_divergence(key, by_rank, dumps):
    """The first divergence of group `key` as (time, seq, {rank: state}) or None; a state is
    ('call', event), ('behind', None) or ('no dump', None)."""
    name, ranks = key
    evicted = [r for r in ranks if r in dumps and not by_rank.get(r)
               and dumps[r].get("dropped", 0) > 0]
    dumped = [r for r in ranks if r in dumps and r not in evicted]
    calls = {r: by_rank.get(r, {}) for r in dumped}
    firsts = [min(c) for c in calls.values() if c]
    lasts = [max(c) for c in calls.values() if c]
    if not lasts:
        return None
    for seq in range(max(firsts), max(lasts) + 1):
        states = {r: ("call", calls[r][seq]) if seq in calls[r] else ("behind", None)
                  for r in dumped}
        states.update({r: ("no dump", None) for r in ranks if r not in dumps})
        states.update({r: ("evicted", None) for r in evicted})
        present = [e for kind, e in states.values() if kind == "call"]
        sigs = {signature(e) for e in present}
        unfinished = any(e["exit"] is None for e in present)
        behind, undumped = len(present) < len(dumped), len(dumped) < len(ranks)
        if len(sigs) > 1 or behind or undumped and unfinished:
            return min(e["enter"] for e in present), seq, states
    return None


def last_event(d):
    return d["events"][-1] if d["events"] else None


def describe(rank, dumps) -> str:
    """Where `rank` was when it dumped: in a call, or outside communication since one."""
    d = dumps[rank]
    e = last_event(d)
    if e is None:
        return "no communication recorded"
    g = d["groups"][e["group"]]
    what = f"{call_text(e, e['seq'])} on group {g['name']} {g['ranks']}"
    if e["peer"] is not None:
        what = f"{e['op']} with rank {e['peer']} (#{e['seq']}) on group {g['name']}"
    if e["exit"] is None:
        return f"inside {what} for {d['time'] - e['enter']:.2f} s"
    return (f"outside communication for {d['time'] - e['exit']:.2f} s, since {what} "
            f"(see {file_name(rank, 'stacks')})")


def counted(key, seq, states, dumps) -> dict:
    """{rank: 'late' | 'entered' | 'silent'}: what the arrival counters of the members waiting
    in call `seq` of group `key` (dumped at their timeout in it) found of the other members."""
    name, ranks = key
    found: dict = {}
    for r, (kind, e) in states.items():
        arrivals = dumps[r].get("arrivals") if kind == "call" and e["exit"] is None else None
        if arrivals and arrivals["group"] == name and tuple(arrivals["ranks"]) == ranks:
            for what in ("silent", "late", "entered"):      # a later word wins
                found.update((int(m), what) for m in arrivals[what])
    return found


def snapshot(dumps, found) -> str:
    """The verdict on SIGUSR2 snapshots (module docstring)."""
    odd = [(t, key, seq) for t, key, seq, states in found
           if len({signature(e) for kind, e in states.values() if kind == "call"}) > 1]
    text = ("verdict: a snapshot (SIGUSR2) of a running job, not a failure: each rank dumped "
            "at its own moment, so one a few calls ahead of another is expected (where each "
            "was: above)")
    if odd:
        _, (name, ranks), seq = min(odd)
        text += (f"; but at #{seq} on group {name} (ranks {list(ranks)}) the ranks called "
                 "different collectives")
    return text


def verdict(dumps, size) -> str:
    """The report of the module docstring."""
    lines = [f"flight: {size} ranks; dumps from ranks {sorted(dumps)}"
             + (f", none from {sorted(set(range(size)) - set(dumps))}" if len(dumps) < size
                else "")]
    for rank in sorted(dumps):
        d = dumps[rank]
        lines.append(f"  rank {rank}: {d['reason']} -- {describe(rank, dumps)}")
    found = [(t, key, seq, states) for key, by_rank in collectives(dumps).items()
             for t, seq, states in [group_divergence(key, by_rank, dumps) or (None,) * 3]
             if t is not None]
    if all(d["reason"] == "SIGUSR2" for d in dumps.values()):
        lines.append(snapshot(dumps, found))
        return "\n".join(lines)
    if not found:
        failed = [r for r, d in sorted(dumps.items())
                  if not d["reason"].startswith(("CollectiveTimeout", "SIGUSR2"))]
        why = (f"; {who(failed)} ended on an error: {dumps[failed[0]]['reason']}" if failed
               else " (the ranks without a dump are the suspects)" if len(dumps) < size else "")
        lines.append("verdict: the dumped ranks' collectives agree everywhere their rings "
                     "overlap" + why)
        return "\n".join(lines)
    t, (name, ranks), seq, states = first_point(found)
    stamp = time.strftime("%H:%M:%S", time.localtime(t)) + f".{int(t % 1 * 1000):03d}"
    lines.append(f"first divergence: collective #{seq} on group {name} (ranks {list(ranks)}), "
                 f"first entered at {stamp}")
    calls = {r: e for r, (kind, e) in states.items() if kind == "call"}
    counts = counted((name, ranks), seq, states, dumps)
    for r in ranks:
        kind, e = states[r]
        text = (f"in {call_text(e)}" + ("" if e["exit"] is None else " (left it)")
                if kind == "call" else "never entered it: " + describe(r, dumps)
                if kind == "behind" else "unknown: its ring no longer holds this group's calls"
                if kind == "evicted" else "no dump: " + NO_DUMP[counts.get(r)])
        lines.append(f"  rank {r}: {text}")
    lines.append("verdict: " + blame(name, ranks, seq, states, calls, counts))
    return "\n".join(lines)


def first_point(found):
    """The divergence to report (module docstring): not a relay of another's wait, then the
    earliest by step and enter time."""
    waiting = {r: key for _, key, _, states in found for r, (kind, e) in states.items()
               if kind == "call" and e["exit"] is None}

    def relay(f):
        missing = [r for r, (kind, _) in f[3].items() if kind in ("behind", "no dump")]
        return bool(missing) and all(waiting.get(r, f[1]) != f[1] for r in missing)

    def step(f):
        steps = [e["step"] for kind, e in f[3].values() if kind == "call" and
                 e.get("step") is not None]
        return min(steps) if steps else float("inf")
    return min([f for f in found if not relay(f)] or found, key=lambda f: (step(f), f[0]))


NO_DUMP = {None: "killed before it could write one",
           "late": "never entered it (the arrival counters of the ranks waiting in it)",
           "entered": "entered it and never left: stopped or hung inside it (the arrival "
                      "counters of the ranks waiting in it)",
           "silent": "killed before it could write one; its arrival counter did not answer"}


def blame(name, ranks, seq, states, calls, counts) -> str:
    """One sentence: which rank is where, and what the others wait for."""
    where = f"on group {name}"
    sigs: dict = {}
    for r, e in calls.items():
        sigs.setdefault(signature(e), []).append(r)
    if len(sigs) > 1:
        ordered = sorted(sigs.values(), key=len)
        if len(ordered[0]) < len(ordered[-1]):
            odd = [r for members in ordered[:-1] for r in members]
            rest = ordered[-1]
            return (f"{who(odd)} called {call_text(calls[odd[0]], seq)} {where} while "
                    f"{who(rest)} called {call_text(calls[rest[0]])}")
        return f"the ranks disagree at #{seq} {where}: " + "; ".join(
            f"{who(members)} called {call_text(calls[members[0]])}" for members in ordered)
    undumped = {r: counts.get(r) for r in ranks if states[r][0] == "no dump"}
    inside = [r for r, what in undumped.items() if what == "entered"]
    missing = [r for r in ranks if states[r][0] == "behind" or undumped.get(r, 0) == "late"]
    unknown = [r for r, what in undumped.items() if what in (None, "silent")]
    waiting = [r for r, e in calls.items() if e["exit"] is None]
    op = call_text(next(iter(calls.values())), seq)
    late = sorted(r for r, what in counts.items() if what == "late")
    text = "; ".join(
        [f"{who(missing)} never entered {op} {where}"] * bool(missing)
        + [f"{who(inside)} entered {op} {where} and never left it (no dump: stopped or hung "
           "inside it)"] * bool(inside)
        + [f"{who(unknown)} left no dump, and no arrival counter says whether it entered "
           f"{op} {where}"] * bool(unknown)) or f"{who(waiting)} still in {op} {where}"
    if waiting and (missing or inside or unknown):
        text += f"; {who(waiting)} waited in it"
    if late:
        text += f" (the timeout's arrival counters: late ranks {late})"
    elif inside:
        text += " (the timeout's arrival counters: every member entered it)"
    return text


def run_flight(args) -> int:
    dumps, size = load(args.dir)
    print(verdict(dumps, size), flush=True)
    return 0

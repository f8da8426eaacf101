"""Pipeline schedules as plain data: one list of F/B actions per stage, testable without MPI.

A schedule is ``schedule[stage] = [Action('F', 0, 0), Action('F', 1, 0), ..., Action('B', 0, 0)]``,
the order in which that stage runs forward (F) and backward (B) passes of microbatches.
``parallel/pipeline.py`` executes it with send/receive; here it is only data, so it can be
built, simulated, drawn and checked on a laptop.

Virtual stages. With ``v`` chunks per stage (interleaved schedules) the model's layers are cut
into ``pp * v`` consecutive virtual stages and virtual stage ``k = chunk * pp + stage`` (the
Megatron order: stage 0 holds virtual stages 0, pp, 2pp, ...). Dependencies:

- F(mb) at virtual stage k needs F(mb) at k-1 (stage (k-1) % pp, chunk (k-1) // pp);
- B(mb) at virtual stage k needs B(mb) at k+1; the last virtual stage's B needs its own F,
  because the loss lives there.
- Zero-bubble schedules split each backward in two: B computes only the input gradient (what
  the previous stage waits for) and W(mb) the weight gradients, later, on the same stage; W
  needs its own B and nothing waits for W, so W passes fill what would be bubbles.

``simulate`` runs a discrete-event model of that: each stage executes its list strictly in
order; an action starts when its stage is free and its dependency has finished (+ ``t_comm``
when the dependency ran on another stage). Sends are buffered (non-blocking), so only true
dependency cycles deadlock. Charts below use ``t_forward == t_backward == 1`` (one cell each).
"""
from collections import namedtuple
from dataclasses import dataclass

from ..validate import check_number

Action = namedtuple('Action', 'kind microbatch chunk')
Action.__doc__ = ("One pass: kind 'F', 'B' or 'W', microbatch 0..m-1, "
                  "chunk 0..v-1 (virtual chunk on this stage).")

SCHEDULES = ('gpipe', '1f1b', 'interleaved', 'zb1p')


class ScheduleError(ValueError):
    """A schedule is malformed (missing, duplicated or misordered actions) or deadlocks."""


# ---------------------------------------------------------------------------------- builders

def _check_sizes(pp, microbatches, virtual_stages) -> None:
    for name, value in (("pp", pp), ("microbatches", microbatches),
                        ("virtual_stages", virtual_stages)):
        check_number(name, value, low=1, integer=True)


def _gpipe(pp, m):
    """GPipe: every forward, then every backward (in reverse microbatch order).

        stage 0 | F0 F1 F2 F3 .. .. .. .. .. .. B3 B2 B1 B0
        stage 1 | .. F0 F1 F2 F3 .. .. .. .. B3 B2 B1 B0 ..
        stage 2 | .. .. F0 F1 F2 F3 .. .. B3 B2 B1 B0 .. ..
        stage 3 | .. .. .. F0 F1 F2 F3 B3 B2 B1 B0 .. .. ..

    Bubble (p-1)/(m+p-1); every stage holds all m microbatches' activations at the peak.
    """
    return [[Action('F', i, 0) for i in range(m)] + [Action('B', i, 0) for i in reversed(range(m))]
            for _ in range(pp)]


def _one_f_one_b(pp, m):
    """1F1B (PipeDream-flush): warm up with pp-s-1 forwards, alternate F/B, drain the backwards.

        stage 0 | F0 F1 F2 F3 .. .. .. B0 F4 B1 F5 B2 F6 B3 F7 B4 .. B5 .. B6 .. B7
        stage 1 | .. F0 F1 F2 .. .. B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .. B6 .. B7 ..
        stage 2 | .. .. F0 F1 .. B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .. B7 .. ..
        stage 3 | .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .. .. ..

    Same bubble as GPipe, (p-1)/(m+p-1), but stage s holds at most min(m, pp-s) activations.
    """
    schedule = []
    for s in range(pp):
        warmup = min(pp - s - 1, m)
        actions = [Action('F', i, 0) for i in range(warmup)]
        for i in range(m - warmup):               # steady state: one forward, one backward
            actions += [Action('F', warmup + i, 0), Action('B', i, 0)]
        actions += [Action('B', i, 0) for i in range(m - warmup, m)]   # cool-down
        schedule.append(actions)
    return schedule


def _interleaved(pp, m, v):
    """Megatron interleaved 1F1B: each stage holds v chunks (virtual stages s, s+pp, ...).

    Microbatches go through in groups of pp: chunk 0 for mb 0..pp-1, then chunk 1 for the same
    group, ..., then the next group. Backwards walk the chunks in reverse. Stage s warms up with
    2*(pp-s-1) + (v-1)*pp forwards, then alternates F/B. pp=2, m=4, v=2 (cells of t/v):

        stage 0 | F0a F1a F0b F1b F2a B0b F3a B1b F2b B0a F3b B1a ... B2b ... B3b B2a B3a
        stage 1 | ... F0a F1a F0b B0b F1b B1b F2a B0a F3a B1a F2b B2b F3b B3b B2a B3a ...

    (a, b = chunk 0, 1.) Bubble about (p-1)/(v*m+p-1): v times smaller than 1F1B, for v times
    the point-to-point messages. Requires m % pp == 0.
    """
    total = m * v
    def unit(k, backward):                      # k-th forward (or backward) of this stage
        chunk = (k // pp) % v
        return Action('B' if backward else 'F', (k // (pp * v)) * pp + k % pp,
                      v - 1 - chunk if backward else chunk)
    schedule = []
    for s in range(pp):
        warmup = min(2 * (pp - s - 1) + (v - 1) * pp, total)
        actions = [unit(k, False) for k in range(warmup)]
        for k in range(total - warmup):
            actions += [unit(warmup + k, False), unit(k, True)]
        actions += [unit(k, True) for k in range(total - warmup, total)]
        schedule.append(actions)
    return schedule


def _zb_h1(pp, m):
    """ZB-H1 (Qi et al., "Zero Bubble Pipeline Parallelism", 2023): 1F1B with each backward
    split into B (input gradient) and W (weight gradients). Stage s runs 1F1B's F/B order and
    puts W(j - s) after B(j): stage s keeps s weight-gradient passes in hand for the cool-down,
    where 1F1B idles, so at most pp microbatches are in flight on any stage (F done, W not),
    1F1B's peak (stage 0's). pp=4, m=6, F = B = W = one cell:

        stage 0 | F0 F1 F2 F3 .. .. .. B0 W0 F4 B1 W1 F5 B2 W2 B3 W3 B4 W4 B5 W5
        stage 1 | .. F0 F1 F2 .. .. B0 F3 B1 W0 F4 B2 W1 F5 B3 W2 B4 W3 B5 W4 W5
        stage 2 | .. .. F0 F1 .. B0 F2 B1 F3 B2 W0 F4 B3 W1 F5 B4 W2 B5 W3 W4 W5
        stage 3 | .. .. .. F0 B0 F1 B1 F2 B2 F3 B3 W0 F4 B4 W1 F5 B5 W2 W3 W4 W5

    Bubble (p-1)/(3m+p-1) with F = B = W: a third of 1F1B's (p-1) (t_F + t_B) idle time.
    """
    schedule = []
    for s in range(pp):
        warmup = min(pp - s - 1, m)
        actions = [Action('F', i, 0) for i in range(warmup)]
        done_w = 0
        for j in range(m):
            if warmup + j < m:
                actions.append(Action('F', warmup + j, 0))
            actions.append(Action('B', j, 0))
            if j >= s:                               # W(j - s): s passes held back
                actions.append(Action('W', done_w, 0))
                done_w += 1
        actions += [Action('W', i, 0) for i in range(done_w, m)]   # the held ones, last
        schedule.append(actions)
    return schedule


def make_schedule(name, pp, microbatches, virtual_stages=1):
    """Return ``schedule[stage] -> list[Action]`` for 'gpipe', '1f1b', 'interleaved' or
    'zb1p' (whose backwards are split into B and W actions)."""
    if name not in SCHEDULES:
        raise ValueError(f"unknown schedule {name!r}; valid schedules: {', '.join(SCHEDULES)}")
    _check_sizes(pp, microbatches, virtual_stages)
    if name == 'interleaved':
        if virtual_stages < 2:
            raise ValueError(f"interleaved schedule needs virtual_stages >= 2, "
                             f"got {virtual_stages}")
        if microbatches % pp:
            raise ValueError(f"interleaved schedule needs microbatches ({microbatches}) to be a "
                             f"multiple of pp ({pp})")
        return _interleaved(pp, microbatches, virtual_stages)
    if virtual_stages != 1:
        raise ValueError(f"{name} schedule needs virtual_stages == 1, got {virtual_stages} "
                         f"(use 'interleaved')")
    builder = {'gpipe': _gpipe, '1f1b': _one_f_one_b, 'zb1p': _zb_h1}[name]
    return builder(pp, microbatches)


# ---------------------------------------------------------------------------------- simulation

@dataclass
class ScheduleStats:
    """Result of ``simulate``. ``start_times[stage]`` is a list of (Action, start, end)."""
    makespan: float
    bubble_fraction: float          # 1 - busy / (pp * makespan)
    peak_live_activations: list     # per stage: max microbatch-chunks with F done, B not yet
    start_times: list
    pp: int
    microbatches: int
    virtual_stages: int = 1
    t_forward: float = 1.0
    t_backward: float = 2.0
    t_comm: float = 0.0
    t_weight: float = 0.0           # split backwards: W's share of t_backward (0: not split)


def splits_backward(schedule) -> bool:
    """Whether ``schedule`` (one stage's actions, or all stages') has W actions."""
    rows = schedule if schedule and isinstance(schedule[0], list) else [schedule]
    return any(a[0] == 'W' for row in rows for a in row)


def dependency(stage, action, pp, virtual_stages=1):
    """(stage, Action) that must finish before ``action`` can run on ``stage``; None if none."""
    kind, mb, chunk = action
    k = chunk * pp + stage                      # virtual stage index
    if kind == 'W':                             # weight gradients: after this stage's B
        return stage, Action('B', mb, chunk)
    if kind == 'F':
        return None if k == 0 else ((k - 1) % pp, Action('F', mb, (k - 1) // pp))
    if k == pp * virtual_stages - 1:            # the loss is here: B follows its own F
        return stage, Action('F', mb, chunk)
    return (k + 1) % pp, Action('B', mb, (k + 1) // pp)


def _check_structure(schedule, pp, m, v):
    if len(schedule) != pp:
        raise ScheduleError(f"schedule has {len(schedule)} stages, expected pp={pp}")
    kinds = 'FBW' if splits_backward(schedule) else 'FB'     # split: every stage, every pass
    for s, actions in enumerate(schedule):
        seen = set()
        for i, a in enumerate(actions):
            if a.kind not in kinds or not 0 <= a.microbatch < m or not 0 <= a.chunk < v:
                raise ScheduleError(f"stage {s} action {i} {a} is out of range "
                                    f"(kind F/B/W, microbatches={m}, virtual_stages={v})")
            if a in seen:
                raise ScheduleError(f"stage {s} runs {a} twice (action {i})")
            before = {'B': 'F', 'W': 'B'}.get(a.kind)
            if before and Action(before, a.microbatch, a.chunk) not in seen:
                raise ScheduleError(f"stage {s} runs {a} (action {i}) before its "
                                    f"{'forward' if before == 'F' else 'input gradient B'}")
            seen.add(a)
        missing = [Action(k, i, c) for i in range(m) for c in range(v) for k in kinds
                   if Action(k, i, c) not in seen]
        if missing:
            raise ScheduleError(f"stage {s} is missing {len(missing)} action(s): {missing[:4]}")


def simulate(schedule, pp, microbatches, virtual_stages=1, t_forward=1.0, t_backward=2.0,
             t_comm=0.0, t_weight=None):
    """Check ``schedule`` and run it as a discrete-event simulation; return ScheduleStats.

    A chunk's forward takes t_forward / v and its backward t_backward / v; a split backward's
    W takes t_weight / v (default half the backward) and its B the rest. Raises ScheduleError
    for a malformed schedule or a deadlock (naming the stuck stages and their next actions).
    """
    _check_sizes(pp, microbatches, virtual_stages)
    if not (t_forward > 0 and t_backward > 0 and t_comm >= 0):
        raise ValueError(f"need t_forward > 0, t_backward > 0, t_comm >= 0; got "
                         f"{t_forward}, {t_backward}, {t_comm}")
    v = virtual_stages
    schedule = [[Action(*a) for a in actions] for actions in schedule]
    _check_structure(schedule, pp, microbatches, v)
    split = splits_backward(schedule)
    t_weight = (t_backward / 2 if t_weight is None else t_weight) if split else 0.0
    if not 0 <= t_weight < t_backward:
        raise ValueError(f"need 0 <= t_weight < t_backward, got {t_weight}, {t_backward}")
    duration = {'F': t_forward / v, 'B': (t_backward - t_weight) / v, 'W': t_weight / v}
    finished = {}                               # (stage, Action) -> end time
    pos, free = [0] * pp, [0.0] * pp
    timeline = [[] for _ in range(pp)]
    while any(pos[s] < len(schedule[s]) for s in range(pp)):
        progressed = False
        for s in range(pp):                     # end times do not depend on visiting order
            while pos[s] < len(schedule[s]):
                a = schedule[s][pos[s]]
                dep = dependency(s, a, pp, v)
                ready = 0.0
                if dep is not None:
                    if dep not in finished:
                        break
                    ready = finished[dep] + (t_comm if dep[0] != s else 0.0)
                start = max(free[s], ready)
                free[s] = finished[(s, a)] = start + duration[a.kind]
                timeline[s].append((a, start, free[s]))
                pos[s] += 1
                progressed = True
        if not progressed:
            stuck = ', '.join(f"stage {s} waits at {schedule[s][pos[s]]}"
                              for s in range(pp) if pos[s] < len(schedule[s]))
            raise ScheduleError(f"schedule deadlocks: {stuck}")
    makespan = max(free)
    busy = sum(end - start for row in timeline for _, start, end in row)
    peaks = []
    for actions in schedule:
        live = peak = 0
        for a in actions:                       # split: what B keeps lives until W
            live += 1 if a.kind == 'F' else -1 if a.kind == ('W' if split else 'B') else 0
            peak = max(peak, live)
        peaks.append(peak)
    return ScheduleStats(makespan, 1.0 - busy / (pp * makespan), peaks, timeline, pp,
                         microbatches, v, t_forward, t_backward, t_comm, t_weight)


def validate(schedule, pp, microbatches, virtual_stages=1):
    """Simulate with default timings and return the stats; raises ScheduleError if invalid."""
    return simulate(schedule, pp, microbatches, virtual_stages)


def ideal_bubble(pp, microbatches, virtual_stages=1):
    """Textbook bubble fraction (p-1) / (v*m + p-1)."""
    return (pp - 1) / (virtual_stages * microbatches + pp - 1)


# ---------------------------------------------------------------------------------- text chart

def action_label(action, v):
    """'F0', 'B3'; with v > 1 the chunk is a letter: 'F0a', 'B3b'."""
    return f"{action.kind}{action.microbatch}" + (chr(ord('a') + action.chunk) if v > 1 else '')


def render_timeline(timeline, pp=None, microbatches=None, virtual_stages=None, width=None):
    """ASCII chart, one row per stage: ``stage 0 | F0 F1 .. .. B1 B0``; ``..`` is idle.

    ``timeline`` is a ScheduleStats (drawn with its own timings) or a schedule, which is
    simulated with t_forward = t_backward = 1 for the classic chart (pp, microbatches and
    virtual_stages are inferred from it when not given). One cell is min(t_forward,
    t_backward) / v; an action lasting k cells shows its label k times (with the default
    t_backward = 2 * t_forward a backward reads ``B0 B0``). Times are rounded to whole cells.
    With v > 1 the chunk is a letter: F0a, F0b. Rows longer than ``width`` are cut with '>'.
    """
    stats = timeline
    if not isinstance(stats, ScheduleStats):
        acts = [Action(*a) for row in timeline for a in row]
        stats = simulate(timeline, len(timeline) if pp is None else pp,
                         microbatches or 1 + max((a.microbatch for a in acts), default=0),
                         virtual_stages or 1 + max((a.chunk for a in acts), default=0),
                         t_forward=1.0, t_backward=2.0 if splits_backward(timeline) else 1.0)
    v = stats.virtual_stages
    cell = min(stats.t_forward, *(t for t in (stats.t_backward - stats.t_weight,
                                             stats.t_weight) if t > 0)) / v
    ncells = int(round(stats.makespan / cell))
    cw = max(2, max(len(action_label(a, v)) for row in stats.start_times for a, _, _ in row))
    lines = []
    for s, row in enumerate(stats.start_times):
        cells = ['.' * cw] * ncells
        for a, start, end in row:
            first = int(round(start / cell))
            for i in range(first, min(ncells, first + max(1, int(round((end - start) / cell))))):
                cells[i] = action_label(a, v).ljust(cw)
        line = f"stage {s:>{len(str(stats.pp - 1))}} | " + ' '.join(cells).rstrip()
        if width is not None and len(line) > width:
            line = line[:max(width - 1, 0)] + '>'
        lines.append(line)
    return '\n'.join(lines)

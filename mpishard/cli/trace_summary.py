"""`python -m mpishard trace-summary DIR`: where a traced run's time went, per rank (no MPI).

    python -m mpishard trace-summary runs/trace            # DIR holds trace.json
    python -m mpishard trace-summary runs/trace --png gantt.png --timeline step.png

Reads the merged trace that `--trace DIR` (train, bench) or `engine.trace(DIR)` wrote and
prints, per rank, the traced wall time (first span to last) split into compute (layers, loss,
optimizer, pipeline actions; communication inside them not counted twice), communication
(collectives and sends: the union of their spans, with bytes and the time blocked in MPI
waits) and idle (neither: waiting for a pipeline neighbour, Python between calls). When the
run was a pipeline it also draws the last step's actions as measured (one row per stage, on
the aligned clocks) above the same actions simulated by parallel/schedules.py with the
measured mean F, B and W durations, and prints both bubbles. For every run it draws the last
traced step as one row per rank, compute / communication / idle (trace_gantt.py), into
DIR/timeline.png. Both pictures need matplotlib.
"""
from __future__ import annotations

import json
import os
import sys

from ..health.trace import TRACE_FILE
from ..parallel.schedules import Action, ScheduleStats, simulate, splits_backward
from .schedule import draw_timeline
from .trace_gantt import plot_ranks, union_length


def add_trace_summary_arguments(parser):
    parser.add_argument("directory", help="the --trace DIR of a run (holds trace.json)")
    parser.add_argument("--png", default=None,
                        help="pipeline Gantt chart, measured beside simulated (default "
                             "DIR/pipeline.png when the run was a pipeline; 'none': skip)")
    parser.add_argument("--timeline", default=None,
                        help="the last traced step, a row per rank: compute / comm / idle "
                             "(default DIR/timeline.png; 'none': skip)")
    return parser


def rank_table(events) -> list:
    """Per rank: (rank, wall, compute, comm, idle, bytes, blocked) in seconds / bytes."""
    rows = []
    for rank in sorted({e["pid"] for e in events}):
        mine = [e for e in events if e["pid"] == rank]
        span = lambda e: (e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6)    # noqa: E731
        work = [span(e) for e in mine if e["cat"] in ("compute", "action")]
        comm = [span(e) for e in mine if e["cat"] == "comm"]
        every = [span(e) for e in mine]
        wall = max(b for _, b in every) - min(a for a, _ in every)
        busy, comm_s = union_length(work + comm), union_length(comm)
        rows.append((rank, wall, busy - comm_s if busy > comm_s else 0.0, comm_s, wall - busy,
                     sum(e["args"].get("bytes", 0) for e in mine if e["cat"] == "comm"),
                     sum(e["args"].get("blocked_s", 0.0) for e in mine if e["cat"] == "comm")))
    return rows


def last_step(events):
    """The last pipeline step's actions: {stage: [(Action, start_s, end_s)]} from one
    pipeline (for each stage the lowest rank), or None when nothing was a pipeline action."""
    acts = [e for e in events if e["cat"] == "action"]
    if not acts:
        return None
    first_rank = {}
    for e in acts:
        s = e["args"]["stage"]
        first_rank[s] = min(first_rank.get(s, e["pid"]), e["pid"])
    rows = {}
    for s, rank in first_rank.items():
        mine = sorted((e for e in acts if e["pid"] == rank), key=lambda e: e["ts"])
        starts = [i for i, e in enumerate(mine) if e["args"]["kind"] == "F"
                  and e["args"]["microbatch"] == 0 and e["args"]["chunk"] == 0]
        rows[s] = [(Action(e["args"]["kind"], e["args"]["microbatch"], e["args"]["chunk"]),
                    e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6) for e in mine[starts[-1]:]]
    return [rows[s] for s in sorted(rows)]


def measured_and_simulated(rows):
    """(measured, simulated) ScheduleStats of one step's rows (times in ms from its start)."""
    t0 = min(a for row in rows for _, a, _ in row)
    pp = len(rows)
    m = 1 + max(a.microbatch for row in rows for a, _, _ in row)
    v = 1 + max(a.chunk for row in rows for a, _, _ in row)
    timeline = [[(a, (s - t0) * 1e3, (e - t0) * 1e3) for a, s, e in row] for row in rows]
    makespan = max(e for row in timeline for _, _, e in row)
    busy = sum(e - s for row in timeline for _, s, e in row)
    mean = {k: [e - s for row in timeline for a, s, e in row if a.kind == k] for k in "FBW"}
    mean = {k: sum(d) / len(d) if d else 0.0 for k, d in mean.items()}
    measured = ScheduleStats(makespan, 1.0 - busy / (pp * makespan), [], timeline, pp, m, v,
                             mean["F"] * v, (mean["B"] + mean["W"]) * v, 0.0, mean["W"] * v)
    schedule = [[a for a, _, _ in row] for row in rows]
    simulated = simulate(schedule, pp, m, v, mean["F"] * v, (mean["B"] + mean["W"]) * v,
                         0.0, mean["W"] * v if splits_backward(schedule) else None)
    return measured, simulated


def plot_pair(measured, simulated, path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg   # lazy: matplotlib optional
    from matplotlib.figure import Figure
    fig = Figure(figsize=(14.0, 1.2 * measured.pp + 2.4))
    FigureCanvasAgg(fig)
    top = fig.add_subplot(2, 1, 1)
    bottom = fig.add_subplot(2, 1, 2, sharex=top)
    draw_timeline(top, measured, "measured", xlabel="ms")
    draw_timeline(bottom, simulated, "simulated (measured mean F/B/W)", xlabel="ms")
    top.set_xlim(0, max(measured.makespan, simulated.makespan))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def run_trace_summary(args) -> int:
    path = os.path.join(args.directory, TRACE_FILE)
    try:
        with open(path) as f:
            trace = json.load(f)
        events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        meta = trace.get("otherData", {})
    except (OSError, ValueError, KeyError, AttributeError) as e:
        print(f"error: cannot read a trace from {path}: {e}", file=sys.stderr)
        return 2
    if not events:
        print(f"error: {path} holds no spans", file=sys.stderr)
        return 2
    steps = meta.get("steps")
    title = meta.get("layout", "") + (f" (traced steps {steps[0]}-{steps[1]})" if steps else "")
    lines = [f"{'rank':>4} {'wall ms':>9} {'compute ms':>11} {'comm ms':>9} {'idle ms':>9} "
             f"{'compute':>8} {'comm':>6} {'idle':>6} {'comm MB':>8} {'blocked ms':>10}"]
    for rank, wall, comp, comm, idle, nbytes, blocked in rank_table(events):
        w = wall or 1.0
        lines.append(f"{rank:>4} {wall * 1e3:>9.2f} {comp * 1e3:>11.2f} {comm * 1e3:>9.2f} "
                     f"{idle * 1e3:>9.2f} {comp / w:>8.1%} {comm / w:>6.1%} {idle / w:>6.1%} "
                     f"{nbytes / 1e6:>8.3f} {blocked * 1e3:>10.2f}")
    rows = last_step(events)
    if rows is not None:
        measured, simulated = measured_and_simulated(rows)
        lines.append(f"pipeline, last step: pp={measured.pp}, microbatches="
                     f"{measured.microbatches}: bubble measured {measured.bubble_fraction:.3f}"
                     f" (makespan {measured.makespan:.2f} ms), simulated with the measured "
                     f"mean F/B/W {simulated.bubble_fraction:.3f} ({simulated.makespan:.2f} ms)")
        png = args.png or os.path.join(args.directory, "pipeline.png")
        if png != "none":
            lines.append(_drawn(lambda: f"wrote {plot_pair(measured, simulated, png)}"))
    png = getattr(args, "timeline", None) or os.path.join(args.directory, "timeline.png")
    if png != "none":
        def timeline():
            t0, t1 = plot_ranks(events, png, title)
            return f"wrote {png} (the last traced step, {(t1 - t0) * 1e3:.2f} ms)"
        lines.append(_drawn(timeline))
    print("\n".join(lines))
    return 0


def _drawn(draw) -> str:
    """draw()'s line, or why no picture when matplotlib is missing."""
    try:
        return draw()
    except ImportError:
        return "no picture: matplotlib is not installed (pip install matplotlib)"

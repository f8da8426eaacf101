"""A traced step as a picture: one row per rank, compute above communication, idle between.

`trace-summary DIR` writes DIR/timeline.png from the merged trace (health/trace.py) for any run,
pipeline or not. The window is the last traced training step: from the earliest end of an
optimizer step before the last one (on any rank) to the latest end of the last one, so every
rank's whole last step is in view; a trace without optimizer steps is drawn whole. Each rank's
row has two lanes on rank 0's aligned clock:

    upper lane   compute: forward (or pipeline F) blue, backward (B) green, weight gradients
                 (W) yellow, the loss purple, the optimizer step teal; a pipeline action is
                 drawn under the layer spans it holds
    lower lane   communication: collectives and sends orange, a pipeline stage waiting for
                 its neighbour red
    background   grey: idle (neither: Python between calls, the trainer's loop, waiting to be
                 scheduled when ranks outnumber cores)

The row label gives the rank's compute / comm / idle share of the window, counted like
trace-summary's table (communication inside a compute span is counted once, as comm).
"""
from __future__ import annotations

COMPUTE_COLORS = {"F": "#6fa8dc", "B": "#93c47d", "W": "#ffd966", "loss": "#b4a7d6",
                  "optimizer": "#76a5af", "other": "#cccccc"}
COMM_COLOR, WAIT_COLOR, IDLE_COLOR = "#e69138", "#e06666", "#eeeeee"
SUFFIX = {" forward": "F", " backward_input": "B", " backward_weights": "W", " backward": "B"}


def union_length(intervals) -> float:
    """Total length covered by (start, end) intervals."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def seconds(e) -> tuple:
    """(start, end) of a Chrome 'X' event, in seconds."""
    return e["ts"] * 1e-6, (e["ts"] + e["dur"]) * 1e-6


def last_step_window(events) -> tuple:
    """(start, end) seconds of the last traced step (module docstring)."""
    ends: dict = {}
    for e in events:
        if e["name"] == "optimizer step":
            ends.setdefault(e["pid"], []).append(seconds(e)[1])
    ranks = {e["pid"] for e in events}
    first = min(seconds(e)[0] for e in events)
    if set(ends) != ranks:
        return first, max(seconds(e)[1] for e in events)
    ends = {r: sorted(v) for r, v in ends.items()}
    end = max(v[-1] for v in ends.values())
    if all(len(v) >= 2 for v in ends.values()):
        return min(v[-2] for v in ends.values()), end
    return first, end


def kind_of(e) -> str:
    """The color key of a compute or action span."""
    if e["cat"] == "action":
        return e["args"]["kind"]
    if e["name"] == "loss":
        return "loss"
    if e["name"] == "optimizer step":
        return "optimizer"
    for suffix, kind in SUFFIX.items():
        if e["name"].endswith(suffix):
            return kind
    return "other"


def label_of(e) -> str:
    """A short label: 'Block(2) F', 'F3' (pipeline action kind + microbatch), 'all_reduce'."""
    if e["cat"] == "action":
        return f"{e['args']['kind']}{e['args']['microbatch']}"
    for suffix, kind in SUFFIX.items():
        if e["name"].endswith(suffix):
            return e["name"][:-len(suffix)].replace("/weights", "") + " " + kind
    return e["name"]


def shares(events, rank, t0, t1) -> tuple:
    """(compute, comm, idle) seconds of `rank` within [t0, t1]."""
    def clipped(cats):
        return [(max(a, t0), min(b, t1)) for a, b in
                (seconds(e) for e in events if e["pid"] == rank and e["cat"] in cats)
                if b > t0 and a < t1]
    work, comm = clipped(("compute", "action")), clipped(("comm",))
    busy, comm_s = union_length(work + comm), union_length(comm)
    return max(busy - comm_s, 0.0), comm_s, (t1 - t0) - busy


def plot_ranks(events, path, title="", dpi=100) -> tuple:
    """Write the last traced step of every rank to `path` (PNG); returns (window start,
    window end) in seconds."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg   # lazy: matplotlib optional
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch
    t0, t1 = last_step_window(events)
    ranks = sorted({e["pid"] for e in events})
    ms = lambda t: (t - t0) * 1e3                                     # noqa: E731
    width_in = 13.0
    fig = Figure(figsize=(width_in, 0.75 * len(ranks) + 1.6))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    px_per_ms = 0.8 * width_in * dpi / max(ms(t1), 1e-9)
    order = {"action": 0, "compute": 1, "comm": 2, "wait": 2}        # actions under layers
    for row, rank in enumerate(ranks):
        ax.broken_barh([(0, ms(t1))], (row - 0.45, 0.9), facecolors=IDLE_COLOR)
        mine = sorted((e for e in events if e["pid"] == rank and e["cat"] in order),
                      key=lambda e: (order[e["cat"]], e["ts"]))
        for e in mine:
            a, b = seconds(e)
            if b <= t0 or a >= t1:
                continue
            a, b = max(a, t0), min(b, t1)
            upper = e["cat"] in ("compute", "action")
            y = row - 0.42 if upper else row + 0.02
            color = (COMPUTE_COLORS[kind_of(e)] if upper else
                     COMM_COLOR if e["cat"] == "comm" else WAIT_COLOR)
            ax.broken_barh([(ms(a), ms(b) - ms(a))], (y, 0.4), facecolors=color,
                           edgecolors="black", linewidth=0.3)
            text = label_of(e)
            if (ms(b) - ms(a)) * px_per_ms > 5.5 * len(text) + 4 and e["cat"] != "action":
                ax.text((ms(a) + ms(b)) / 2, y + 0.2, text, ha="center", va="center",
                        fontsize=6.5)
    labels = []
    for rank in ranks:
        comp, comm, idle = shares(events, rank, t0, t1)
        w = t1 - t0
        labels.append(f"rank {rank}\ncompute {comp / w:.0%} comm {comm / w:.0%} "
                      f"idle {idle / w:.0%}")
    ax.set_yticks(range(len(ranks)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(len(ranks) - 0.5, -0.5)
    ax.set_xlim(0, ms(t1))
    ax.set_xlabel("ms from the start of the last traced step (rank 0's clock)")
    ax.set_title(f"{title + ': ' if title else ''}last traced step, {ms(t1):.1f} ms",
                 fontsize=10)
    legend = [Patch(facecolor=COMPUTE_COLORS[k], edgecolor="black", label=t) for k, t in
              (("F", "forward / F"), ("B", "backward / B"), ("W", "weight grads / W"),
               ("loss", "loss"), ("optimizer", "optimizer step"))]
    legend += [Patch(facecolor=COMM_COLOR, edgecolor="black", label="communication"),
               Patch(facecolor=WAIT_COLOR, edgecolor="black", label="pipeline wait"),
               Patch(facecolor=IDLE_COLOR, edgecolor="black", label="idle")]
    fig.legend(handles=legend, loc="lower center", ncol=8, fontsize=7, frameon=False)
    fig.tight_layout(rect=(0, 0.3 / fig.get_figheight(), 1, 1))
    fig.savefig(path, dpi=dpi)
    return t0, t1

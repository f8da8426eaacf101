"""`python -m mpishard schedule`: a pipeline schedule's timeline, bubble and memory (no MPI).

    python -m mpishard schedule --pp 4 --microbatches 8 --schedule 1f1b --png 1f1b.png

The schedule is built and simulated by mpishard/parallel/schedules.py (schedules as data and a
discrete-event simulator); this command prints its text chart, the bubble fraction next to the
textbook one and the peak live activations per stage, and with --png draws a Gantt chart with
matplotlib. Every rank computes; rank 0 alone prints and writes the PNG.
"""
from __future__ import annotations

import sys

from ..parallel.schedules import (SCHEDULES, action_label, ideal_bubble, make_schedule,
                                  render_timeline, simulate, splits_backward)
from .usage import print_report, world_rank


def add_schedule_arguments(parser):
    """Add the ``schedule`` command's options to an argparse parser (returns it)."""
    parser.add_argument('--pp', type=int, default=4, help='pipeline stages (default 4)')
    parser.add_argument('--microbatches', type=int, default=8, help='microbatches (default 8)')
    parser.add_argument('--schedule', choices=SCHEDULES, default='1f1b', help='default 1f1b')
    parser.add_argument('--virtual-stages', type=int, default=None,
                        help='chunks per stage (default 1; 2 for interleaved)')
    parser.add_argument('--t-forward', type=float, default=1.0, help='forward time per microbatch')
    parser.add_argument('--t-backward', type=float, default=2.0,
                        help='backward time per microbatch')
    parser.add_argument('--t-comm', type=float, default=0.0, help='stage-to-stage transfer time')
    parser.add_argument('--t-weight', type=float, default=None,
                        help="zb1p: the weight-gradient (W) share of the backward "
                             "(default half of it)")
    parser.add_argument('--width', type=int, default=None, help='cut chart rows at this many chars')
    parser.add_argument('--png', default=None, help='also write a PNG chart (needs matplotlib)')
    return parser


def run_schedule_command(args) -> int:
    """Print the timeline, bubble fraction (simulated vs ideal) and peak live activations;
    exit code 2 with one `error: ...` line for a schedule that cannot be built."""
    v = args.virtual_stages or (2 if args.schedule == 'interleaved' else 1)
    try:
        schedule = make_schedule(args.schedule, args.pp, args.microbatches, v)
        stats = simulate(schedule, args.pp, args.microbatches, v, args.t_forward,
                         args.t_backward, args.t_comm, args.t_weight)
    except (ValueError, TypeError) as e:
        if world_rank() == 0:
            print(f"error: {e}", file=sys.stderr)
        return 2
    split = splits_backward(schedule)
    b_time = args.t_backward - stats.t_weight
    ideal = (f"{(args.pp - 1) / (3 * args.microbatches + args.pp - 1):.4f} ideal "
             "(p-1)/(3m+p-1) at F = B = W" if split else
             f"{ideal_bubble(args.pp, args.microbatches, v):.4f} ideal (p-1)/(v*m+p-1)")
    print_report("\n".join([
        f"{args.schedule}: pp={args.pp}, microbatches={args.microbatches}, virtual_stages={v}, "
        f"t_forward={args.t_forward:g}, t_backward={args.t_backward:g}"
        + (f" (B {b_time:g} + W {stats.t_weight:g})" if split else "")
        + f", t_comm={args.t_comm:g} (one cell = "
        f"{min(args.t_forward, *([b_time, stats.t_weight] if split else [b_time])) / v:g})",
        render_timeline(stats, width=args.width),
        f"makespan: {stats.makespan:g}",
        f"bubble fraction: {stats.bubble_fraction:.4f} simulated, {ideal}",
        f"peak live activations per stage (microbatch-chunks): {stats.peak_live_activations}"]))
    if args.png and world_rank() == 0:
        plot_timeline(stats, args.png, title=args.schedule)
        print(f"wrote {args.png}")
    return 0


COLORS = {'F': ['#9fc5e8', '#6fa8dc', '#3d85c6'], 'B': ['#b6d7a8', '#93c47d', '#6aa84f'],
          'W': ['#ffe599', '#ffd966', '#f1c232']}      # darker for later chunks


def draw_timeline(ax, stats, title=None, xlabel='time'):
    """Draw ``stats`` (a ScheduleStats, or anything with its fields) as a Gantt chart on a
    matplotlib Axes: F boxes blue, B green, W yellow."""
    v = stats.virtual_stages
    for s, row in enumerate(stats.start_times):
        for a, start, end in row:
            ax.broken_barh([(start, end - start)], (s - 0.4, 0.8),
                           facecolors=COLORS[a.kind][a.chunk % 3], edgecolors='black',
                           linewidth=0.5)
            ax.text((start + end) / 2, s, action_label(a, v), ha='center', va='center',
                    fontsize=7)
    ax.set_ylim(stats.pp - 0.5, -0.5)
    ax.set_xlim(0, stats.makespan)
    ax.set_yticks(range(stats.pp))
    ax.set_yticklabels([f"stage {s}" for s in range(stats.pp)])
    ax.set_xlabel(xlabel)
    ax.set_title(f"{title + ': ' if title else ''}pp={stats.pp}, microbatches={stats.microbatches}"
                 f"{f', v={v}' if v > 1 else ''}, bubble {stats.bubble_fraction:.1%}")


def plot_timeline(stats, path, title=None):
    """Write a PNG chart of ``stats`` (a ScheduleStats)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg   # lazy: matplotlib optional
    from matplotlib.figure import Figure
    fig = Figure(figsize=(min(30.0, max(6.0, 0.35 * stats.makespan * stats.virtual_stages
                                        / stats.t_forward)), 0.6 * stats.pp + 1.2))
    FigureCanvasAgg(fig)
    draw_timeline(fig.add_subplot(1, 1, 1), stats, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path

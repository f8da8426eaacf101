"""`python -m mpishard plot RUN.jsonl [RUN.jsonl ...] --out FILE.png`: a run's curves (no MPI).

Reads the records `train --metrics-jsonl` streams (train/metrics.py) and draws, one colour per
run (the file name labels it): the training loss per step and the validation loss at each
evaluation (left, log scale when every value is positive), and the throughput, samples/s
(tokens/s for a language model), per step (right). Comparing layouts, or a run with its
restarts (a resumed run's file reads as one run: train/metrics.py drops records past the
resumed step), is giving several files. matplotlib (Agg) is needed, only here.
"""
from __future__ import annotations

import json
import os

from .usage import UsageError


def add_plot_arguments(p):
    p.add_argument("runs", nargs="+", metavar="RUN.jsonl", help="train --metrics-jsonl files")
    p.add_argument("--out", required=True, metavar="FILE.png", help="the PNG to write")
    p.add_argument("--title", help="the figure's title (default: the files' names)")
    return p


def read_run(path) -> dict:
    """{"train": [records], "eval": [records]} of a metrics JSON lines file."""
    runs = {"train": [], "eval": []}
    try:
        with open(path) as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                    runs[record["kind"]].append(record)
                except (ValueError, KeyError, TypeError):
                    raise UsageError(f"{path}:{n}: not a metrics record (train "
                                     "--metrics-jsonl writes them)") from None
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    if not runs["train"] and not runs["eval"]:
        raise UsageError(f"{path}: no metrics records")
    return runs


def draw(runs: dict, title: str | None = None):
    """The figure of {label: read_run(...)}: loss and validation (left), throughput (right)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (loss_ax, rate_ax) = plt.subplots(1, 2, figsize=(12, 4.5))
    positive = True
    for i, (label, run) in enumerate(runs.items()):
        colour = f"C{i % 10}"
        train, evals = run["train"], run["eval"]
        if train:
            loss_ax.plot([r["step"] for r in train], [r["loss"] for r in train], color=colour,
                         lw=1, label=f"{label} train")
            rate = "tokens_per_s" if "tokens_per_s" in train[0] else "samples_per_s"
            rate_ax.plot([r["step"] for r in train], [r[rate] for r in train], color=colour,
                         lw=1, label=f"{label} {rate.replace('_per_s', '/s')}")
            positive &= all(r["loss"] > 0 for r in train)
        if evals:
            loss_ax.plot([r["step"] for r in evals], [r["test_loss"] for r in evals],
                         color=colour, ls="--", marker="o", ms=3, label=f"{label} validation")
            positive &= all(r["test_loss"] > 0 for r in evals)
    if positive:
        loss_ax.set_yscale("log")
    loss_ax.set(xlabel="step", ylabel="loss", title="loss")
    rate_ax.set(xlabel="step", ylabel="per second", title="throughput")
    for ax in (loss_ax, rate_ax):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title or ", ".join(runs))
    fig.tight_layout()
    return fig


def run_plot(args) -> int:
    runs = {}
    for path in args.runs:
        label = os.path.basename(path).removesuffix(".jsonl")
        while label in runs:                       # two runs' files of the same name
            label = f"{label}'"
        runs[label] = read_run(path)
    parent = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(parent):
        raise UsageError(f"--out {args.out}: directory {parent} does not exist")
    fig = draw(runs, args.title)
    fig.savefig(args.out, dpi=110)
    print(f"wrote {args.out}: {len(runs)} run(s)", flush=True)
    return 0


__all__ = ["add_plot_arguments", "draw", "read_run", "run_plot"]

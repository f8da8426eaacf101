"""`--layout auto` (train, bench, generate): the plan's best layout that fits in memory.

    mpiexec -n 4 python -m mpi4py -m mpishard train --model gpt --layout auto --max-memory 2G
    mpiexec -n 4 python -m mpi4py -m mpishard bench --model 784,512,10 --layout auto \\
        --calibration calibration.json

`choose_layout` ranks the plan's candidates (cli/plan.plan_layouts; generation:
costs/choose.generate_rows) by costs/choose.rank_rows: with a calibration the predicted step
time, without one the documented rule of thumb, which the line says. It needs no MPI.

In a job, every rank decides from the same inputs: the memory limit is first made the same
everywhere (`agree_memory_limit`: the smallest rank's, a collective before anything can fail
on one rank alone; the step, or generation's KV cache, is priced on the GPU only where every
rank computes on one, with the run's `--compute-dtype` or `--tf32`: costs/storage.py), then
each rank chooses inside the command's `agreed` preparation (no collective there; a layout
that fits nowhere is the same UsageError on every rank), and `agree_choice` broadcasts rank
0's choice and checks every rank made it (a calibration file
that differs between nodes would not). Rank 0 logs one line: the layout, why (the deciding
numbers) and the runner-up.
"""
from __future__ import annotations

import sys

import numpy as np
from ..costs.calibration import load_calibration, rank_count_note
from ..costs.choose import RULES, add_calls, generate_rows, rank_rows
from ..costs.storage import storage_for
from .device_options import check_compute_flags, held_compute
from .inspect import format_bytes
from .memory_limit import add_max_memory_argument, local_gpu, max_memory
from .plan import candidate_layouts, plan_layouts
from .plan_explain import count_text, unlent_text
from .usage import UsageError, agreed

AUTO = "auto"


def add_auto_arguments(add, calibration: bool = True) -> None:
    """--max-memory and (for the training commands) --calibration through `add`."""
    add_max_memory_argument(add)
    if calibration:
        add("--calibration", metavar="FILE", help="--layout auto: rank by the step time "
            "predicted from this calibration (plan --calibrate writes one; default: the rule "
            "of thumb of docs/planning-and-tracing.md)")


def describe(row: dict, rule: str) -> str:
    """A row's deciding numbers under `rule`."""
    mem = f"memory {format_bytes(row['memory'])}"
    if rule == "calibrated":
        return f"predicted {row['step_s'] * 1e3:.2f} ms/step{unlent_text(row)}, {mem}"
    if rule == "generate":
        return (f"{'KV cache' if row['cached'] else 'no KV cache'}, "
                f"{format_bytes(row['comm'])} sent per decode step, {mem}")
    return (f"pipeline idle {100 * row['bubble']:.0f}%, {format_bytes(row['comm'])} sent per "
            f"step in {row.get('calls', '?')} calls, {count_text(row.get('updated')) or '?'} "
            f"elements updated by the optimizer, {mem}")


def choice_line(ranked: dict, limit: int, source: str, candidates: int,
                planned: str = "") -> str:
    """The one line `--layout auto` logs; `planned`: what the memory was priced for."""
    best, rule = ranked["best"], ranked["rule"]
    runner = ranked["fit"][1] if len(ranked["fit"]) > 1 else None
    return (f"layout auto: {best['layout']} ({describe(best, rule)}); ranked by {RULES[rule]}; "
            f"{len(ranked['fit'])} of {candidates} layouts fit in {format_bytes(limit)} per "
            f"rank ({source})" + (f" for {planned}" if planned else "")
            + (f"; next {runner['layout']} ({describe(runner, rule)})" if runner else ""))


def choose_layout(model, world_size: int, max_memory: int, batch: int = 64,
                  purpose: str = "train", dtype="float32", optimizer: str = "adamw",
                  momentum: float = 0.0, microbatches=None, calibration=None, rows: int = 1,
                  max_len=None, source: str = "--max-memory", compute_dtype=None,
                  device: str = "cpu") -> dict:
    """{'layout': the chosen layout's text, 'line': why (choice_line), 'ranked':
    costs/choose.rank_rows' result}: the best of `world_size`'s layouts predicted to fit in
    `max_memory` bytes per rank. purpose 'train' (also bench): a training step of global
    `batch` rows with `optimizer` (`calibration`: a loaded calibration dict, ranks by its
    predicted step time); 'generate' (also serve): decoding `rows` prompts together, each
    up to `max_len` tokens (default the model's seq_len) in the KV cache. compute_dtype
    (or 'tf32'), device ('cpu' or 'gpu'): how the step holds its arrays, the training step's
    activations or generation's KV cache (costs/storage.py). No MPI. UsageError naming the
    smallest need when no layout fits."""
    itemsize = np.dtype(dtype).itemsize
    storage = storage_for(dtype, compute_dtype, device)
    if purpose == "train":
        rows_, rejected = plan_layouts(model, world_size, batch, dtype, optimizer, momentum,
                                       microbatches, calibration, storage)
    else:
        seq_len = model.seq_len if model.takes_tokens else None
        rows_, rejected = generate_rows(
            model, candidate_layouts(world_size, None, seq_len, model.planned_experts()),
            rows, itemsize, max_len, storage)
    if purpose == "train" and calibration is None:
        add_calls(rows_, model, batch, itemsize)
    ranked = rank_rows(rows_, max_memory, purpose, calibration is not None)
    if ranked["best"] is None:
        if not ranked["over"]:
            raise UsageError(f"--layout auto: no layout of {world_size} rank(s) can run this "
                             f"model (the first refused: {rejected[0][0]}: {rejected[0][1]})"
                             if rejected else "--layout auto: no candidate layout")
        least = ranked["over"][0]
        raise UsageError(f"--layout auto: no layout of {world_size} rank(s) fits in "
                         f"{format_bytes(max_memory)} per rank ({source}): the smallest, "
                         f"{least['layout']}, needs {format_bytes(least['memory'])}; give "
                         f"more --max-memory, more ranks or a smaller model")
    held = f" ({storage.label})" if storage.label else ""
    planned = (f"{batch} rows a forward in {np.dtype(dtype).name}{held}" if purpose == "train" else
               f"{rows} row(s) of up to {max_len or model.seq_len} positions in "
               f"{np.dtype(dtype).name}{held}")
    return {"layout": ranked["best"]["layout"], "ranked": ranked,
            "line": choice_line(ranked, max_memory, source, len(rows_), planned)}


def agree_memory_limit(args, comm) -> None:
    """Collective, with --layout auto only: args.max_memory_limit = (bytes, where from), the
    smallest over the ranks of --max-memory or its default (memory_limit.max_memory), and
    args.planned_device, 'gpu' where every rank computes on a GPU (the step is priced there),
    else 'cpu'; a bad --max-memory is one UsageError on every rank."""
    if args.layout != AUTO:
        return
    error, mine, device = None, (0, ""), getattr(args, "device", None) or "cpu"
    try:
        mine = max_memory(args.max_memory, comm, device)
    except ValueError as exc:
        error = str(exc)
    errors = comm.allgather(error)
    if any(errors):
        raise UsageError(next(e for e in errors if e))
    args.max_memory_limit = min(comm.allgather(mine))
    on_gpu = comm.allgather(device == "gpu" or local_gpu(device) is not None)   # forced, or
    args.planned_device = "gpu" if all(on_gpu) else "cpu"          # auto finding one


def chosen(args, model, world_size: int, purpose: str = "train", batch: int = 64,
           optimizer: str = "adamw", momentum: float = 0.0, prompts=()) -> str:
    """No MPI: with --layout auto, choose_layout's layout for `args` (args.layout_line keeps
    its line), else args.layout itself. generate: `prompts`, the id lists, and
    args.max_new_tokens size the KV cache."""
    if args.layout != AUTO:
        return args.layout
    check_compute_flags(getattr(args, "compute_dtype", None), getattr(args, "tf32", False),
                        getattr(args, "dtype", None) or "float32")     # the flags' own error
    longest = max(map(len, prompts), default=0) + getattr(args, "max_new_tokens", 0)
    calibration = None
    if getattr(args, "calibration", None):
        try:
            calibration = load_calibration(args.calibration)
        except (OSError, ValueError) as exc:
            raise UsageError(f"--calibration {args.calibration}: {exc}") from None
    limit, source = args.max_memory_limit
    choice = choose_layout(model, world_size, limit, batch, purpose,
                           getattr(args, "dtype", None) or "float32", optimizer, momentum,
                           calibration=calibration, rows=max(1, len(prompts)),
                           max_len=min(longest, getattr(model, "seq_len", 1)) or None,
                           source=source, compute_dtype=held_compute(args),
                           device=getattr(args, "planned_device", "cpu"))
    note = rank_count_note(calibration, world_size) if calibration else None
    args.layout_line = choice["line"] + (f" (note: {note})" if note else "")
    return choice["layout"]


def agree_choice(args, comm, layout_text: str, show: bool = False) -> None:
    """Collective after the preparation, with --layout auto only: rank 0's choice broadcast
    and checked on every rank (one UsageError everywhere if a rank chose otherwise); `show`:
    rank 0 writes the line to stderr."""
    if getattr(args, "layout_line", None) is None:
        return
    first = comm.bcast(layout_text, root=0)

    def check():
        if first != layout_text:
            raise UsageError(f"--layout auto: rank {comm.Get_rank()} chose {layout_text!r}, "
                             f"rank 0 {first!r}: the ranks' inputs (a calibration file?) differ")
    agreed(comm, check)
    if show and comm.Get_rank() == 0:
        print(f"mpishard: {args.layout_line}", file=sys.stderr, flush=True)


def provisional(args) -> bool:
    """Whether --layout is auto; if so args.layout becomes None, so that train's flags are
    first validated (and its model built) under the default layout, dp over every rank."""
    if args.layout != AUTO:
        return False
    args.layout = None
    return True


def train_layout(args, model, world_size: int, validate) -> tuple:
    """train's --layout auto, once the provisional validation built the model: the chosen
    layout in args.layout and `validate(args, world_size)` (the train flags' checks) again
    for it; returns validate's (layout, dims, loss)."""
    args.layout = AUTO
    args.layout = chosen(args, model, world_size, "train", args.batch // args.accumulate,
                         args.optimizer, args.momentum)
    return validate(args, world_size)


def log_choice(log, args) -> None:
    """The choice's line on `log` (rank 0's INFO), with --layout auto only."""
    if getattr(args, "layout_line", None):
        log.info("%s", args.layout_line)

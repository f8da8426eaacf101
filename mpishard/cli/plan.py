"""`plan`: every layout of a world size, ranked as `--layout auto` ranks them, no MPI.

    python -m mpishard plan --model 784,512,256,10 --world-size 8 --batch 64
    python -m mpishard plan --hf ./Mixtral-8x7B --world-size 64 --batch 32   # its config.json

Each candidate layout (every factorisation over dp, fsdp with zero=1, 2, 3, pp and tp; for a
decoder also cp, ring and Ulysses, and tp with sequence_parallel=1) is checked as the engine would
check it, then costed: the busiest rank's predicted peak memory in a training step
(costs/peak_memory.py: parameters, gradients, optimizer state, gathered weights, activations
with the pipeline schedule's in-flight microbatches, the loss's logits, buffers;
benchmarks/memory_check.py holds it to the measured high-water mark) and bytes sent per
training step (costs/rank_costs.py), which the strategy files compute for their own part
(tests/cli/test_plan_bench.py holds them to the engine's counters).
Layouts the engine refuses are listed with its reason (the first MAX_REJECTED). The table is
in `--layout auto`'s order (--sort auto: costs/choose.py), `*` on its choice.
`--memory-parts` adds a column per component of the peak. `--json FILE` also writes the table (every
layout that fits), the rejected layouts and --validate's numbers as JSON (plan_json), which
benchmarks/run_all.py's `planner` part reads.

Large worlds: only step_time.representative_ranks are costed (every pp stage, the first and
last coordinate of fsdp, cp and tp, one dp replica: the max over them is the max over all
ranks, tests/costs/test_step_time.py), so 1024 ranks cost at most 8 x pp ranks per layout, not
1024.
"""
from __future__ import annotations

import json
from math import inf

import numpy as np
from mpi4py import MPI

from ..comm.mesh import parse_layout
from ..costs.calibration import DEFAULT_PATH, load_calibration, rank_count_note
from ..costs.choose import add_calls, rank_rows, train_key
from ..costs.peak_memory import COMPONENTS as PEAK_COMPONENTS, rank_peak
from ..costs.rank_costs import COMM_KINDS, check_fit, step_comm_total
from ..costs.step_time import predict_step, representative_ranks
from ..costs.storage import storage_for
from ..validate import check_number
from .inspect import format_bytes, report_mlp
from .model_flag import add_model_arguments
from .calibrate import calibrate
from .device_options import add_held_arguments, held_storage
from .memory_limit import add_max_memory_argument, max_memory, node_ranks
from .plan_explain import explain_report, unlent_seconds
from .plan_time import validate, validation_report, validation_summary
from .usage import UsageError, check_flags, world_rank

__all__ = ["COMM_KINDS", "check_fit", "step_comm_total", "candidate_layouts", "plan_layouts",
           "plan_report", "plan_json", "explain_report", "add_plan_arguments", "run_plan"]


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(world_size: int, microbatches=None, seq_len=None,
                      n_experts=None) -> list:
    """Every layout over dp, fsdp (zero=1, 2, 3), pp and tp whose sizes multiply to
    `world_size`, and for a Mixtral's `n_experts` ep where it divides them (ms.MoE's ep is
    left out). With a GPT's `seq_len`, also cp where it divides seq_len / 2 (ring and
    Ulysses) and tp with sequence_parallel=1."""
    check_number("world size", world_size, low=1, integer=True)
    out = []
    for ep in [e for e in _divisors(world_size) if n_experts and n_experts % e == 0] or [1]:
        for dp in _divisors(world_size // ep):
            for nf in _divisors(world_size // (ep * dp)):
                for pp in _divisors(world_size // (ep * dp * nf)):
                    rest = world_size // (ep * dp * nf * pp)
                    cps = [c for c in _divisors(rest)
                           if seq_len and seq_len % (2 * c) == 0] or [1]
                    for cp in cps:
                        tp = rest // cp
                        axes = [f"{a}={n}" for a, n in (("dp", dp), ("fsdp", nf), ("ep", ep),
                                                         ("pp", pp), ("cp", cp), ("tp", tp))
                                if n > 1]
                        out += [",".join(axes + opts) or "single" for opts in _option_sets(
                            nf, pp, cp, tp, microbatches, seq_len is not None)]
    return out


def _option_sets(nf, pp, cp, tp, microbatches, gpt: bool) -> list:
    """The option lists of one axis combination: zero stages, cp kinds, sequence_parallel."""
    pipe = [f"microbatches={microbatches}"] if pp > 1 and microbatches else []
    kinds = [[], ["cp_kind=ulysses"]] if cp > 1 else [[]]
    sp = [[], ["sequence_parallel=1"]] if gpt and tp > 1 else [[]]
    return [([f"zero={zero}"] if zero else []) + kind + seq + pipe
            for zero in ((1, 2, 3) if nf > 1 else (None,)) for kind in kinds for seq in sp]


def plan_layouts(model, world_size: int, batch: int, dtype=np.float32,
                 optimizer: str = "adamw", momentum: float = 0.0, microbatches=None,
                 calibration=None, storage=None):
    """(rows, rejected): a row per layout that fits, {layout, memory (max over ranks of the
    predicted peak: costs/peak_memory.rank_peak, its arrays held as `storage` says:
    costs/storage.py, default every one in `dtype` on the CPU), parts (that rank's peak by
    component), comm (max over ranks of bytes sent per step), kinds (per kind, of that
    busiest rank)}; rejected = [(layout, reason)]."""
    itemsize = np.dtype(dtype).itemsize
    rows, rejected = [], []
    seq_len = model.seq_len if model.takes_tokens else None    # cp and sequence_parallel
    for text in candidate_layouts(world_size, microbatches, seq_len, model.planned_experts()):
        try:                            # (or one a strategy has no cost model for yet)
            layout = parse_layout(text)
            check_fit(model, layout, batch)
            ranks = representative_ranks(layout)      # the max over them is over all
            peak = max((rank_peak(model, layout, r, batch, itemsize, optimizer, momentum,
                                  storage=storage) for r in ranks), key=lambda p: p["total"])
            comms = [step_comm_total(model, layout, r, batch, itemsize) for r in ranks]
        except ValueError as exc:
            rejected.append((text, str(exc)))
            continue
        busiest = max(comms, key=lambda c: sum(c.values()))
        step = predict_step(model, layout, batch, calibration, itemsize) \
            if calibration else {"step_s": None}
        rows.append({"layout": text, "memory": peak["total"], "comm": sum(busiest.values()),
                     "kinds": busiest, "step_s": step["step_s"],
                     "unlent_s": step.get("unlent_s"),
                     "parts": {k: peak[k] for k in PEAK_COMPONENTS}})
    return rows, rejected


MAX_REJECTED = 40          # a large world rejects thousands: list the first ones

SORT_TEXT = {"time": "time (a pipeline's unlent)",
             "rule": "--layout auto's rule of thumb (pipeline idle time, then bytes and "
                     "calls sent and elements the optimizer updates, then memory)"}


def unlent_cell(row: dict) -> str:
    """plan's unlent cell: the ranking's seconds of a pipeline, '-' for any other row."""
    ranked = unlent_seconds(row)
    return "-" if ranked is None else f"{ranked * 1e3:.2f} ms"


SORT_KEYS = {"memory": lambda r: (r["memory"], r["comm"], r["layout"]),
             "time": lambda r: train_key(r, calibrated=True),       # --layout auto's order
             "rule": lambda r: train_key(r, calibrated=False),     # ... without a calibration
             "comm": lambda r: (r["comm"], r["memory"], r["layout"]),
             "layout": lambda r: r["layout"]}


def plan_report(model, world_size, batch, dtype=np.float32, optimizer="adamw",
                momentum=0.0, microbatches=None, top=None, sort=None,
                calibration=None, layouts=None, memory_parts=False, limit=None,
                storage=None) -> str:
    """The `plan` command's table; `layouts`: plan_layouts' (rows, rejected) for these
    arguments when the caller has them already; memory_parts: a column per component of the
    peak too; sort None or 'auto': `--layout auto`'s order (time with a calibration, else
    its rule of thumb: costs/choose.py); 'time' needs a calibration; `limit` (--max-memory,
    bytes): the * goes to the best row within it as --layout auto ranks, and rows over it
    are marked."""
    if sort not in (None, "auto", *SORT_KEYS):
        raise ValueError(f"sort must be one of {['auto', *sorted(SORT_KEYS)]}, got {sort!r}")
    calibration = calibration or None           # one test throughout: an empty one is none
    if sort == "time" and calibration is None:
        raise ValueError("--sort time needs --calibration FILE or --calibrate (without "
                         "one no step time is predicted; the default, --sort auto, ranks as "
                         "--layout auto's rule of thumb does)")
    sort = ("time" if calibration is not None else "rule") if sort in (None, "auto") else sort
    if top is not None:
        check_number("--top", top, low=1, integer=True)
    rows, rejected = layouts or plan_layouts(model, world_size, batch, dtype, optimizer,
                                             momentum, microbatches, calibration, storage)
    held = f" ({storage.label})" if storage is not None and storage.label else ""
    if calibration is None or sort == "rule":       # the rule's numbers (choose.add_calls)
        add_calls(rows, model, batch, np.dtype(dtype).itemsize)
    ranked = sort in ("time", "rule") and limit is not None     # auto's: the fitting first
    rows.sort(key=(lambda r: (r["memory"] > limit, SORT_KEYS[sort](r))) if ranked else
              SORT_KEYS[sort])
    shown = rows[:top] if top else rows
    kinds = [k for k in COMM_KINDS if any(r["kinds"].get(k) for r in shown)]
    note = rank_count_note(calibration, world_size) if calibration is not None else None
    unlent = calibration is not None and any(unlent_seconds(r) is not None for r in shown)
    lines = [f"plan   {model!r}: {model.num_params():,} parameters, {world_size} ranks, global "
             f"batch {batch}, {np.dtype(dtype).name}{held}, optimizer {optimizer}",
             f"       {len(rows)} layouts pass the engine's checks, {len(rejected)} do not; "
             f"showing {len(shown)}, sorted by {SORT_TEXT.get(sort, sort)}" +
             (f", those within --max-memory {format_bytes(limit)} first" if ranked else ""),
             "memory: max over ranks of the predicted peak in a training step (parameters, "
             "gradients, optimizer state, gathered weights, activations, logits, buffers; "
             "--memory-parts: each)" + (f"; ! over --max-memory {format_bytes(limit)}"
                                        if limit is not None and not calibration else ""),
             "comm:   bytes sent per training step by the busiest rank (train_step + optimizer "
             "step), and its split by kind"] + (
                 [] if calibration else
                 ["*:      the best by --layout auto's rule of thumb (no --calibration; "
                  "--explain shows the rule's numbers)" +
                  (", within --max-memory" if limit is not None else
                   " (no memory limit: --layout auto's is this host's or the job's, "
                   "--explain shows it; give --max-memory)")]) + (
                 ["step:   predicted time per train_step + optimizer step "
                  "(costs/step_time.py and the calibration); * the best as --layout auto "
                  "ranks" + (" (by unlent)" if unlent else "") +
                  (f", within --max-memory {format_bytes(limit)}; ! over it" if limit else
                   " (no memory limit: give --max-memory)")]
                 if calibration else []) + (
                 ["unlent: a pipeline's step as if no other rank could use the cores its idle "
                  "stages leave (1 / (1 - bubble) on its compute; '-': not a pipeline): what "
                  "ranks it (costs/step_time.py ranking_seconds)"] if unlent else []) + (
                 [f"note:   {note}"] if note else []) + [""]
    timed = [] if not calibration else ["step"] + (["unlent"] if unlent else [])
    parts = [k for k in PEAK_COMPONENTS if any(r["parts"][k] for r in shown)] \
        if memory_parts else []
    widths = [max([len("layout")] + [len(r["layout"]) + 2 for r in shown]), 11, 11] + \
        [11] * len(timed) + [max(11, len(k)) for k in parts + kinds]
    header = ["layout", "memory", "comm/step"] + timed + parts + kinds
    best = rank_rows(rows, inf if limit is None else limit,
                     calibrated=calibration is not None)["best"]
    best = best and best["layout"]
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(header, widths))))
    for r in shown:
        mark = " *" if r["layout"] == best else \
            " !" if limit is not None and r["memory"] > limit else ""
        cells = [r["layout"] + mark, format_bytes(r["memory"]), format_bytes(r["comm"])] + \
            [f"{r['step_s'] * 1e3:.2f} ms" if k == "step" else unlent_cell(r) for k in timed] + \
            [format_bytes(r["parts"][k]) for k in parts] + \
            [format_bytes(r["kinds"].get(k, 0)) for k in kinds]
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))))
    if rejected:
        lines.append("")
        lines.append("rejected by the engine's checks:")
        lines += [f"  {text}: {reason}" for text, reason in rejected[:MAX_REJECTED]]
        if len(rejected) > MAX_REJECTED:
            lines.append(f"  ... and {len(rejected) - MAX_REJECTED} more")
    return "\n".join(lines)


def plan_json(model, world_size, batch, dtype, rows, rejected, validation=None,
              storage=None) -> dict:
    """What `plan --json FILE` writes: every layout that fits (bytes; predicted seconds or
    null without a calibration), the predicted best, the rejected ones with the reason, and
    with --validate its numbers (plan_time.validation_summary); what the memory was priced
    for (costs/storage.py: the compute dtype, and the device)."""
    timed = [r for r in rows if r["step_s"] is not None]
    storage = storage or storage_for(dtype)
    return {"model": repr(model), "parameters": model.num_params(), "world_size": world_size,
            "batch": batch, "dtype": np.dtype(dtype).name, "compute_dtype": storage.name,
            "device": "gpu" if storage.device else "cpu",
            "layouts": [{k: r[k] for k in ("layout", "memory", "parts", "comm", "kinds",
                                           "step_s", "unlent_s")}
                        for r in rows],
            "predicted_best": min(timed, key=SORT_KEYS["time"])["layout"] if timed else None,
            "rejected": [{"layout": text, "reason": reason} for text, reason in rejected],
            "validate": validation}


def add_plan_arguments(p):
    add_model_arguments(p, hf=True)    # a GPT's batch row is one sequence of seq_len tokens
    p.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    p.add_argument("--batch", type=int, default=64, help="global batch per step (64)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    add_held_arguments(p.add_argument)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="optimizer whose state is counted (adamw)")
    p.add_argument("--momentum", type=float, default=0.0, help="with --optimizer sgd")
    p.add_argument("--activation", default="relu", help="hidden activation (relu)")
    p.add_argument("--no-bias", action="store_true", help="layers without bias")
    p.add_argument("--microbatches", type=int, help="pp layouts: microbatches per step "
                   "(default: the engine's, pp)")
    p.add_argument("--memory-parts", action="store_true", help="a column per component of "
                   "the peak memory (parameters, gradients, optimizer, gathered, activations, "
                   "logits, buffers)")
    p.add_argument("--top", type=int, default=10, help="show the best K layouts (10)")
    p.add_argument("--sort", default="auto", choices=["auto", *sorted(SORT_KEYS)],
                   help="auto (default: as --layout auto ranks, time with a calibration, "
                   "else rule), rule (the rule of thumb: pipeline idle time, bytes and "
                   "calls sent and elements the optimizer updates, memory), time "
                   "(predicted step time, a pipeline's with its idle time paid in full; "
                   "needs a calibration), memory (then comm), comm "
                   "(then memory) or layout")
    p.add_argument("--calibrate", metavar="FILE", nargs="?", const=DEFAULT_PATH,
                   help="measure this machine first (under mpiexec: every rank of the job) "
                        f"and write the calibration to FILE ({DEFAULT_PATH})")
    p.add_argument("--calibration", metavar="FILE", help="predict step times from FILE")
    p.add_argument("--validate", type=int, metavar="K", help="run the K layouts ranked "
                   "first (as --sort time) for a few steps in this MPI job (its size = "
                   "--world-size) and print predicted vs measured")
    p.add_argument("--explain", action="store_true", help="show how --layout auto ranks the "
                   "top layouts: memory against --max-memory, the predicted step time (with "
                   "a calibration) or the rule of thumb's numbers")
    add_max_memory_argument(p.add_argument, gpu=False)
    p.add_argument("--json", metavar="FILE", help="also write the layouts, and with --validate "
                   "the predicted vs measured times and their summary, to FILE (rank 0)")
    return p


def run_plan(args) -> int:
    check_flags(args, ("world_size", "batch", "microbatches", "top", "validate"), low=0,
                low_open=True)
    calibration = None
    if args.calibrate:
        calibration = calibrate(args.calibrate, np.dtype(args.dtype))
    elif args.calibration:
        calibration = load_calibration(args.calibration)
    if args.validate and calibration is None:
        raise UsageError("plan: --validate needs --calibration FILE or --calibrate")
    storage = held_storage(args, args.dtype, args.device)

    def report(model):
        layouts = plan_layouts(model, args.world_size, args.batch, args.dtype, args.optimizer,
                               args.momentum, args.microbatches, calibration, storage)
        text = plan_report(model, args.world_size, args.batch, dtype=args.dtype,
                           optimizer=args.optimizer, momentum=args.momentum,
                           microbatches=args.microbatches, top=args.top, sort=args.sort,
                           calibration=calibration, layouts=layouts,
                           memory_parts=args.memory_parts, storage=storage,
                           limit=max_memory(args.max_memory)[0] if args.max_memory else None)
        if args.explain:
            rows = layouts[0]              # plan_report added the rule's calls to them
            limit, source = max_memory(args.max_memory)
            if args.max_memory is None and args.device == "gpu":
                source += ("; this host's memory, not a GPU's: planning a GPU run, give "
                           "--max-memory (the GPU's memory a rank may use)")
            elif args.max_memory is None and args.world_size > 1 and node_ranks() == 1:
                source += (f"; plan ran as one process: where {args.world_size} ranks share "
                           f"a node, --max-memory gives a rank's share")
            text += "\n\n" + explain_report(rows, limit, source,
                                             calibration is not None, args.top)
        summary = None
        if args.validate:
            if MPI.COMM_WORLD.Get_size() != args.world_size:
                raise ValueError(f"--validate runs in this MPI job: launch {args.world_size} "
                                 f"ranks, not {MPI.COMM_WORLD.Get_size()}")
            results = validate(model, layouts[0], args.batch, np.dtype(args.dtype),
                               calibration, args.validate)
            text += "\n\nvalidate:\n" + validation_report(results, validate.drift)
            summary = validation_summary(results, validate.drift)
        if args.json and world_rank() == 0:
            with open(args.json, "w") as f:
                json.dump(plan_json(model, args.world_size, args.batch, args.dtype,
                                    *layouts, summary, storage), f, indent=1)
        return text
    return report_mlp("plan", args, report)

"""`inspect`: a checkpoint, or a layout planned without MPI.

    python -m mpishard inspect CKPT
    python -m mpishard inspect --layout dp=2,tp=2,pp=2 --model 64,256,256,10
    mpiexec -n 4 python -m mpi4py -m mpishard inspect --env

`--env` prints the MPI library and version, whether it is CUDA-aware and why, the GPU
communication path `--gpu-comm auto` resolves to and why (comm/backend.py), the cupy version,
the visible GPUs and which GPU each rank uses (comm/gpu.py).

A checkpoint prints its names, shapes, dtypes, layout and step (checkpoint.describe). A layout
prints the mesh (each rank's coordinates, the groups of every axis), each parameter's block on
every rank, how it is split (which dim over which mesh axis, or replicated, and over which
axes the same block is copied) and each rank's memory, all from parallel/compose.py's
plan_params and costs/rank_costs.py: the engine's own placements, so what it prints is what the
engine will hold; beside it each rank's predicted peak in a training step of `--batch`
rows (costs/peak_memory.py; `--memory-parts`: its transient parts). `--hf DIR` instead of
--model (here and in plan) is the model of a Hugging Face directory's config.json
(model_flag.model_from_hf; no weights read).
"""
from __future__ import annotations

import numpy as np

from ..checkpoint import CheckpointError, describe, load
from ..comm.backend import Backend
from ..comm.gpu import environment_report
from ..comm.mesh import AXES, coordinates, group_ranks, parse_layout
from ..parallel.compose import plan_params
from ..costs.peak_memory import COMPONENTS as PEAK_COMPONENTS, rank_peak
from ..costs.rank_costs import check_fit, rank_memory
from ..nn import cudnn_attention
from .device_options import add_held_arguments, held_storage
from .model_flag import add_model_arguments, model_from_args
from .usage import UsageError, print_report, world_comm


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB or GiB: '512 B', '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def layout_report(model, layout, dtype=np.float64, optimizer: str = "adamw",
                  momentum: float = 0.0, shapes: bool = True, batch=None,
                  memory_parts: bool = False, storage=None) -> str:
    """Text report: the mesh groups, each rank's shard shapes and memory (no MPI); `layout`
    is a parsed Layout. Memory: each rank's held state and its predicted peak in a training
    step of `batch` global rows (costs/peak_memory.rank_peak; None: the fewest rows the
    layout takes, one per data-parallel rank and microbatch; storage: how the step holds its
    arrays, costs/storage.py), with memory_parts each of the peak's transient components
    too."""
    microbatches = check_fit(model, layout)   # the engine's ValueError for a layout it refuses
    batch = layout.data_parallel_size * microbatches if batch is None else batch
    itemsize = np.dtype(dtype).itemsize
    world = layout.world_size
    lines = [f"model  {model!r}: {model.num_params():,} parameters",
             f"layout {layout.text!r}: {world} ranks; rank order "
             + " > ".join(AXES) + " (tp innermost)"]
    if layout.options:
        lines.append("options " + ", ".join(f"{k}={v}" for k, v in layout.options.items()))
    lines.append("")
    lines.append("rank  " + "  ".join(f"{a:>4}" for a in AXES))
    for r in range(world):
        c = coordinates(layout, r)
        lines.append(f"{r:>4}  " + "  ".join(f"{c[a]:>4}" for a in AXES))
    for a in layout.active_axes:
        groups = sorted({tuple(group_ranks(layout, r, a)) for r in range(world)})
        lines.append(f"{a}={layout.size(a)} groups: "
                     + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups))
    lines.append("")
    mems = [rank_memory(model, layout, r, itemsize, optimizer, momentum) for r in range(world)]
    if shapes:
        lines += _shape_lines(model, layout, mems)
    lines.append(f"dtype  {np.dtype(dtype).name} assumed" + (
        " (make_engine's default; --dtype float32 for train's)"
        if np.dtype(dtype) == np.float64 else " (train's default; make_engine's is float64)"))
    peaks = [rank_peak(model, layout, r, batch, itemsize, optimizer, momentum,
                       storage=storage) for r in range(world)]
    held = f", {storage.label}" if storage is not None and storage.label else ""
    parts = [k for k in PEAK_COMPONENTS[3:] if any(p[k] for p in peaks)] if memory_parts \
        else []
    lines.append(f"memory per rank ({np.dtype(dtype).name}{held}, optimizer {optimizer}; peak: "
                 f"predicted in a training step of global batch {batch}, "
                 + ("its transient parts beside it)" if memory_parts else
                    "--memory-parts: its transient parts)"))
    columns = ["parameters", "gradients", "optimizer", "peak"] + parts
    lines.append(f"{'rank':>4}  " + "  ".join(f"{c:>12}" for c in columns))
    for r, p in enumerate(peaks):
        cells = [format_bytes(p["total" if k == "peak" else k]) for k in columns]
        lines.append(f"{r:>4}  " + "  ".join(f"{c:>12}" for c in cells))
    return "\n".join(lines)


def _shape_lines(model, layout, mems) -> list:
    """Per parameter: its full shape, each distinct local block and the ranks holding it, and
    how it is split (placement_text)."""
    world = len(mems)
    plan = plan_params(model, layout)
    rows = []
    for name, full in model.param_shapes().items():
        blocks = [mems[r]["shapes"].get(name) for r in range(world)]
        distinct = sorted({b for b in blocks if b is not None}, key=str)
        where = ", ".join(
            f"{'x'.join(map(str, b))} on ranks "
            + ",".join(str(r) for r in range(world) if blocks[r] == b) for b in distinct)
        rows.append((f"  {name:<28} {'x'.join(map(str, full)):>12} -> {where}",
                     placement_text(plan[name].placement, layout)))
    width = max(len(row) for row, _ in rows)
    sharded = sum(not text.startswith("replicated") for _, text in rows)
    zero = layout.option("zero", 3) if layout.size("fsdp") > 1 else 3
    return ["shard shapes (full shape -> local block, on which ranks; sharded: which dim over "
            "which mesh axis, or replicated)"] + [
        f"{row:<{width}}  {text}" for row, text in rows] + [
        f"{sharded} of {len(rows)} tensors sharded, {len(rows) - sharded} replicated"] + (
        [f"fsdp zero={zero}: the parameters are whole on every fsdp rank; "
         + ("the optimizer state is" if zero == 1 else "gradients and optimizer state are")
         + " sharded over fsdp"] if zero in (1, 2) else []) + [""]


def placement_text(placement, layout) -> str:
    """How a parameter lies on the mesh: 'sharded dim 1 over tp' for each split (padded: the
    dim is padded to divide; blocks: each of that many equal blocks of the dim is split, a
    fused qkv), 'on ep=1 only' for an owner, else 'replicated'; then the other active axes,
    over which every rank holds the same block, and the pp stage(s) holding it."""
    splits = [f"dim {s.dim} over {s.axis}" + (" (padded)" if s.pad else "")
              + (f" (each of {s.blocks} blocks)" if s.blocks > 1 else "")
              for s in placement.shards]
    splits += [f"on {axis}={coord} only" for axis, coord in placement.owner.items()]
    copies = [a for a in layout.active_axes if a != "pp" and placement.is_replicated_on(a)]
    text = ("sharded " + ", ".join(splits)) if splits else "replicated"
    if copies:
        text += ("; copies over " if splits else " over ") + ", ".join(copies)
    if layout.size("pp") > 1:
        stages = placement.stages
        text += f"; pp stage{'s' if len(stages) > 1 else ''} " + ",".join(map(str, stages))
    return text


# -- the command -------------------------------------------------------------------------------
def add_inspect_arguments(p):
    p.add_argument("checkpoint", nargs="?", metavar="CKPT",
                   help="a checkpoint directory: prints names, shapes, dtypes, layout, step")
    p.add_argument("--layout", help="plan a layout instead (no MPI launch needed): the mesh "
                   "groups, each rank's shard shapes and memory, e.g. dp=2,tp=2,pp=2")
    add_model_arguments(p, required=False, hf=True)
    p.add_argument("--activation", default="relu", help="with --layout (default relu)")
    p.add_argument("--no-bias", action="store_true", help="with --layout: layers without bias")
    p.add_argument("--dtype", default=None, choices=["float32", "float64"],
                   help="with --layout: the dtype memory is counted in (default float64, "
                   "make_engine's default, or float32 with --compute-dtype or --tf32; train "
                   "defaults to float32)")
    add_held_arguments(p.add_argument)
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="with --layout: optimizer whose state is counted (default adamw)")
    p.add_argument("--momentum", type=float, default=0.0, help="with --optimizer sgd")
    p.add_argument("--batch", type=int, help="with --layout: global rows per training step "
                   "the peak memory is predicted for (default: one per data-parallel rank and "
                   "microbatch)")
    p.add_argument("--memory-parts", action="store_true", help="with --layout: the peak "
                   "memory's transient parts (gathered weights, activations, logits, buffers)")
    p.add_argument("--env", action="store_true", help="the MPI library, CUDA-aware yes/no and "
                   "why, the GPU communication path --gpu-comm auto takes (mpi or staged; "
                   "host without a GPU) and why, cupy, the visible GPUs and each rank's GPU "
                   "(collective under mpiexec)")
    return p


def run_inspect(args) -> int:
    model_given = args.model is not None or args.hf is not None
    if args.env:
        if args.checkpoint is not None or args.layout is not None or model_given:
            raise UsageError("inspect: --env takes no checkpoint, --layout, --model or --hf")
        world = world_comm()
        backend = Backend("auto", world)               # the path gpu_comm="auto" takes here
        text = environment_report(world, (backend.comm_path, backend.comm_path_reason))
        return print_report(text and f"{text}\ncuDNN attention  {cudnn_attention.status()}")
    if args.layout is not None or model_given:
        return _run_inspect_layout(args)
    if args.checkpoint is None:
        raise UsageError("inspect: give a checkpoint directory (inspect CKPT) or "
                         "--layout L --model DIMS")
    try:
        text = describe(args.checkpoint)              # every rank reads, rank 0 prints
        text += saved_placements(args.checkpoint)
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    return print_report(text)


def saved_placements(path) -> str:
    """How each tensor of the checkpoint at `path` was split across the ranks that saved it
    (placement_text under its layout), or '' when its model cannot be rebuilt here."""
    ckpt = load(path, verify=False)
    model = ckpt.model()
    try:
        layout = parse_layout(ckpt.layout)
        plan = plan_params(model, layout) if model is not None else None
    except (ValueError, TypeError):
        plan = None
    if not plan:
        return ""
    texts = {name: placement_text(info.placement, layout) for name, info in plan.items()}
    width = max(map(len, texts))
    sharded = sum(not t.startswith("replicated") for t in texts.values())
    return "\n".join([f"\n  as saved under layout {layout.text!r} ({sharded} of {len(texts)} "
                      f"tensors sharded, {len(texts) - sharded} replicated):"]
                     + [f"  {name:<{width}}  {text}" for name, text in texts.items()])


def _run_inspect_layout(args) -> int:
    if args.checkpoint is not None:
        raise UsageError("inspect: give either a checkpoint or --layout/--model, not both")
    if args.layout is None or (args.model is None and args.hf is None):
        raise UsageError("inspect: --layout and --model (or --hf DIR) go together, e.g. "
                         "inspect --layout dp=2,tp=2 --model 64,256,256,10")
    if args.dtype is None:               # a compute dtype's master weights are float32
        args.dtype = "float32" if args.compute_dtype or args.tf32 else "float64"
    storage = held_storage(args, args.dtype, args.device)
    return report_mlp("inspect", args, lambda model: layout_report(
        model, parse_layout(args.layout), dtype=args.dtype, optimizer=args.optimizer,
        momentum=args.momentum, batch=args.batch, memory_parts=args.memory_parts,
        storage=storage))


def report_mlp(command, args, report) -> int:
    """inspect --layout and plan: `report(the model of --model or --hf, model_flag.py)`,
    printed by rank 0; the model's or the layout's ValueError/TypeError is a UsageError."""
    model = model_from_args(args, command)
    try:
        text = report(model)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{command}: {exc}") from None
    return print_report(text)

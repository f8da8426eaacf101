"""`inspect`: a checkpoint, or a layout planned without MPI.

    python -m mpishard inspect CKPT
    python -m mpishard inspect --layout dp=2,tp=2,pp=2 --model 64,256,256,10
    mpiexec -n 4 python -m mpi4py -m mpishard inspect --env

`--env` prints the MPI library and version, whether it is CUDA-aware and why, the cupy version,
the visible GPUs and which GPU each rank uses (comm/gpu.py).

A checkpoint prints its names, shapes, dtypes, layout and step (checkpoint.describe). A layout
prints the mesh (each rank's coordinates, the groups of every axis), each parameter's block on
every rank and each rank's memory, all from parallel/costs.py: the engine's own placements,
so what it prints is what the engine will hold.
"""
from __future__ import annotations

import numpy as np

from ..checkpoint import CheckpointError, describe
from ..comm.gpu import environment_report
from ..comm.mesh import AXES, coordinates, group_ranks, parse_layout
from ..parallel.costs import check_fit, rank_memory
from .model_flag import add_model_arguments, model_from_flag
from .usage import UsageError, print_report, world_comm


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB or GiB: '512 B', '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024


def layout_report(model, layout, dtype=np.float64, optimizer: str = "adamw",
                  momentum: float = 0.0, shapes: bool = True) -> str:
    """Text report: the mesh groups, each rank's shard shapes and memory (no MPI); `layout`
    is a parsed Layout."""
    check_fit(model, layout)       # the engine's own ValueError for a layout it would refuse
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
        lines += _shape_lines(model, mems)
    lines.append(f"dtype  {np.dtype(dtype).name} assumed" + (
        " (make_engine's default; --dtype float32 for train's)"
        if np.dtype(dtype) == np.float64 else " (train's default; make_engine's is float64)"))
    lines.append(f"memory per rank ({np.dtype(dtype).name}, optimizer {optimizer}; "
                 "activations not included)")
    lines.append(f"{'rank':>4}  {'parameters':>12}  {'gradients':>12}  {'optimizer':>12}  "
                 f"{'total':>12}")
    for r, m in enumerate(mems):
        lines.append(f"{r:>4}  " + "  ".join(f"{format_bytes(m[k]):>12}" for k in
                                             ("parameters", "gradients", "optimizer", "total")))
    return "\n".join(lines)


def _shape_lines(model, mems) -> list:
    """Per parameter: its full shape, then each distinct local block and the ranks holding it."""
    world = len(mems)
    lines = ["shard shapes (full shape -> local block, on which ranks)"]
    for name, full in model.param_shapes().items():
        blocks = [mems[r]["shapes"].get(name) for r in range(world)]
        distinct = sorted({b for b in blocks if b is not None}, key=str)
        where = ", ".join(
            f"{'x'.join(map(str, b))} on ranks "
            + ",".join(str(r) for r in range(world) if blocks[r] == b) for b in distinct)
        lines.append(f"  {name:<28} {'x'.join(map(str, full)):>12} -> {where}")
    return lines + [""]


# -- the command -------------------------------------------------------------------------------
def add_inspect_arguments(p):
    p.add_argument("checkpoint", nargs="?", metavar="CKPT",
                   help="a checkpoint directory: prints names, shapes, dtypes, layout, step")
    p.add_argument("--layout", help="plan a layout instead (no MPI launch needed): the mesh "
                   "groups, each rank's shard shapes and memory, e.g. dp=2,tp=2,pp=2")
    add_model_arguments(p, required=False)
    p.add_argument("--activation", default="relu", help="with --layout (default relu)")
    p.add_argument("--no-bias", action="store_true", help="with --layout: layers without bias")
    p.add_argument("--dtype", default="float64", choices=["float32", "float64"],
                   help="with --layout: the dtype memory is counted in (default float64, "
                   "make_engine's default; train defaults to float32)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="with --layout: optimizer whose state is counted (default adamw)")
    p.add_argument("--momentum", type=float, default=0.0, help="with --optimizer sgd")
    p.add_argument("--env", action="store_true", help="the MPI library, CUDA-aware yes/no and "
                   "why, cupy, the visible GPUs and each rank's GPU (collective under mpiexec)")
    return p


def run_inspect(args) -> int:
    if args.env:
        if args.checkpoint is not None or args.layout is not None or args.model is not None:
            raise UsageError("inspect: --env takes no checkpoint, --layout or --model")
        return print_report(environment_report(world_comm()))
    if args.layout is not None or args.model is not None:
        return _run_inspect_layout(args)
    if args.checkpoint is None:
        raise UsageError("inspect: give a checkpoint directory (inspect CKPT) or "
                         "--layout L --model DIMS")
    try:
        text = describe(args.checkpoint)              # every rank reads, rank 0 prints
    except CheckpointError as exc:
        raise UsageError(str(exc)) from None
    return print_report(text)


def _run_inspect_layout(args) -> int:
    if args.checkpoint is not None:
        raise UsageError("inspect: give either a checkpoint or --layout/--model, not both")
    if args.layout is None or args.model is None:
        raise UsageError("inspect: --layout and --model go together, e.g. "
                         "inspect --layout dp=2,tp=2 --model 64,256,256,10")
    return report_mlp("inspect", args, lambda model: layout_report(
        model, parse_layout(args.layout), dtype=args.dtype, optimizer=args.optimizer,
        momentum=args.momentum))


def report_mlp(command, args, report) -> int:
    """inspect --layout and plan: `report(the MLP or GPT of --model, model_flag.py)`, printed by
    rank 0; the model's or the layout's ValueError/TypeError is a UsageError."""
    try:
        model = model_from_flag(args.model, args.activation, bias=not args.no_bias,
                                gpt=getattr(args, "gpt", None))
        text = report(model)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{command}: {exc}") from None
    return print_report(text)

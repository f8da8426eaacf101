"""Plan a layout without launching MPI: the mesh, each rank's shard shapes, memory per rank.

`python -m mpishard inspect --layout dp=2,tp=2,pp=2 --model 64,256,256,10` prints this. It uses
exactly the functions the engine uses (mesh.coordinates / group_ranks for the groups,
mesh_engine.plan_params for placements, placement.local_shape for block shapes), so what it
prints is what the engine will hold.

Memory per rank counts the blocks a rank stores:
  parameters   the stored parameter blocks (fsdp zero=3: 1/N of each tensor, padded)
  gradients    same shapes as the parameters; zero=1 adds the owned 1/N averaged slice to the
               full gradient it holds during the backward, zero=2 keeps only the slice
               (zero=1/2 store parameters and full gradients padded to N equal slices)
  optimizer    AdamW: 2 arrays per parameter block (exp_avg, exp_avg_sq), SGD with momentum:
               1, plain SGD: 0; zero=1/2 keep state only for the owned 1/N slice
Transient buffers (an fsdp all-gathered weight, activations) are not included: the running
engine's `memory_report()` measures them.
"""
from __future__ import annotations

from math import prod

import numpy as np

from . import mesh as meshmod
from . import placement as pl
from .mesh import AXES, parse_layout


def _owned_slice_shape(shape, n):
    """Shape of a ZeRO-1/2 owned slice: dim 0 split (padded) into n blocks."""
    if not shape:
        return shape
    return (-(-shape[0] // n),) + tuple(shape[1:])


def rank_memory(model, layout, rank: int, itemsize: int = 8, optimizer: str = "adamw",
                momentum: float = 0.0) -> dict:
    """Bytes of parameters, gradients and optimizer state held by `rank` (no MPI)."""
    from .strategies.mesh_engine import plan_params

    layout = parse_layout(layout)
    plan = plan_params(model, layout)
    coords = meshmod.coordinates(layout, rank)
    zero = layout.option("zero", 3) if layout.size("fsdp") > 1 else 0
    nf = layout.size("fsdp")
    n_state = {"adamw": 2, "adam": 2, "sgd": 1 if momentum else 0}.get(optimizer, 2)
    params = grads = state = 0
    shapes = {}
    for name, info in plan.items():
        if info.placement.stage != coords["pp"]:
            continue
        owner = getattr(info.placement, "owner", None)
        if owner and any(coords.get(a) != c for a, c in owner.items()):
            continue
        shape = pl.local_shape(info.full_shape, info.placement, layout.sizes)
        shapes[name] = shape
        n = prod(shape) * itemsize
        if zero in (1, 2):
            # ZeRO-1/2 (fsdp.py): the parameter sits in a buffer padded to N owned slices;
            # zero=1 holds the full (padded) gradient during the backward plus its owned
            # averaged slice, zero=2 only the slice; optimizer state covers the slice.
            sliced = prod(_owned_slice_shape(shape, nf)) * itemsize
            params += sliced * nf
            grads += sliced if zero == 2 else sliced * nf + sliced
            state += n_state * sliced
        else:
            params += n
            grads += n
            state += n_state * n
    return {"parameters": params, "gradients": grads, "optimizer": state,
            "total": params + grads + state, "shapes": shapes}


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def layout_report(model, layout, dtype=np.float64, optimizer: str = "adamw",
                  momentum: float = 0.0, shapes: bool = True) -> str:
    """Text report: the mesh groups, each rank's shard shapes and memory (no MPI)."""
    layout = parse_layout(layout)
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
        c = meshmod.coordinates(layout, r)
        lines.append(f"{r:>4}  " + "  ".join(f"{c[a]:>4}" for a in AXES))
    for a in layout.active_axes:
        groups = sorted({tuple(meshmod.group_ranks(layout, r, a)) for r in range(world)})
        lines.append(f"{a}={layout.size(a)} groups: "
                     + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups))
    lines.append("")
    mems = [rank_memory(model, layout, r, itemsize, optimizer, momentum) for r in range(world)]
    if shapes:
        names = list(model.param_shapes())
        lines.append("shard shapes (full shape -> local block, on which ranks)")
        for name in names:
            full = tuple(model.param_shapes()[name])
            blocks = [mems[r]["shapes"].get(name) for r in range(world)]
            distinct = sorted({b for b in blocks if b is not None}, key=str)
            where = ", ".join(
                f"{'x'.join(map(str, b))} on ranks "
                + ",".join(str(r) for r in range(world) if blocks[r] == b) for b in distinct)
            lines.append(f"  {name:<28} {'x'.join(map(str, full)):>12} -> {where}")
        lines.append("")
    lines.append(f"memory per rank ({np.dtype(dtype).name}, optimizer {optimizer}; "
                 "activations not included)")
    lines.append(f"{'rank':>4}  {'parameters':>12}  {'gradients':>12}  {'optimizer':>12}  "
                 f"{'total':>12}")
    for r, m in enumerate(mems):
        lines.append(f"{r:>4}  {_fmt_bytes(m['parameters']):>12}  {_fmt_bytes(m['gradients']):>12}"
                     f"  {_fmt_bytes(m['optimizer']):>12}  {_fmt_bytes(m['total']):>12}")
    return "\n".join(lines)

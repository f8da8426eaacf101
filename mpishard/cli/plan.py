"""Plan layouts without launching MPI: the mesh, shard shapes, memory and communication per rank.

`python -m mpishard inspect --layout dp=2,tp=2,pp=2 --model 64,256,256,10` prints one layout;
`python -m mpishard plan --model 784,512,256,10 --world-size 8 --batch 64` ranks every layout of
a world size by memory, then communication, per rank (`plan_report`). It uses
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

Communication per training step (`step_comm`): the bytes a rank sends in one
`engine.train_step` (sync) plus one optimizer step, per collective kind, exactly as the engine
counts them in `engine.comm_bytes` (ring formulas: all_reduce 2(n-1)/n x array,
all_gather (n-1)/n x the gathered array, reduce_scatter (n-1)/n x the input, broadcast
(n-1)/n x array on the root only, send the message). With B the global batch, R = dp*fsdp the
data-parallel size, r = B/R this rank's rows, m the microbatches (1 without pp), s the item size:

  dp        all_reduce(avg) of this rank's gradient blocks over dp: 2(dp-1)/dp x G_rank
  fsdp=3    per microbatch: all_gather of W and b before the forward, of W again before the
            backward, reduce_scatter(avg) of both gradients: (N-1) x shard bytes each (shards
            padded to ceil(L/N) rows, so the padding travels too)
  fsdp=1/2  reduce_scatter(avg) of the gradient into owned slices (zero=2: per microbatch,
            zero=1: once, at sync), all_gather of the updated slices after the optimizer step:
            (N-1) x slice bytes each
  tp        per column layer except the model's first: all_reduce of dL/dx, r x d_in, backward;
            per row layer: all_reduce of its partial output, r x d_out, forward; the replicated
            odd last layer: nothing (tensor_parallel.py)
  pp        per virtual stage boundary: the activation r x w forward and its gradient backward
            (w the boundary layer's d_out, divided by tp after a column layer); the last stage
            broadcasts the loss over pp: (pp-1)/pp x 8
  loss      all_reduce(avg) of the float64 loss over the data axes: 2(R-1)/R x 8

What the counters (and so these formulas) leave out: the 96-byte header of every point-to-point
message and of a broadcast, the 8-byte length exchange before each all_gather, and an optional
gradient clipping (one world all_reduce of 8 bytes). Group sizes that are powers of two give
integers; otherwise the engine truncates each call's count, up to one byte per call below this.
"""
from __future__ import annotations

from collections import Counter
from math import prod

import numpy as np

from ..comm import mesh as meshmod
from ..parallel import placement as pl
from ..comm.mesh import AXES, parse_layout


def _owned_slice_shape(shape, n):
    """Shape of a ZeRO-1/2 owned slice: dim 0 split (padded) into n blocks."""
    if not shape:
        return shape
    return (-(-shape[0] // n),) + tuple(shape[1:])


def rank_memory(model, layout, rank: int, itemsize: int = 8, optimizer: str = "adamw",
                momentum: float = 0.0) -> dict:
    """Bytes of parameters, gradients and optimizer state held by `rank` (no MPI)."""
    from ..parallel.compose import plan_params

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


def layout_report(model, layout, dtype=np.float64, optimizer: str = "adamw",
                  momentum: float = 0.0, shapes: bool = True) -> str:
    """Text report: the mesh groups, each rank's shard shapes and memory (no MPI)."""
    layout = parse_layout(layout)
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
        c = meshmod.coordinates(layout, r)
        lines.append(f"{r:>4}  " + "  ".join(f"{c[a]:>4}" for a in AXES))
    for a in layout.active_axes:
        groups = sorted({tuple(meshmod.group_ranks(layout, r, a)) for r in range(world)})
        lines.append(f"{a}={layout.size(a)} groups: "
                     + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups))
    lines.append("")
    mems = [rank_memory(model, layout, r, itemsize, optimizer, momentum) for r in range(world)]
    if shapes:
        lines.append("shard shapes (full shape -> local block, on which ranks)")
        for name, full in model.param_shapes().items():
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


# -- communication per training step (no MPI) ---------------------------------------------------
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "send")
LOSS_BYTES = 8                        # the loss travels as one float64


def _all_reduce_bytes(n: int, nbytes: float) -> float:
    """What the engine counts for an all_reduce of `nbytes` over n ranks (ring)."""
    return 2 * (n - 1) / n * nbytes


def check_fit(model, layout, batch=None) -> int:
    """Raise ValueError (the engine's own, where it has one) unless `layout` can train `model`
    on a global batch of `batch` rows; returns the microbatches per step (1 without pp)."""
    from ..parallel.schedules import make_schedule
    from ..parallel.compose import plan_params

    layout = parse_layout(layout)
    plan_params(model, layout)          # tp must divide the hidden sizes, pp <= layers, ...
    m = 1
    if layout.size("pp") > 1:
        from ..parallel.pipeline import pipeline_options

        pp, name, v, m = pipeline_options(layout)
        make_schedule(name, pp, m, v)   # interleaved: microbatches a multiple of pp
    if batch is not None:
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        n = layout.data_parallel_size
        if batch % n:
            raise ValueError(f"batch {batch} does not divide by the {n} data-parallel ranks "
                             f"of layout {layout.text!r}")
        if (batch // n) % m:
            raise ValueError(f"microbatches={m} does not divide the local batch of "
                             f"{batch // n} rows (batch {batch} / {n} data-parallel ranks) "
                             f"of layout {layout.text!r}")
    return m


def boundary_widths(model, layout) -> dict:
    """Virtual stage k -> width of the activation it sends on (its last layer's d_out, the
    local tp block after a column-parallel layer)."""
    from ..parallel.compose import layer_stages
    from ..parallel.tensor_parallel import tp_role

    layout = parse_layout(layout)
    tp, layers = layout.size("tp"), model.layers()
    vstages = layer_stages(model, layout)
    widths = {}
    for spec in layers:                               # later layers of a stage overwrite
        column = tp > 1 and tp_role(spec.index, len(layers)) == "column"
        widths[vstages[spec.index]] = spec.d_out // tp if column else spec.d_out
    return widths


def step_comm(model, layout, rank: int, batch: int, itemsize: int = 8) -> dict:
    """Bytes `rank` sends in one training step, per kind, as `engine.comm_bytes` counts them:
    {'train_step': {kind: bytes}, 'optimizer': {kind: bytes}} (module docstring: formulas).

    'train_step' is `engine.train_step(x, t, loss)` with sync (forward, backward, gradient
    sync, the global loss); 'optimizer' is `opt.step()` (ZeRO-1/2 all-gather there)."""
    from ..parallel.compose import layer_stages, plan_params
    from ..parallel.tensor_parallel import tp_role

    layout = parse_layout(layout)
    if getattr(model, "kind", "mlp") != "mlp" or layout.size("ep") > 1:
        raise ValueError("the communication model covers MLPs on dp, fsdp, tp and pp; got "
                         f"{model!r} on {layout.text!r}")
    m = check_fit(model, layout, batch)
    plan = plan_params(model, layout)
    coords = meshmod.coordinates(layout, rank)
    dp, nf, tp, pp = (layout.size(a) for a in ("dp", "fsdp", "tp", "pp"))
    zero = layout.option("zero", 3) if nf > 1 else 0
    nd = layout.data_parallel_size
    rows = batch // nd                                # this rank's rows, all microbatches
    step, opt = Counter(), Counter()
    layers = model.layers()
    vstages = layer_stages(model, layout)
    grad_bytes = 0                                    # this rank's gradient blocks
    for spec in layers:
        if vstages[spec.index] % pp != coords["pp"]:
            continue
        role = tp_role(spec.index, len(layers)) if tp > 1 else "replicated"
        if role == "column" and spec.index > 0:       # f: all-reduce of dL/dx, backward
            step["all_reduce"] += _all_reduce_bytes(tp, rows * spec.d_in * itemsize)
        elif role == "row":                           # g: all-reduce of the output, forward
            step["all_reduce"] += _all_reduce_bytes(tp, rows * spec.d_out * itemsize)
        for name in spec.param_shapes:
            info = plan[name]
            block = pl.local_shape(info.full_shape, info.placement, layout.sizes)
            nbytes = prod(block) * itemsize           # the stored block (zero=3: a shard)
            if zero == 3:
                gathers = 2 if name.endswith("/weights") else 1   # fwd W, b; bwd W
                step["all_gather"] += m * gathers * (nf - 1) * nbytes
                step["reduce_scatter"] += m * (nf - 1) * nbytes
                grad_bytes += nbytes
            elif zero in (1, 2):
                owned = prod(_owned_slice_shape(block, nf)) * itemsize
                step["reduce_scatter"] += (m if zero == 2 else 1) * (nf - 1) * owned
                opt["all_gather"] += (nf - 1) * owned
                grad_bytes += owned
            else:
                grad_bytes += nbytes
    if dp > 1:                                        # data_parallel.GradientSync
        step["all_reduce"] += _all_reduce_bytes(dp, grad_bytes)
    if pp > 1:
        widths = boundary_widths(model, layout)
        last = max(vstages)
        for k in range(last + 1):
            if k % pp != coords["pp"]:
                continue
            if k < last:                              # F: activation to virtual stage k+1
                step["send"] += rows * widths[k] * itemsize
            if k > 0:                                 # B: gradient back to virtual stage k-1
                step["send"] += rows * widths[k - 1] * itemsize
        if coords["pp"] == pp - 1:                    # global_mean: the loss from the last stage
            step["broadcast"] += (pp - 1) / pp * LOSS_BYTES
    if nd > 1:
        step["all_reduce"] += _all_reduce_bytes(nd, LOSS_BYTES)
    return {"train_step": {k: v for k, v in step.items() if v},
            "optimizer": {k: v for k, v in opt.items() if v}}


def step_comm_total(model, layout, rank, batch, itemsize=8) -> dict:
    """{kind: bytes} of one training step, both phases added."""
    phases = step_comm(model, layout, rank, batch, itemsize)
    total = Counter(phases["train_step"])
    total.update(phases["optimizer"])
    return dict(total)


# -- `plan`: every layout of a world size, ranked (no MPI) ---------------------------------------
def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidate_layouts(world_size: int, microbatches=None) -> list:
    """Every layout over dp, fsdp (zero=1, 2, 3), pp and tp whose sizes multiply to
    `world_size` (ep is for MoE models and left out)."""
    if world_size < 1:
        raise ValueError(f"world size must be >= 1, got {world_size}")
    out = []
    for dp in _divisors(world_size):
        for nf in _divisors(world_size // dp):
            for pp in _divisors(world_size // (dp * nf)):
                tp = world_size // (dp * nf * pp)
                axes = [f"{a}={n}" for a, n in (("dp", dp), ("fsdp", nf), ("pp", pp),
                                                 ("tp", tp)) if n > 1]
                pipe = [f"microbatches={microbatches}"] if pp > 1 and microbatches else []
                for zero in ((1, 2, 3) if nf > 1 else (None,)):
                    opts = ([f"zero={zero}"] if zero else []) + pipe
                    out.append(",".join(axes + opts) or "single")
    return out


def plan_layouts(model, world_size: int, batch: int, dtype=np.float32,
                 optimizer: str = "adamw", momentum: float = 0.0, microbatches=None):
    """(rows, rejected): a row per layout that fits, {layout, memory (max over ranks of
    parameters + gradients + optimizer state), comm (max over ranks of bytes sent per step),
    kinds (per kind, of that busiest rank)}; rejected = [(layout, reason)]."""
    itemsize = np.dtype(dtype).itemsize
    rows, rejected = [], []
    for text in candidate_layouts(world_size, microbatches):
        try:
            layout = parse_layout(text)
            check_fit(model, layout, batch)
        except ValueError as exc:
            rejected.append((text, str(exc)))
            continue
        memory = max(rank_memory(model, layout, r, itemsize, optimizer, momentum)["total"]
                     for r in range(world_size))
        comms = [step_comm_total(model, layout, r, batch, itemsize) for r in range(world_size)]
        busiest = max(comms, key=lambda c: sum(c.values()))
        rows.append({"layout": text, "memory": memory, "comm": sum(busiest.values()),
                     "kinds": busiest})
    return rows, rejected


SORT_KEYS = {"memory": lambda r: (r["memory"], r["comm"], r["layout"]),
             "comm": lambda r: (r["comm"], r["memory"], r["layout"]),
             "layout": lambda r: r["layout"]}


def plan_report(model, world_size, batch, dtype=np.float32, optimizer="adamw",
                momentum=0.0, microbatches=None, top=None, sort="memory") -> str:
    """The `plan` command's table."""
    if sort not in SORT_KEYS:
        raise ValueError(f"sort must be one of {sorted(SORT_KEYS)}, got {sort!r}")
    if top is not None and top < 1:
        raise ValueError(f"--top must be >= 1, got {top}")
    rows, rejected = plan_layouts(model, world_size, batch, dtype, optimizer, momentum,
                                  microbatches)
    rows.sort(key=SORT_KEYS[sort])
    shown = rows[:top] if top else rows
    kinds = [k for k in COMM_KINDS if any(r["kinds"].get(k) for r in shown)]
    lines = [f"plan   {model!r}: {model.num_params():,} parameters, {world_size} ranks, global "
             f"batch {batch}, {np.dtype(dtype).name}, optimizer {optimizer}",
             f"       {len(rows)} layouts fit, {len(rejected)} do not; showing {len(shown)}, "
             f"sorted by {sort}",
             "memory: max over ranks of parameters + gradients + optimizer state (activations "
             "and gathered weights not included)",
             "comm:   bytes sent per training step by the busiest rank (train_step + optimizer "
             "step), and its split by kind", ""]
    widths = [max([len("layout")] + [len(r["layout"]) for r in shown]), 11, 11] + \
        [max(11, len(k)) for k in kinds]
    header = ["layout", "memory", "comm/step"] + kinds
    lines.append("  ".join(h.ljust(w) if i == 0 else h.rjust(w)
                           for i, (h, w) in enumerate(zip(header, widths))))
    for r in shown:
        cells = [r["layout"], _fmt_bytes(r["memory"]), _fmt_bytes(r["comm"])] + \
            [_fmt_bytes(r["kinds"].get(k, 0)) for k in kinds]
        lines.append("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(cells, widths))))
    if rejected:
        lines.append("")
        lines.append("do not fit:")
        lines += [f"  {text}: {reason}" for text, reason in rejected]
    return "\n".join(lines)


def add_plan_arguments(p):
    p.add_argument("--model", required=True, help="comma-separated MLP dims, e.g. "
                   "784,512,256,10")
    p.add_argument("--world-size", type=int, required=True, help="ranks to plan for")
    p.add_argument("--batch", type=int, default=64, help="global batch per step (64)")
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"],
                   help="optimizer whose state is counted (adamw)")
    p.add_argument("--momentum", type=float, default=0.0, help="with --optimizer sgd")
    p.add_argument("--activation", default="relu", help="hidden activation (relu)")
    p.add_argument("--no-bias", action="store_true", help="layers without bias")
    p.add_argument("--microbatches", type=int, help="pp layouts: microbatches per step "
                   "(default: the engine's, pp)")
    p.add_argument("--top", type=int, default=10, help="show the best K layouts (10)")
    p.add_argument("--sort", default="memory", choices=sorted(SORT_KEYS),
                   help="memory (then comm, default), comm (then memory) or layout")
    return p

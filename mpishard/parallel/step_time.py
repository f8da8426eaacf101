"""Step time predicted from a layout's cost model and a machine's calibration (no MPI).

    predicted = (compute + elementwise) / (1 - bubble) + sum over kinds (calls x alpha
                + bytes / beta)

- compute: the busiest rank's GEMM FLOPs per train_step (forward 2 r d_in d_out per local
  weight block, backward twice that, minus the dx of the first layer, which nothing needs;
  a GPT adds its attention scores 'qk' and 'av') over the calibrated GEMM rate of the GEMM's
  shape class ('small' < 2 MFLOP per GEMM call < 'medium' < 200 MFLOP < 'large'). ZeRO-3 computes
  with the gathered weight (its block times the fsdp size).
- elementwise: what is not a GEMM, as memory traffic over the calibrated `memory_gbs`: the
  activations (about 8 passes over each layer's output per microbatch: bias, activation and
  their backward, the loss) and the optimizer (AdamW reads and writes parameter, gradient and
  two moments: about 10 passes over the owned block), plus `call_s` per layer pass (the
  Python and dispatch cost of one layer's forward or backward).
- bubble: the pipeline schedule's idle fraction, from the schedule simulator (schedules.py).
- communication: the cost model's bytes per kind (costs.step_comm, exactly the engine's
  counters) over the calibrated bandwidth `beta` of that kind at the group size the kind runs
  on, plus `calls` x latency `alpha`, where `calls` estimates the engine's call count per kind
  (per layer and microbatch for tp, ZeRO-3 and pp sends; per bucket for dp and ZeRO-1/2).

A calibration (cli/calibrate.py writes it; examples/calibration.example.json) is a dict:
{"gemm_gflops": {"small": G, "medium": G, "large": G}, "memory_gbs": GB/s, "call_s": s,
 "collectives": {kind: {group size: [alpha seconds, beta bytes/s]}}} where a group size
missing falls back to the nearest calibrated one.
"""
from __future__ import annotations

from math import ceil

from .costs import COMM_KINDS, rank_view, step_comm
from .data_parallel import DEFAULT_BUCKET_MB
from .model_costs import gpt_stage, is_gpt, local_tokens
from .schedules import make_schedule, simulate
from .stages import pipeline_options

SHAPE_CLASSES = (("small", 2e6), ("medium", 2e8), ("large", float("inf")))


def shape_class(flops: float) -> str:
    """The GEMM shape class of one GEMM call of `flops`."""
    return next(name for name, limit in SHAPE_CLASSES if flops < limit)


def gemms(view) -> list:
    """(flops per GEMM call, calls per step) of each GEMM this rank runs in one train_step."""
    layout, m = view.layout, view.microbatches
    gpt = is_gpt(view.model)
    rows = view.rows * (local_tokens(view.model, layout) if gpt else 1)
    fsdp = layout.size("fsdp")
    first = next(iter(view.params), None)
    out = []
    for name, info in view.params.items():
        shape = view.blocks[name]
        if len(shape) != 2 or name == "embed/tokens" and not getattr(view.model, "tied", 0) \
                or name == "embed/positions":
            continue                                  # biases, LN, embedding look-ups
        size = shape[0] * shape[1] * (fsdp if not info.placement.is_replicated_on("fsdp")
                                      else 1)
        per_call = 2 * rows / m * size
        passes = 2 if name == first else 3            # forward, dW, dx (not for layer 0)
        out.append((per_call, passes * m))
    if gpt:                                           # scores q k^T and weights @ v
        stage = gpt_stage(view)
        heads = view.model.n_heads // layout.size("tp")
        dh = view.model.d_model // view.model.n_heads
        t_local, t_full = local_tokens(view.model, layout), view.model.seq_len
        per_call = 2 * (view.rows / m) * heads * t_local * t_full * dh
        out.append((per_call, 2 * 3 * stage.blocks * m))
    return out


def compute_seconds(view, gemm_gflops: dict) -> float:
    """Seconds of GEMM work of `view`'s rank per train_step."""
    return sum(calls * flops / (gemm_gflops[shape_class(flops)] * 1e9)
               for flops, calls in gemms(view))


def elementwise_seconds(view, calibration: dict) -> float:
    """Seconds of non-GEMM work per train_step (module docstring)."""
    m = view.microbatches
    per_row = sum(max(view.blocks[n][-1], 1) for n in view.params if n.endswith("/bias")
                  or n.endswith("/weights") and n.replace("weights", "bias") not in view.params)
    rows = view.rows * (local_tokens(view.model, view.layout) if is_gpt(view.model) else 1)
    traffic = 8 * rows * per_row * view.itemsize
    traffic += 10 * sum(view.nbytes(b) for b in view.grad_blocks.values())
    passes = 3 * len(view.layers) * m
    return traffic / (calibration["memory_gbs"] * 1e9) + passes * calibration["call_s"]


def bubble(layout) -> float:
    """The pipeline schedule's simulated idle fraction (0 without pp)."""
    if layout.size("pp") == 1:
        return 0.0
    pp, name, v, m = pipeline_options(layout)
    return simulate(make_schedule(name, pp, m, v), pp, m, v).bubble_fraction


def comm_calls(view, kinds: dict) -> dict:
    """Estimated engine calls per kind in one step (module docstring)."""
    layout, m = view.layout, view.microbatches
    layers = len(view.layers)
    bucket = DEFAULT_BUCKET_MB * 2 ** 20
    grad_bytes = sum(view.nbytes(b) for b in view.grad_blocks.values())
    buckets = max(1, ceil(grad_bytes * layout.size("fsdp") / bucket))
    zero3 = layout.size("fsdp") > 1 and layout.option("zero", 3) == 3
    tp = layout.size("tp") > 1
    per_layer = {"all_reduce": 2 * layers * m * tp + buckets + 1,
                 "all_gather": 3 * layers * m if zero3 else buckets + 2 * layers * m * tp,
                 "reduce_scatter": 2 * layers * m if zero3 else buckets,
                 "all_to_all": 4 * layers * m, "broadcast": 1, "send": 2 * m}
    return {k: per_layer[k] for k in kinds}


def group_size(layout, kind: str) -> int:
    """The group a kind mostly runs on in this layout."""
    data = layout.size("dp") * layout.size("fsdp")
    return {"all_reduce": layout.size("tp") if layout.size("tp") > 1 else data,
            "all_gather": layout.size("fsdp") if layout.size("fsdp") > 1 else layout.size("tp"),
            "reduce_scatter": layout.size("fsdp") if layout.size("fsdp") > 1
            else layout.size("tp"),
            "all_to_all": max(layout.size("ep"), layout.size("cp")),
            "broadcast": layout.size("pp"), "send": 2}[kind]


def alpha_beta(calibration: dict, kind: str, n: int) -> tuple:
    """(alpha s, beta bytes/s) of `kind` on `n` ranks: the nearest calibrated group size."""
    table = calibration["collectives"].get(kind) or calibration["collectives"]["all_reduce"]
    key = min(table, key=lambda k: (abs(int(k) - n), -int(k)))
    alpha, beta = table[key]
    return float(alpha), float(beta)


def comm_seconds(view, calibration: dict, kinds: dict) -> float:
    calls = comm_calls(view, kinds)
    total = 0.0
    for kind, nbytes in kinds.items():
        alpha, beta = alpha_beta(calibration, kind, max(2, group_size(view.layout, kind)))
        total += calls[kind] * alpha + nbytes / beta
    return total


def predict_step(model, layout, batch: int, calibration: dict, itemsize: int = 4) -> dict:
    """{'compute_s', 'bubble', 'comm_s', 'step_s'} of the busiest rank of `layout`."""
    view0 = rank_view(model, layout, 0, itemsize, batch)
    world = view0.layout.world_size
    bub = bubble(view0.layout)
    best = None
    for rank in range(world):
        view = rank_view(model, layout, rank, itemsize, batch) if rank else view0
        sent = step_comm(model, layout, rank, batch, itemsize)
        kinds = {k: sum(p.get(k, 0) for p in sent.values()) for k in COMM_KINDS}
        kinds = {k: v for k, v in kinds.items() if v}
        compute = compute_seconds(view, calibration["gemm_gflops"]) + \
            elementwise_seconds(view, calibration)
        comm = comm_seconds(view, calibration, kinds)
        row = {"compute_s": compute, "bubble": bub, "comm_s": comm,
               "step_s": compute / (1 - bub) + comm}
        if best is None or row["step_s"] > best["step_s"]:
            best = row
    return best

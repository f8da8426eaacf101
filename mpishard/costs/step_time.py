"""Step time predicted from a layout's cost model and a machine's calibration (no MPI).

    predicted = mesh_factor x (bubble_factor x (gemm + elementwise) + sum over groups
                and kinds (calls x alpha + bytes / beta))

of the busiest rank (the slowest of `representative_ranks`), where

- gemm: each GEMM call's FLOPs over the calibrated rate at that many FLOPs per call (log-log
  interpolation of the `gemm` curve; the attention's batched GEMMs on `bgemm`). Per weight
  block: forward 2 r d_in d_out, backward twice that, less an MLP's first dx (nothing needs it),
  plus a forward more under recompute=1; ZeRO-3 computes with the gathered weight. A decoder
  adds per block and microbatch its attention: 2 batched GEMMs forward (q k^T, p v), 5 backward
  (the scores again, dv, dp, dq, dk), on (heads / tp) x T_q x T_k x D_h. The model's spec
  lists them (step_gemms: models/<name>/costs.py).
- elementwise: per array, its elements x the calibrated seconds per element of the op at
  that array size (`ops`, interpolated like the GEMM rates: small arrays pay the call, large
  ones the memory): per MLP layer its activation and bias (forward + backward) and the MSE;
  per GPT block two LayerNorms, GELU on the d_ff activation, the attention's softmax on its
  scores (ring cp: per step, and the online merges) and the plain passes (biases,
  residuals, head splits); the embedding, ln_f and the
  cross-entropy on the first and last stage; FSDP's copies around its calls (a pass over
  the full tensor per pack or gathered copy); AdamW over the rank's gradient blocks; a
  Mixtral's experts (models/llama/costs.py: GEMMs and SwiGLU at the expected k rows per
  token, its ep exchange and routing statistics as groups of their own). The model's spec
  prices its own part (step_elementwise). Plus the
  per-call costs (`fixed`): per layer or block and microbatch, per step, per optimizer tensor.
- step_factor, optimizer_factor: the calibration's factors of the model's calibration_key
  (mlp or gpt; 1 without them): the train_step's terms (GEMMs and its element-wise work) times
  `step_factor`, the optimizer's (AdamW per element and per tensor) times
  `optimizer_factor` (`step_factor` in a calibration without one). Each is a mid-size
  reference model's measured train_step, or AdamW step, over what the terms predict for it,
  so the micro-benchmarks' optimism (operands warm in the cache, no interpreter between
  calls) is measured once per machine, not assumed. Two factors because the two parts miss
  by different amounts (the figures are in docs/performance.md).
- bubble_factor: the pipeline schedule's simulated idle fraction b (schedules.py) costs
  1 / (1 - b) on a core per rank; with ranks sharing cores an idle stage lends its core to
  the others, so the factor is max(1, 1 / (c (1 - b))), c = 1 + (concurrency - 1) x
  lent(span): `concurrency` the measured slowdown of a GEMM when every rank runs one at once
  (about ranks / free cores), and `lent` the share of an idle span the others really get,
  which grows with the span against the scheduler's slice (short spans lend nothing).
- mesh_factor: the calibration's (per model kind, 1 without it) whole-step factor of a layout
  of more than one rank: the reference model's measured step (train_step and AdamW, the
  slowest rank, its rows per rank as in step_factor's) on dp=N over what everything else here
  predicts for it (cli/calibrate_steps.py). It holds what the terms leave out of a step of
  ranks that wait for each other: a rank spinning in MPI on a core another rank computes on,
  members reaching a collective at different moments. It multiplies a layout of as many
  ranks as the calibration's (`ranks`), so it sets the predicted seconds, not the ranking
  of one world size's layouts; one rank, or another rank count, is not multiplied by it.
- communication: each strategy's bytes (its `step_comm`, exactly the engine's counters) and
  calls (call_counts.py, exactly `engine.comm_calls`) on the group it runs on (tp, cp, pp,
  fsdp, the averaging axes for dp's gradients and for the loss; the model's own parts'
  time_groups): calls x the calibrated seconds of one call of that kind and group size at
  the mean bytes per call (`call_seconds`). A calibration with `ranks_per_node` (ranks
  numbered tp innermost, mesh.coordinates) takes a group whose ranks span more than one node
  from `collectives_inter` (two-level alpha-beta: NVLink inside a node, the network between).

A calibration (cli/calibrate.py writes one, calibration.py reads it;
examples/calibration.example.json was measured, examples/calibration.h100-cluster.json is
assumed from public specs) is a dict:
{"gemm": [[flops per call, GFLOP/s], ...], "bgemm": [...], "concurrency": k,
 "ops": {op: [[elements, seconds per element], ...]},
 "fixed": {"mlp_layer"|"mlp_base"|"gpt_block"|"gpt_base"|"optimizer_tensor": seconds},
 optional "step_factor", "optimizer_factor" and "mesh_factor": {"mlp"|"gpt": factor},
 "collectives": {kind: {group size: [[bytes, seconds], ...] or [alpha s, beta bytes/s]}},
 optional "ranks_per_node" and "collectives_inter"}; a group size missing falls back to the
nearest calibrated one.
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import product
from math import log, prod

from ..comm.mesh import AVERAGE_AXES, AXES, rank_of
from ..parallel import context_parallel, data_parallel, fsdp, pipeline
from ..parallel.schedules import make_schedule, simulate
from ..parallel.stages import pipeline_options
from . import call_counts
from .rank_costs import rank_view


def _sent(*strategies):
    """{kind: bytes} a rank sends per step through `strategies`' step_comm, both phases."""
    def sent(view) -> dict:
        out: dict = {}
        for strategy in strategies:
            for kinds in strategy.step_comm(view).values():
                for kind, nbytes in kinds.items():
                    out[kind] = out.get(kind, 0) + nbytes
        return out
    return sent


def _loss_bytes(view) -> float:
    return view.all_reduce_bytes(AVERAGE_AXES, view.LOSS_BYTES) \
        if view.size(AVERAGE_AXES) > 1 else 0.0


def _gradient_sync_bytes(view) -> dict:
    """data_parallel's bytes less the loss (a group of its own), plus what the model's own ep
    parts add to it (a Mixtral's gradients averaged over ep too)."""
    out = _sent(data_parallel)(view)
    extra = sum(part.gradient_bytes(view).get("all_reduce", 0)
                for part in view.model.cost_parts()["ep"])
    out["all_reduce"] = out.get("all_reduce", 0) - _loss_bytes(view) + extra
    return out


def groups(model) -> tuple:
    """(calls, bytes, the axes their group spans) of each group a rank's calls run on, each
    exactly the engine's counters: the model's own tp parts, cp, pp, fsdp, the gradient sync,
    the model's own ep parts' groups, the loss."""
    parts = model.cost_parts()
    own_tp, own_ep = (tuple(group for part in parts[key] for group in part.time_groups())
                      for key in ("tp", "ep"))
    return (*own_tp,
            (call_counts.cp_calls, _sent(context_parallel), ("cp",)),
            (call_counts.pp_calls, _sent(pipeline), ("pp",)),
            (call_counts.fsdp_calls, _sent(fsdp), ("fsdp",)),
            (call_counts.dp_calls, _gradient_sync_bytes, ("dp", "ep", "cp")),
            *own_ep,
            (call_counts.loss_calls, lambda view: {"all_reduce": _loss_bytes(view)},
             AVERAGE_AXES))


def interpolate(curve, x: float) -> float:
    """y at `x` on [[x, y], ...] (sorted by x, positive): straight lines between the points
    on log-log axes, held flat beyond the ends."""
    xs = [p[0] for p in curve]
    i = bisect_left(xs, x)
    if i == 0:
        return float(curve[0][1])
    if i == len(curve):
        return float(curve[-1][1])
    (x0, y0), (x1, y1) = curve[i - 1], curve[i]
    w = (log(x) - log(x0)) / (log(x1) - log(x0))
    return float(y0 ** (1 - w) * y1 ** w) if y0 > 0 and y1 > 0 else float(y0 + w * (y1 - y0))


def op_seconds(ops: dict, name: str, n: float) -> float:
    """Seconds of element-wise op `name` on one array of `n` elements: n x the interpolated
    seconds per element; below the smallest calibrated array, that array's whole call (its
    fixed cost); 0 for an op not calibrated, such as the identity activation."""
    if name not in ops or n <= 0:
        return 0.0
    n0, s0 = ops[name][0]
    return n * interpolate(ops[name], n) if n >= n0 else n0 * s0


def gemms(view) -> list:
    """(flops per GEMM call, calls per step, curve) of each GEMM this rank runs in one
    train_step; curve 'gemm' (the layers) or 'bgemm' (the attention's batched ones): the
    model's step_gemms."""
    return view.model.step_gemms(view)


def gemm_seconds(view, calibration: dict) -> float:
    """Seconds of GEMM work of `view`'s rank per train_step."""
    return sum(calls * flops / (interpolate(calibration[curve], flops) * 1e9)
               for flops, calls, curve in gemms(view))


def _fsdp_copies(view, ops) -> float:
    """The copies FSDP makes around its calls, one pass over the full (padded) tensor each:
    ZeRO-1/2 pack the gradient into its bucket and copy the all-gathered parameters back into
    the buffer; ZeRO-3 copies every gathered weight out and packs every gradient it adds.
    ZeRO-1 also keeps a full gradient buffer: a `+=` per microbatch, and two zero fills per
    step (once reduce-scattered, and at zero_grad)."""
    n, m = view.size("fsdp"), view.microbatches
    if n == 1:
        return 0.0
    seconds = 0.0
    for name, info in view.params.items():
        full = n * prod(view.grad_blocks[name])
        stage = fsdp.zero_stage(info.placement, view.layout)
        if stage == 3:
            gets, adds = view.model.param_uses(view.layout, name, view.params)
            seconds += m * (gets + adds) * op_seconds(ops, "pass", full)
        else:
            seconds += (2 + (m + 2 if stage == 1 else 0)) * op_seconds(ops, "pass", full)
    return seconds


def elementwise_seconds(view, calibration: dict) -> float:
    """Seconds of non-GEMM work per train_step and optimizer step (module docstring)."""
    return train_elementwise_seconds(view, calibration) + optimizer_seconds(view, calibration)


def train_elementwise_seconds(view, calibration: dict) -> float:
    """The train_step's part of elementwise_seconds: the model's element-wise work and
    FSDP's copies."""
    ops, fixed = calibration["ops"], calibration["fixed"]
    seconds = view.model.step_elementwise(view, lambda name, n: op_seconds(ops, name, n), fixed)
    return seconds + _fsdp_copies(view, ops)


def optimizer_seconds(view, calibration: dict) -> float:
    """The optimizer step's part of elementwise_seconds: AdamW over the rank's gradient
    blocks, and its per-tensor cost."""
    return sum(op_seconds(calibration["ops"], "adamw", prod(b))
               for b in view.grad_blocks.values()) \
        + len(view.params) * calibration["fixed"]["optimizer_tensor"]


def bubble(layout) -> float:
    """The pipeline schedule's simulated idle fraction (0 without pp)."""
    if layout.size("pp") == 1:
        return 0.0
    pp, name, v, m = pipeline_options(layout)
    return simulate(make_schedule(name, pp, m, v), pp, m, v).bubble_fraction


# fitted to ranks sharing cores, bursts of GEMMs against receives (docs/performance.md)
LEND_AFTER = 2e-3    # seconds: an idle span shorter than this lends its core to nobody
SLICE = 3e-3         # seconds: about the scheduler's slice


def lent(span: float) -> float:
    """The share of a stage's idle span of `span` seconds that ranks sharing its core get:
    (span - LEND_AFTER) / (span + SLICE), at least 0: a span shorter than the scheduler's
    slice lends almost nothing, a long one nearly all of itself."""
    return max(0.0, span - LEND_AFTER) / (span + SLICE)


def bubble_factor(b: float, concurrency: float = 1.0, compute_s=None) -> float:
    """What a pipeline bubble `b` multiplies the compute by (module docstring). With the
    rank's `compute_s`, the sharing is scaled by `lent` of the bubble's idle spans: the idle
    time b / (1 - b) x compute, taken as two spans, the fill's and the drain's."""
    if b <= 0:
        return 1.0
    c = max(concurrency, 1.0)
    if compute_s is not None:
        c = 1.0 + (c - 1.0) * lent(b / (1.0 - b) * compute_s / 2)
    return max(1.0, 1.0 / (c * (1.0 - b)))


def group_spans_nodes(layout, axes, ranks_per_node) -> bool:
    """Whether a group over `axes` (ranks numbered tp innermost) reaches past one node."""
    if not ranks_per_node:
        return False
    span, stride = 0, 1
    for axis in reversed(AXES):
        if axis in axes:
            span += (layout.size(axis) - 1) * stride
        stride *= layout.size(axis)
    return span + 1 > ranks_per_node


def call_seconds(calibration: dict, kind: str, n: int, nbytes: float,
                 inter: bool = False) -> float:
    """Seconds of one call of `kind` on `n` ranks counting `nbytes`, from the nearest
    calibrated group size: alpha + nbytes / beta for an [alpha, beta] entry, or the measured
    [[bytes, seconds], ...] points joined by straight lines (past the last one, its segment's
    slope)."""
    tables = calibration.get("collectives_inter") if inter else None
    tables = tables or calibration["collectives"]
    table = tables.get(kind) or tables["all_reduce"]
    entry = table[min(table, key=lambda k: (abs(int(k) - n), -int(k)))]
    if not isinstance(entry[0], (list, tuple)):
        return float(entry[0]) + nbytes / float(entry[1])
    points = sorted(entry)
    i = min(max(bisect_left([p[0] for p in points], nbytes), 1), len(points) - 1)
    (b0, t0), (b1, t1) = points[i - 1], points[i]
    return max(float(t0 + (nbytes - b0) * (t1 - t0) / (b1 - b0)), 0.0) if nbytes >= b0 \
        else float(t0)


def comm_terms(view, calibration: dict) -> list:
    """[(axes, kind, calls, bytes, seconds)] of `view`'s rank in one step."""
    out = []
    rpn = calibration.get("ranks_per_node")
    for calls_of, sent_of, axes in groups(view.model):
        axes = tuple(a for a in axes if view.size(a) > 1)
        calls, sent = calls_of(view), sent_of(view)
        group = view.size(axes) if axes else 1
        if axes == ("pp",):                  # sends go to the next stage: a stride away
            inter = bool(rpn) and view.size(("cp", "tp")) >= rpn
        else:
            inter = group_spans_nodes(view.layout, axes, rpn)
        for kind in sorted(k for k, v in calls.items() if v):
            n = 2 if kind == "send" else max(2, group)
            nbytes = sent.get(kind, 0)
            out.append((axes, kind, calls[kind], nbytes,
                        calls[kind] * call_seconds(calibration, kind, n, nbytes / calls[kind],
                                                   inter)))
    return out


def representative_ranks(layout) -> list:
    """Ranks whose costs bound every rank's: each pp stage, the first and last coordinate of
    fsdp, cp and tp (uneven splits give those the largest or padded blocks), one dp and ep
    replica (they hold and send the same). Enough for the max over ranks (tested against all
    ranks) at a small fraction of a large world."""
    choices = []
    for axis in AXES:
        n = layout.size(axis)
        choices.append(range(n) if axis == "pp" else
                       [0] if axis in ("dp", "ep") else sorted({0, n - 1}))
    return sorted({rank_of(layout, dict(zip(AXES, c))) for c in product(*choices)})


def factors(calibration: dict, model) -> tuple:
    """(step_factor, optimizer_factor) of `model`'s calibration_key in `calibration` (module
    docstring)."""
    kind = model.calibration_key
    step = calibration.get("step_factor", {}).get(kind, 1.0)
    return step, calibration.get("optimizer_factor", {}).get(kind, step)


def mesh_factor(calibration: dict, model, layout) -> float:
    """What a step of `layout` (more than one rank) costs on this machine over the sum of its
    terms: the calibration's `mesh_factor` of the model's kind (module docstring) when the
    layout has as many ranks as the calibration was measured on (its `ranks`); 1 otherwise,
    or without one: 8 ranks sharing 2 cores say nothing of 2 ranks on them."""
    if layout.world_size != calibration.get("ranks"):    # (a 1-rank calibration has none)
        return 1.0
    return calibration.get("mesh_factor", {}).get(model.calibration_key, 1.0)


def predict_rank(model, layout, rank: int, batch: int, calibration: dict,
                 itemsize: int = 4) -> dict:
    """{'gemm_s', 'elementwise_s', 'optimizer_s', 'compute_s', 'bubble', 'comm_s',
    'mesh_factor', 'step_s', 'unlent_s'} of one rank; 'elementwise_s' holds 'optimizer_s',
    each of those times its step or optimizer factor; step_s = mesh_factor x (bubble factor x
    compute_s + comm_s); unlent_s the same with the pipeline's idle time paid in full, as if
    the ranks sharing a core got none of it (1 / (1 - b): `ranking_seconds`)."""
    view = rank_view(model, layout, rank, itemsize, batch)
    step_factor, optimizer_factor = factors(calibration, model)
    gemm = step_factor * gemm_seconds(view, calibration)
    optimizer = optimizer_factor * optimizer_seconds(view, calibration)
    elem = step_factor * train_elementwise_seconds(view, calibration) + optimizer
    bub = bubble(view.layout)
    comm = sum(term[-1] for term in comm_terms(view, calibration))
    factor = bubble_factor(bub, calibration.get("concurrency", 1.0), gemm + elem)
    mesh = mesh_factor(calibration, model, layout)
    return {"gemm_s": gemm, "elementwise_s": elem, "optimizer_s": optimizer,
            "compute_s": gemm + elem, "bubble": bub, "comm_s": comm, "mesh_factor": mesh,
            "step_s": mesh * (factor * (gemm + elem) + comm),
            "unlent_s": mesh * (bubble_factor(bub) * (gemm + elem) + comm), "rank": rank}


def ranking_seconds(prediction: dict) -> float:
    """The seconds `--layout auto` and `plan` rank a layout by: its step with the pipeline's
    idle time paid in full (`unlent_s`). It is step_s except for a pipeline on ranks that
    share cores (concurrency > 1), whose bubble_factor counts on the idle stages lending
    their cores: how much they lend was fitted on one machine (LEND_AFTER, SLICE) and did
    not hold on another (docs/planning-and-tracing.md), so a pipeline is chosen there only
    when it wins without that help. With a rank per core the two are equal. A row without
    one (no calibration: None) gives its step_s."""
    unlent = prediction.get("unlent_s")
    return prediction["step_s"] if unlent is None else unlent


def predict_step(model, layout, batch: int, calibration: dict, itemsize: int = 4) -> dict:
    """predict_rank's dict of the busiest of the representative ranks of `layout`, its
    'unlent_s' the largest of theirs (a stage may be the busiest only without lending)."""
    rows = [predict_rank(model, layout, r, batch, calibration, itemsize)
            for r in representative_ranks(layout)]
    return dict(max(rows, key=lambda row: row["step_s"]),
                unlent_s=max(row["unlent_s"] for row in rows))

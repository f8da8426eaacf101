"""Step time predicted from a layout's cost model and a machine's calibration (no MPI).

    predicted = bubble_factor x (gemm + elementwise) + sum over groups and kinds
                (calls x alpha + bytes / beta)

of the busiest rank (the slowest of `representative_ranks`), where

- gemm: each GEMM call's FLOPs over the calibrated rate at that many FLOPs per call (log-log
  interpolation of the `gemm` curve; the attention's batched GEMMs on `bgemm`). Per weight
  block: forward 2 r d_in d_out, backward twice that, less an MLP's first dx (nothing needs it),
  plus a forward more under recompute=1; ZeRO-3 computes with the gathered weight. A GPT adds
  per block and microbatch its attention: 2 batched GEMMs forward (q k^T, p v), 5 backward
  (the scores again, dv, dp, dq, dk), on (heads / tp) x T_q x T_k x D_h.
- elementwise: per array, its elements x the calibrated seconds per element of the op at
  that array size (`ops`, interpolated like the GEMM rates: small arrays pay the call, large
  ones the memory): per MLP layer its activation and bias (forward + backward) and the MSE;
  per GPT block two LayerNorms, GELU on the d_ff activation, the attention's softmax on its
  scores (ring cp: per step, and the online merges) and the plain passes (biases,
  residuals, head splits); the embedding, ln_f and the
  cross-entropy on the first and last stage; FSDP's copies around its calls (a pass over
  the full tensor per pack or gathered copy); AdamW over the rank's gradient blocks; a
  Mixtral's experts (moe_costs.py: GEMMs and SwiGLU at the expected k rows per token, its ep
  exchange and routing statistics as groups of their own). Plus the
  per-call costs (`fixed`): per layer or block and microbatch, per step, per optimizer tensor.
- step_factor, optimizer_factor: the calibration's factors of the model's kind (mlp or gpt;
  1 without them): the train_step's terms (GEMMs and its element-wise work) times
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
- communication: each strategy's bytes (its `step_comm`, exactly the engine's counters) and
  calls (comm_calls.py, exactly `engine.comm_calls`) on the group it runs on (tp, cp, pp,
  fsdp, the averaging axes for dp's gradients and for the loss): calls x the calibrated
  seconds of one call of that kind and group size at the mean bytes per call
  (`call_seconds`). A calibration with `ranks_per_node` (ranks numbered tp innermost,
  mesh.coordinates) takes a group whose ranks span more than one node from
  `collectives_inter` (two-level alpha-beta: NVLink inside a node, the network between).

A calibration (cli/calibrate.py writes one; examples/calibration.example.json was measured,
examples/calibration.h100-cluster.json is assumed from public specs) is a dict:
{"gemm": [[flops per call, GFLOP/s], ...], "bgemm": [...], "concurrency": k,
 "ops": {op: [[elements, seconds per element], ...]},
 "fixed": {"mlp_layer"|"mlp_base"|"gpt_block"|"gpt_base"|"optimizer_tensor": seconds},
 optional "step_factor" and "optimizer_factor": {"mlp"|"gpt": factor},
 "collectives": {kind: {group size: [[bytes, seconds], ...] or [alpha s, beta bytes/s]}},
 optional "ranks_per_node" and "collectives_inter"}; a group size missing falls back to the
nearest calibrated one.
"""
from __future__ import annotations

from bisect import bisect_left
from itertools import product
from math import log, prod

from ..comm.mesh import AVERAGE_AXES, AXES, rank_of
from . import (comm_calls, context_parallel, data_parallel, fsdp, gpt_tensor_parallel,
               moe_costs, pipeline, tensor_parallel)
from .costs import rank_view
from .model_costs import gpt_stage, is_gpt, local_tokens, param_uses
from .schedules import make_schedule, simulate
from .stages import pipeline_options
from .tensor_parallel import output_width, tp_role


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
    """data_parallel's bytes less the loss (a group of its own), plus a Mixtral's gradients
    averaged over ep too."""
    out = _sent(data_parallel)(view)
    out["all_reduce"] = out.get("all_reduce", 0) - _loss_bytes(view) \
        + moe_costs.ep_gradient_bytes(view).get("all_reduce", 0)
    return out


# (calls, bytes, the axes their group spans), each exactly the engine's counters
GROUPS = ((comm_calls.tp_calls, _sent(tensor_parallel, gpt_tensor_parallel), ("tp",)),
          (comm_calls.cp_calls, _sent(context_parallel), ("cp",)),
          (comm_calls.pp_calls, _sent(pipeline), ("pp",)),
          (comm_calls.fsdp_calls, _sent(fsdp), ("fsdp",)),
          (comm_calls.dp_calls, _gradient_sync_bytes, ("dp", "ep", "cp")),
          (moe_costs.exchange_calls, moe_costs.exchange_bytes, ("ep",)),
          (moe_costs.tp_partial_calls, moe_costs.tp_partial_bytes, ("tp",)),
          (moe_costs.stats_calls, moe_costs.stats_bytes, ("dp", "fsdp", "ep", "cp")),
          (comm_calls.loss_calls, lambda view: {"all_reduce": _loss_bytes(view)},
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
    train_step; curve 'gemm' (the layers) or 'bgemm' (the attention's batched ones)."""
    layout, m = view.layout, view.microbatches
    gpt = is_gpt(view.model)
    forwards = 2 if layout.option("recompute") == "1" else 1
    rows = view.rows * (local_tokens(view.model, layout) if gpt else 1)
    out = []
    for name, info in view.params.items():
        shape = view.blocks[name]
        if len(shape) != 2 or name == "embed/positions" or \
                name == "embed/tokens" and not getattr(view.model, "tied", False):
            continue                                  # biases, LN, embedding look-ups
        size = shape[0] * shape[1] * (layout.size("fsdp") if not
                                      info.placement.is_replicated_on("fsdp") else 1)
        passes = forwards + (1 if name == "layer_0/weights" and not gpt else 2)
        out.append((2 * rows / m * size, passes * m, "gemm"))
    if gpt:
        stage, model, c = gpt_stage(view), view.model, layout.size("cp")
        heads, dh = model.n_heads // layout.size("tp"), model.d_model // model.n_heads
        if layout.option("cp_kind", "ring") == "ring":      # c blocks of T/c keys each
            tq, tk, blocks = model.seq_len // c, model.seq_len // c, c
        else:                                               # Ulysses: heads over cp
            heads, tq, tk, blocks = heads // c, model.seq_len, model.seq_len, 1
        per_call = 2 * (view.rows / m) * heads * tq * tk * dh
        out.append((per_call, (2 * forwards + 5) * stage.blocks * blocks * m, "bgemm"))
    return out + moe_costs.expert_gemms(view)       # 3-d expert weights: skipped above


def gemm_seconds(view, calibration: dict) -> float:
    """Seconds of GEMM work of `view`'s rank per train_step."""
    return sum(calls * flops / (interpolate(calibration[curve], flops) * 1e9)
               for flops, calls, curve in gemms(view))


def _mlp_elementwise(view, ops, fixed) -> float:
    model, m = view.model, view.microbatches
    rows, tp = view.rows / m, view.layout.size("tp")
    seconds = 0.0
    for spec in view.layers:
        size = rows * output_width(spec, model.n_layers, tp)
        last = spec.index == model.n_layers - 1
        seconds += op_seconds(ops, model.final_activation if last else model.activation, size)
        seconds += (2 * (f"layer_{spec.index}/bias" in view.params)   # bias: add, gradient
                    + 3 * last) * op_seconds(ops, "pass", size)       # MSE
        if tp > 1 and tp_role(spec.index, model.n_layers) == "column" and spec.index:
            seconds += op_seconds(ops, "pass", rows * spec.d_in)      # CopyToTP's dx
    return m * (seconds + len(view.layers) * fixed["mlp_layer"] + fixed["mlp_base"])


def _gpt_elementwise(view, ops, fixed) -> float:
    model, layout, m = view.model, view.layout, view.microbatches
    stage, t = gpt_stage(view), layout.size("tp")
    d, f = model.d_model, model.d_ff
    tokens = view.rows / m * local_tokens(model, layout)
    seq = tokens / t if layout.option("sequence_parallel", 0) else tokens
    scores = view.rows / m * model.n_heads / t * local_tokens(model, layout) * model.seq_len
    ring = layout.option("cp_kind", "ring") == "ring" and layout.size("cp") > 1
    steps = layout.size("cp") if ring else 1     # ring: a block of scores per step, merged
    if moe_costs.is_moe(model):     # k experts' SwiGLU per token (not split over tp), the mix
        mlp = op_seconds(ops, "sigmoid", seq * f * model.top_k) + \
            4 * op_seconds(ops, "pass", seq * f * model.top_k) + \
            4 * op_seconds(ops, "pass", seq * d * model.top_k)
        extra = 2 * 4 * op_seconds(ops, "pass", tokens * d / t)
    elif getattr(model, "kind", "gpt") == "llama":  # SwiGLU: sigmoid, 4 products of (T, F);
        mlp = op_seconds(ops, "sigmoid", tokens * f / t) + \
            4 * op_seconds(ops, "pass", tokens * f / t)            # rotary on q, k both ways;
        extra = 2 * 4 * op_seconds(ops, "pass", tokens * d / t)   # RMSNorm ~ LayerNorm, no bias
    else:
        mlp = op_seconds(ops, "gelu", tokens * f / t)
        extra = (2 * sum(op_seconds(ops, "pass", tokens * w / t) for w in (3 * d, f))  # biases
                 + 2 * 2 * op_seconds(ops, "pass", seq * d))      # row biases: add, gradient
    block = (2 * op_seconds(ops, "layernorm", seq * d) + mlp + extra
             + steps * op_seconds(ops, "softmax", scores / steps)
             + (steps - 1) * 6 * op_seconds(ops, "pass", tokens * d / t)      # online merges
             + 2 * 4 * op_seconds(ops, "pass", tokens * d / t)    # q|k|v|out head splits
             + 4 * op_seconds(ops, "pass", seq * d))         # residual adds, both ways
    block *= (2 + (2 if layout.option("recompute") == "1" else 1)) / 3    # a forward is ~1/3
    seconds = stage.blocks * block
    if stage.first:
        seconds += op_seconds(ops, "embedding", seq * d)
    if stage.last:
        seconds += op_seconds(ops, "layernorm", seq * d) + \
            op_seconds(ops, "xent", tokens * model.vocab_size / t)
    return m * (seconds + stage.blocks * fixed["gpt_block"] + fixed["gpt_base"])


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
            gets, adds = param_uses(view.model, view.layout, name, view.params)
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
    seconds = (_gpt_elementwise if is_gpt(view.model) else _mlp_elementwise)(view, ops, fixed)
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
    for calls_of, sent_of, axes in GROUPS:
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
    """(step_factor, optimizer_factor) of `model`'s kind in `calibration` (module docstring)."""
    kind = "gpt" if is_gpt(model) else "mlp"
    step = calibration.get("step_factor", {}).get(kind, 1.0)
    return step, calibration.get("optimizer_factor", {}).get(kind, step)


def predict_rank(model, layout, rank: int, batch: int, calibration: dict,
                 itemsize: int = 4) -> dict:
    """{'gemm_s', 'elementwise_s', 'optimizer_s', 'compute_s', 'bubble', 'comm_s', 'step_s'}
    of one rank; 'elementwise_s' holds 'optimizer_s', each term times its factor."""
    view = rank_view(model, layout, rank, itemsize, batch)
    step_factor, optimizer_factor = factors(calibration, model)
    gemm = step_factor * gemm_seconds(view, calibration)
    optimizer = optimizer_factor * optimizer_seconds(view, calibration)
    elem = step_factor * train_elementwise_seconds(view, calibration) + optimizer
    bub = bubble(view.layout)
    comm = sum(term[-1] for term in comm_terms(view, calibration))
    factor = bubble_factor(bub, calibration.get("concurrency", 1.0), gemm + elem)
    return {"gemm_s": gemm, "elementwise_s": elem, "optimizer_s": optimizer,
            "compute_s": gemm + elem, "bubble": bub, "comm_s": comm,
            "step_s": factor * (gemm + elem) + comm, "rank": rank}


def predict_step(model, layout, batch: int, calibration: dict, itemsize: int = 4) -> dict:
    """predict_rank's dict of the busiest of the representative ranks of `layout`."""
    return max((predict_rank(model, layout, r, batch, calibration, itemsize)
                for r in representative_ranks(layout)), key=lambda row: row["step_s"])

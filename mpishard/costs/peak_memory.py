"""A rank's peak memory in one training step (no MPI): what `plan` and `inspect` show.

    rank_peak(model, layout, rank, batch) -> {component: bytes, ..., "total": bytes}

Components (itemsize bytes per element; r = rows per microbatch = batch / data ranks / m):

    parameters, gradients, optimizer
        rank_costs.rank_memory: the stored blocks, gradient blocks (ZeRO-1/2: owned slices)
        and n_state optimizer-state blocks (AdamW 2), with the strategies' additions
    gathered, activations, logits
        the largest of three moments of the step (`moments`), each on top of the saved
        activations: what the units keep for backward, the model's
        `activation_elements(view, recompute)` per row (models/*/costs.py: the units' saved
        tensors from their local shapes) x r x the most microbatches in flight on the rank
        (the pipeline schedule's own action list walked: a forward adds its chunk's share, a
        backward, or zb1p's W, removes it; 1 without pp). The moments:
        - the largest weight's backward: the backward's workspace (a decoder's attention ds;
          under recompute=1 one block's internals), the weight's gradient x^T dy (a fresh
          array before it is added), under FSDP ZeRO-3 the weight gathered whole (twice
          with prefetch=1: the next one's gather in flight), and where the model says
          'backward_holds_logits' (a decoder) on the last stage the logits' gradients
          waiting (below: k L), and without pp the logits too (train_step holds the logits
          and their gradient through the whole backward: 2 L; an MLP's workspace already
          counts them);
        - the loss (last stage), L = r x the logits' bytes: the logits, their shifted copy and
          its exponent, 3 L (2 L where this process's numpy step runs nn/cpu_rows.py's
          kernel, cpu_rows.runs_here: the logits and dy, written in place; on a device, as
          `storage` says, 2 L with the fused kernels (its fused loss), 3 L without;
          vocab-parallel: 2 L, the logits and exp(logits - max) turned into the gradient in
          place), and the logits' gradients of the other microbatches in
          flight (the runner keeps each until its backward: under GPipe all m), (k - 1) L for
          k in flight;
        - the head's backward: the last logits and the k gradients (1 + k) L, the head's
          weight gradient W, and under ZeRO-3 the head weight gathered whole.
    buffers
        the rank's batch (inputs and targets), pipeline receive buffers (every microbatch's
        activation in, and gradient back, r x the boundary width, posted at step start),
        FSDP ZeRO-2/3 gradient buckets (bucket_mb queued plus its packed copy), and under dp
        the all-reduce's own copy of the largest gradient bucket (bucket_mb, or a larger
        gradient alone: the MPI library reduces into a temporary of the message's size)
    evaluation
        with eval_batch (global rows): what an evaluation forward needs beyond the step's
        dynamic peak: its logits and the loss's two temporaries (3 L_eval) and one workspace
    kv_cache
        with generate=(rows, max_len): k and v of every block the rank holds, rows x max_len
        x the model's kv_width(tp) (in 2 bytes under 16-bit compute on a device), plus the
        prefill's logits

A model without `activation_elements` is priced without activations, logits and workspace:
only its held state, gathered weights and buffers.

With a compute dtype (`storage`, costs/storage.py) the saved activations and the workspace are
priced by `priced`: a rounding policy keeps the model's `*_wide` elements at the itemsize and
its `*_low` ones (matmul inputs) at the compute dtype's bytes on a device; a device's fused
attention keeps the log-sum-exp instead of the probabilities. Every matmul input rounded at use
is a new array: the largest weight's backward adds that weight rounded, and the head's backward
the logits' gradient and the head weight rounded. On a device a 16-bit step's own head (not
vocab-parallel: the model's 'head_keeps_low') hands the loss 16-bit logits and gets a 16-bit
gradient back (`Storage.low_logits`): every L above at the compute dtype's bytes, the head's
backward without a rounded copy of the gradient, and the loss at 2 L fused (the logits and
dy) or L / 2 beyond the unfused 3 L (the logits' 16-bit array beside their float32 copy).
"""
from __future__ import annotations

from ..nn import cpu_rows
from ..parallel import fsdp
from ..parallel.data_parallel import DEFAULT_BUCKET_MB
from ..parallel.placement import local_shape
from ..parallel.pipeline import boundary_widths
from ..parallel.schedules import make_schedule
from ..parallel.stages import pipeline_options
from .rank_costs import rank_memory, rank_view
from .storage import Storage

COMPONENTS = ("parameters", "gradients", "optimizer", "gathered", "activations", "logits",
              "buffers", "evaluation", "kv_cache")
MiB = 1 << 20


def in_flight(layout, stage: int) -> float:
    """The most microbatches whose activations `stage` holds at once, in units of one
    microbatch of its whole stage (a chunk of v counts 1/v): the schedule's actions walked."""
    pp, name, v, m = pipeline_options(layout)
    if pp == 1:
        return 1.0
    held, most = 0, 0
    split = any(a.kind == "W" for a in make_schedule(name, pp, m, v)[stage])
    for a in make_schedule(name, pp, m, v)[stage]:
        held += 1 if a.kind == "F" else -1 if a.kind == ("W" if split else "B") else 0
        most = max(most, held)
    return most / v


def tp_block(view, name) -> tuple:
    """The block of `name` the rank computes with: its stored block with fsdp gathered."""
    info = view.params[name]
    return local_shape(info.full_shape, info.placement, {**view.layout.sizes, "fsdp": 1})


def saved_bytes(parts, rows_mb, storage) -> float:
    """Bytes the units keep for backward of one microbatch of `rows_mb` rows: 'saved' per
    row as `storage` holds it (`priced`), and 'per_microbatch' whatever its rows (a Llama's
    rotary angles) at the itemsize."""
    return priced(parts, "saved", storage) * rows_mb + \
        parts.get("per_microbatch", 0) * storage.itemsize


def priced(parts, key, storage) -> float:
    """Bytes per row of the model's `key` elements ('saved' or 'workspace') as `storage` holds
    them (costs/storage.py). Under a rounding policy, where the model splits them, what the
    policy keeps instead: `key`_wide at the itemsize and `key`_low, the rounded matmul
    inputs, at storage.low. Where a device's fused attention takes the model's blocks
    (keeps_lse, parts' fused_attention): the kept probabilities (`key`_probs) as the
    (B, H, T) log-sum-exp; cuDNN's 16-bit output is the proj input (no wide `key`_out); the
    backward's ds none under cuDNN (its flash backward has no T x T array), else the
    recomputed 16-bit scores and the 16-bit ds. Without it, ds beside its rounded copy.
    With the fused 16-bit kernels (low_act) the MLP activation's `key`_act_low at
    storage.low instead of its `key`_act_wide. Otherwise all at the itemsize, and with a
    device's fused kernels in a float32 or float64 step the activation's `key`_act_fused
    instead of its `key`_act_wide (a Llama's SwiGLU keeps gate | up alone)."""
    if not storage.rounds_copies or f"{key}_low" not in parts:
        fused = parts.get(f"{key}_act_wide", 0) - parts.get(f"{key}_act_fused", 0) \
            if storage.device and storage.fused else 0
        return (parts[key] - fused) * storage.itemsize
    wide, low = storage.itemsize, storage.low
    total = parts[f"{key}_wide"] * wide + parts[f"{key}_low"] * low
    ds = parts.get("ds", 0) if key == "workspace" else 0
    if storage.low_act:                         # the activation's 16-bit input, not its
        total += parts.get(f"{key}_act_low", 0) * low - parts.get(f"{key}_act_wide", 0) * wide
    if storage.keeps_lse and parts.get("fused_attention"):
        total -= parts.get(f"{key}_probs", 0) * wide - (parts.get("lse", 0) * 4
                                                         if key == "saved" else 0)
        total -= ds * wide - (0 if storage.cudnn else 2 * ds * low)
        if storage.cudnn:
            total -= parts.get(f"{key}_out", 0) * wide
    else:
        total += ds * low                       # ds rounded for its two products
    return total


def moments(view, parts, rows_mb, storage) -> list:
    """The step's candidate peak moments beyond the held state, each {component: bytes}: the
    loss, the head's backward and the largest block's backward (module docstring)."""
    itemsize, layout = view.itemsize, view.layout
    saved = int(saved_bytes(parts, rows_mb, storage) * in_flight(layout, view.coords["pp"]))
    workspace = priced(parts, "workspace", storage) * rows_mb
    whole = {n: view.nbytes(tp_block(view, n)) for n in view.params}
    zero3 = {n for n, i in view.params.items()
             if view.size("fsdp") > 1 and fsdp.zero_stage(i.placement, layout) == 3}
    gathers = 2 if layout.option("prefetch", 0) else 1
    head = parts["head_weights"] * itemsize
    biggest = max(whole, key=whole.get, default=None)
    low_logits = storage.low_logits and bool(parts.get("head_keeps_low"))
    logits = rows_mb * parts["logits"] * (storage.low if low_logits else itemsize)
    waiting = int(-(-in_flight(layout, view.coords["pp"]) // 1)) * logits
    copies = storage.rounds_copies and "saved_low" in parts     # a matmul input rounded at
                                                                  # use: a new array
    out = [{"activations": saved + workspace + whole.get(biggest, 0) +
            copies * storage.rounded(whole.get(biggest, 0)),
            "gathered": gathers * whole[biggest] if biggest in zero3 else 0,
            "logits": (waiting + (logits if layout.size("pp") == 1 else 0)) *
            bool(parts.get("backward_holds_logits"))}]
    if logits:                       # the runner keeps each in-flight microbatch's dlogits
        fused = storage.fused if storage.device else cpu_rows.runs_here(itemsize)
        factor = 2 if parts["vocab_parallel"] or fused else 3
        if low_logits and not fused:          # the float32 loss on the logits widened
            factor = 1 + 3 * itemsize / storage.low
        out.append({"activations": saved, "logits": int(factor * logits) + waiting - logits})
        head_zero3 = head if any(whole[n] == head for n in zero3) else 0
        out.append({"activations": saved, "gathered": gathers * head_zero3,
                    "logits": int(logits + waiting + head + copies * storage.rounded(
                        (0 if low_logits else logits) + head))})
    return out


def gathered_only(view) -> int:
    """FSDP ZeRO-3 alone: the largest sharded parameter whole (x2 with prefetch)."""
    sharded = [view.nbytes(tp_block(view, n)) for n, i in view.params.items()
               if view.size("fsdp") > 1 and fsdp.zero_stage(i.placement, view.layout) == 3]
    return (2 if view.layout.option("prefetch", 0) else 1) * max(sharded, default=0)


def buffer_bytes(model, view, rows_mb) -> int:
    """The batch, pipeline receive buffers and FSDP gradient buckets (module docstring)."""
    layout = view.layout
    total = view.rows * input_bytes(model, view)
    pp, _, v, m = pipeline_options(layout)
    if pp > 1:
        widths = boundary_widths(model, layout)
        stage = view.coords["pp"]
        for k in (stage + c * pp for c in range(v)):
            if k > 0:                                          # activation received
                total += m * rows_mb * widths[k - 1] * view.itemsize
            if k < pp * v - 1:                                 # gradient received
                total += m * rows_mb * widths[k] * view.itemsize
    bucket = layout.option("bucket_mb", DEFAULT_BUCKET_MB) * MiB
    if view.size("fsdp") > 1 and layout.option("zero", 3) >= 2:
        grads = sum(view.nbytes(tp_block(view, n)) for n in view.params)
        total += 2 * min(bucket, grads)
    if view.size("dp") > 1:            # the MPI library's receive copy of one bucket
        grads = [view.nbytes(view.grad_blocks[n]) for n in view.params]
        total += max(min(bucket, sum(grads)), max(grads, default=0))
    return total


def input_bytes(model, view) -> int:
    parts = activation_parts(model, view, "0")
    return parts["input_bytes"] if parts else 0


def activation_parts(model, view, recompute):
    """The model's activation_elements, or None for a model without them."""
    hook = getattr(model, "activation_elements", None)
    return None if hook is None else hook(view, recompute)


def rank_peak(model, layout, rank: int, batch: int, itemsize: int = 4,
              optimizer: str = "adamw", momentum: float = 0.0, recompute=None,
              eval_batch=None, generate=None, storage=None) -> dict:
    """Bytes of each component of `rank`'s peak in a training step of `batch` global rows
    (module docstring), and their 'total'. recompute: '0', '1' or 'attn' instead of the
    layout's option; eval_batch: global rows of an evaluation between steps; generate:
    (rows, max_len) of a KV-cached generation; storage: how the step holds its arrays
    (costs/storage.py: a compute dtype, the device; default: every array at `itemsize` on
    the CPU). Raises rank_costs.check_fit's ValueError."""
    storage = storage or Storage(itemsize, itemsize)
    if storage.itemsize != itemsize:
        raise ValueError(f"storage.itemsize {storage.itemsize} != itemsize {itemsize}")
    view = rank_view(model, layout, rank, itemsize, batch)
    held = rank_memory(model, layout, rank, itemsize, optimizer, momentum)
    recompute = str(layout.option("recompute", 0) if recompute is None else recompute)
    rows_mb = view.rows // view.microbatches
    out = {k: held[k] for k in ("parameters", "gradients", "optimizer")}
    parts = activation_parts(model, view, recompute)
    if parts is None:
        peak = {"gathered": gathered_only(view)}
    else:
        peak = max(moments(view, parts, rows_mb, storage), key=lambda m: sum(m.values()))
    out.update({k: int(peak.get(k, 0)) for k in ("gathered", "activations", "logits")})
    out["buffers"] = buffer_bytes(model, view, rows_mb)
    out["evaluation"] = evaluation_bytes(view, parts, eval_batch, out)
    out["kv_cache"] = kv_cache_bytes(model, view, parts, generate, storage)
    out["total"] = sum(out[k] for k in COMPONENTS)
    return out


def evaluation_bytes(view, parts, eval_batch, out) -> int:
    """What an evaluation forward of `eval_batch` global rows needs beyond the step's own
    activations + logits (0 when it fits in them)."""
    if not eval_batch or parts is None:
        return 0
    rows = eval_batch // view.layout.data_parallel_size
    need = 3 * rows * parts["logits"] * view.itemsize + \
        rows * parts["workspace"] * view.itemsize
    return max(0, need - out["activations"] - out["logits"])


def kv_cache_bytes(model, view, parts, generate, storage) -> int:
    """k and v of the rank's blocks for generate=(rows, max_len), plus the prefill logits.
    The cache holds k and v as the attention's matmuls take them (nn/kv_cache.py): at
    storage.low bytes (2 under 16-bit compute on a device), else the itemsize."""
    if not generate:
        return 0
    rows, max_len = generate
    blocks = len({n.split("/")[0] for n in view.params if n.startswith("block_")})
    width = model.kv_width(view.size("tp"))
    cache = 2 * blocks * rows * max_len * width * storage.low
    return cache + (rows * parts["logits"] * view.itemsize if parts else 0)

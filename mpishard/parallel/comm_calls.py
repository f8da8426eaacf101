"""How many communication calls one rank makes per training step, per kind (no MPI).

The step-time model (step_time.py) charges each call a latency alpha, so it needs the calls
behind the bytes that each strategy's `step_comm` counts, as `engine.comm_calls` counts them
(tests/parallel/test_step_time.py holds the two equal on 4 ranks, MLP and GPT layouts). Per
microbatch (m per train_step; `forwards` = 2 under recompute=1):

    MLP tp      one all_reduce per column layer but the first (backward) and per row layer
    GPT tp      f (column: qkv, fc, the head) and g (row: attn proj, mlp proj, again per
                recomputed forward) one all_reduce each; the vocab-parallel embedding one, the
                vocab-parallel loss three; sequence_parallel: f and g are an all_gather and a
                reduce_scatter each (2 blocks (forwards + 1) + the head, + the embedding),
                and one all_reduce per LayerNorm/position gradient held; a Llama with
                its kv heads replicated on tp one all_reduce per kv weight gradient held
    cp ring     per block c-1 sends per forward, 2c-1 in the backward; Ulysses: two
                all_to_alls per forward (q|k|v to heads, the output back) and two backward
    pp          a send per virtual stage boundary crossed (activation on, gradient back);
                one broadcast of the loss on every pp rank per step
    fsdp        fsdp.step_calls (ZeRO-3's gathers, the gradient and optimizer buckets)
    dp, cp      data_parallel.plan_buckets' buckets over the averaging axes (once per step)
    loss        one all_reduce of the loss over dp, fsdp and cp
    ep          a Mixtral's exchange and routing statistics: moe_costs.step_calls
"""
from __future__ import annotations

from collections import Counter

from ..comm.mesh import AVERAGE_AXES
from . import fsdp
from .data_parallel import DEFAULT_BUCKET_MB, plan_buckets, replicated_data_axes
from .gpt_tensor_parallel import sequence_split_params
from .llama_tensor_parallel import replicated_kv_params
from .model_costs import gpt_stage, is_gpt, tp_sublayers
from .moe_costs import step_calls as moe_calls
from .pipeline import boundary_widths
from .tensor_parallel import tp_role


def tp_calls(view) -> Counter:
    """tp calls of an MLP or a GPT (module docstring)."""
    t, m = view.size("tp"), view.microbatches
    if t == 1:
        return Counter()
    if not is_gpt(view.model):
        n = view.model.n_layers
        roles = [tp_role(spec.index, n) for spec in view.layers]
        per_mb = sum(1 for spec, role in zip(view.layers, roles)
                     if role == "row" or role == "column" and spec.index > 0)
        return Counter(all_reduce=m * per_mb)
    stage, units = gpt_stage(view), tp_sublayers(view.model)   # 1: a Mixtral's MLP not on tp
    out = Counter(all_reduce=3 * m * stage.last)                      # the vocab-parallel loss
    kv = sum(1 for n in replicated_kv_params(view.model, t) if n in view.params)
    out.update(all_reduce=m * kv)                     # a Llama's kv weights replicated on tp
    if view.layout.option("sequence_parallel", 0):
        sp = units * stage.blocks * (stage.forwards + 1) + stage.last + stage.first
        split = sum(1 for n in sequence_split_params(view.model) if n in view.params)
        out.update(all_gather=m * sp, reduce_scatter=m * sp, all_reduce=m * split)
    else:
        out.update(all_reduce=m * (units * stage.blocks * (1 + stage.forwards) + stage.last
                                   + stage.first))
    return out


def cp_calls(view) -> Counter:
    c = view.size("cp")
    if c == 1:
        return Counter()
    stage, m = gpt_stage(view), view.microbatches
    if view.layout.option("cp_kind", "ring") == "ring":
        return Counter(send=m * stage.blocks * (stage.forwards * (c - 1) + 2 * c - 1))
    return Counter(all_to_all=m * stage.blocks * 2 * (stage.forwards + 1))


def pp_calls(view) -> Counter:
    pp = view.size("pp")
    if pp == 1:
        return Counter()
    last, stage = max(boundary_widths(view.model, view.layout)), view.coords["pp"]
    crossings = sum((k < last) + (k > 0) for k in range(stage, last + 1, pp))
    return Counter(send=view.microbatches * crossings, broadcast=1)


def fsdp_calls(view) -> Counter:
    out = Counter()
    if view.size("fsdp") > 1:
        for kinds in fsdp.step_calls(view).values():
            out.update(kinds)
    return out


def dp_calls(view) -> Counter:
    placements = {n: info.placement for n, info in view.params.items()}
    grad_placements, exempt = (fsdp.gradient_layout(placements) if view.size("fsdp") > 1
                               else (placements, {}))
    names = list(reversed(list(view.params)))
    axes_of = {n: replicated_data_axes(grad_placements[n], view.layout.sizes,
                                       exempt.get(n, ())) for n in names}
    nbytes = {n: view.nbytes(view.grad_blocks[n]) for n in names}
    limit = int(view.layout.option("bucket_mb", DEFAULT_BUCKET_MB) * 2 ** 20)
    return Counter(all_reduce=len(plan_buckets(names, nbytes, axes_of, limit)))


def loss_calls(view) -> Counter:
    """global_mean's all_reduce of the loss over the averaging axes."""
    return Counter(all_reduce=1 if view.size(AVERAGE_AXES) > 1 else 0)


def step_calls(view) -> dict:
    """{kind: calls} of `view`'s rank in one train_step and optimizer step (module
    docstring)."""
    out = Counter()
    for part in (tp_calls, cp_calls, pp_calls, fsdp_calls, dp_calls, loss_calls, moe_calls):
        out.update(part(view))
    return {k: v for k, v in out.items() if v}

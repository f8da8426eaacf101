"""How many communication calls one rank makes per training step, per kind (no MPI).

The step-time model (step_time.py) charges each call a latency alpha, so it needs the calls
behind the bytes that each strategy's `step_comm` counts, as `engine.comm_calls` counts them
(tests/costs/test_step_time.py holds the two equal on 4 ranks, MLP and GPT layouts). Per
microbatch (m per train_step; `forwards` = 2 under recompute=1):

    tp          the model's own tp parts' step_calls (its spec's cost_parts): an MLP's
                tensor_parallel.step_calls, a decoder's decoder_tensor_parallel.step_calls
                (and a Llama's replicated kv weights' gradients: models/llama/costs.py)
    cp ring     per block c-1 sends per forward, 2c-1 in the backward; Ulysses: two
                all_to_alls per forward (q|k|v to heads, the output back) and two backward
    pp          a send per virtual stage boundary crossed (activation on, gradient back);
                one broadcast of the loss on every pp rank per step
    fsdp        fsdp.step_calls (ZeRO-3's gathers, the gradient and optimizer buckets)
    dp, cp      data_parallel.plan_buckets' buckets over the averaging axes (once per step)
    loss        one all_reduce of the loss over dp, fsdp and cp
    ep          the model's own ep parts' step_calls (a Mixtral's exchange and routing
                statistics: models/llama/costs.py)
"""
from __future__ import annotations

from collections import Counter

from ..comm.mesh import AVERAGE_AXES
from ..parallel import fsdp
from ..parallel.data_parallel import DEFAULT_BUCKET_MB, plan_buckets, replicated_data_axes
from ..parallel.pipeline import boundary_widths
from ..parallel.unit_costs import decoder_stage


def tp_calls(view) -> Counter:
    """tp calls of the model's own tp parts (module docstring)."""
    out = Counter()
    for part in view.model.cost_parts()["tp"]:
        out.update(part.step_calls(view))
    return out


def ep_calls(view) -> Counter:
    """Calls of the model's own ep parts (module docstring)."""
    out = Counter()
    for part in view.model.cost_parts()["ep"]:
        out.update(part.step_calls(view))
    return out


def cp_calls(view) -> Counter:
    c = view.size("cp")
    if c == 1:
        return Counter()
    stage, m = decoder_stage(view), view.microbatches
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
    for part in (tp_calls, cp_calls, pp_calls, fsdp_calls, dp_calls, loss_calls, ep_calls):
        out.update(part(view))
    return {k: v for k, v in out.items() if v}

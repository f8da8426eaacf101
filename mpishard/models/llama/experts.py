"""A Mixtral (ms.Llama with n_experts) on the mesh: expert parallelism inside the blocks,
composed with dp, fsdp, tp, pp, cp and sequence parallelism (no MPI here but the groups).

ep is a data axis (as for ms.MoE): the batch's sequences are split over dp x fsdp x ep, and
an ep group is the ranks that differ only in their ep coordinate (the same dp, fsdp, pp, cp
and tp coordinates). Each SparseMoE (moe_units.py) sends its token rows to the ep rank of
their expert and back with all_to_all_v (nn/moe_routing.TokenExchange, shared with ms.MoE);
the rest of the block is the Llama's on every axis.

Placements. With E experts and P = ep ranks, each stacked expert tensor
block_i/moe/experts/{gate,up,down}/weights (E, ., .) is split on dim 0 over ep first
(Shard('ep', 0): ep rank q holds experts q E/P ... (q+1) E/P - 1), then fsdp's padded dim-0
split (zero=3) on that block; the router is replicated on ep. Their gradients: an expert's
block sums the gradients of the tokens of the whole ep group, scaled by 1/P in the layer;
GradientSync averages it over the data axes it is replicated on (dp, fsdp with zero<3) and
cp, which with the router's average over dp, fsdp, ep and cp is the single device's gradient
of the global mean loss.

tp: over the dense parts only. The attention and the vocabulary are Megatron-split as in a
Llama; the router and the experts are replicated on tp, so a block's tokens reach their experts
with the ep exchange alone (no all_reduce/reduce-scatter over tp per MoE layer, no F split to
keep divisible per expert) and ep already shards the experts' memory. Without
sequence_parallel the tp ranks hold the same tokens and compute the same MoE; with
sequence_parallel each tp rank routes its own T/tp tokens (no repeated work), and the router's
and experts' gradients, partial per tp rank, are summed over tp (SequenceParallelGrads, as the
RMSNorm scales').

cp: each cp rank routes its own T/cp tokens; its ep group is at its cp coordinate.
Padding (the step's document ids, -1): each block cuts the whole sequence's mask to the tokens
it routes (LocalTokens: cp's chunks, then sequence_parallel's part) and routes it nowhere.
pp: each stage's blocks exchange within the stage (the ep group lies inside a pp stage).

Load-balancing loss (router_aux_loss_coef = c > 0, HF's): AuxLoss sums each block's
(assignments per expert C, probabilities per expert P, rows n) over the blocks and, with one
all_reduce, over the token axes; c aux = c E sum_e C_e P_e / N^2 joins every rank's loss value
(so the engine's mean over dp, fsdp, ep and cp adds it once), and each row's dp_e gets
c E C_e / N^2 times R = dp fsdp ep cp (GradientSync averages over those ranks) times the
step's grad_scale. C must be whole before any backward: under pp only schedule=gpipe (every
forward of the step, then every backward) allows that, and there
parallel/aux_loss.AuxLossPipeline ends the
collection between each rank's last forward and first backward, the all_reduce then over pp
too (1f1b, interleaved and zb1p run a microbatch's backward before the next one's forward:
refused).

Capacity (capacity_factor set) is per sequence (one group of T tokens: the same drops on every
layout), so it is refused where a sequence is split (cp, sequence_parallel). Routing
statistics (moe_* in engine.stats) are summed over the ranks holding different tokens.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...comm.mesh import AVERAGE_AXES
from ...nn.functional import array_module
from ...nn.layers import Composite
from ...nn.moe_routing import TokenExchange
from ...parallel import placement as pl
from ...parallel.aux_loss import token_axes
from ...parallel.context_parallel import check_cp
from ...parallel.decoder import plan_decoder_params
from ...parallel.decoder_tensor_parallel import check_heads_tp
from ...parallel.sequence_parallel import SEQ_AXIS, SequenceParallelGrads
from ...parallel.sequence_split import sequence_part
from ...parallel.stages import pipeline_options
from .moe_units import SparseMoE

EXPERT_SHARD = pl.Shard("ep", 0)


def check_moe_layout(model, layout) -> None:
    """The same ValueError on every rank for a layout this Mixtral cannot run."""
    ep, sp = layout.size("ep"), layout.size("tp") > 1 and layout.option("sequence_parallel", 0)
    if model.n_experts % ep:
        raise ValueError(f"layout {layout.text!r}: ep={ep} does not divide n_experts="
                         f"{model.n_experts}: each ep rank must hold the same number of experts")
    if model.capacity_factor is not None and (layout.size("cp") > 1 or sp):
        raise ValueError(f"layout {layout.text!r}: capacity_factor={model.capacity_factor} "
                         f"counts per whole sequence; cp and sequence_parallel split it "
                         f"(use capacity_factor=None there)")
    schedule = pipeline_options(layout)[1] if layout.size("pp") > 1 else "gpipe"
    if model.router_aux_loss_coef > 0 and schedule != "gpipe":
        raise ValueError(f"layout {layout.text!r}: router_aux_loss_coef needs every block's "
                         f"routing counts of the step before its first backward; under pp "
                         f"only schedule=gpipe runs every forward first, not "
                         f"schedule={schedule} (use schedule=gpipe or router_aux_loss_coef=0)")
    check_heads_tp(model, layout)
    check_cp(model, layout)


def plan_moe_llama_params(model, layout, vstages: list, tp_shards) -> dict:
    """name -> ParamInfo: the Llama's plan with each stacked expert tensor split on dim 0
    over ep before fsdp's split."""
    check_moe_layout(model, layout)
    plan = plan_decoder_params(model, layout, vstages, tp_shards)
    if layout.size("ep") == 1:
        return plan
    for name, info in plan.items():
        if "/moe/experts/" in name:
            shards = (EXPERT_SHARD,) + info.placement.shards
            plan[name] = replace(info, placement=replace(info.placement, shards=shards))
    return plan


class RoutingStats:
    """record(index, experts, keep, capacity): block `index`'s assignments routed and kept per
    expert, summed over the token axes, into `stats` (the last training forward of each
    block here, predict's and generate's not counted):
    moe_blocks {index: (routed, kept)}, and over those blocks moe_routed, moe_kept (per
    expert), moe_dropped, moe_capacity."""

    def __init__(self, comm, axes, n_experts, stats):
        self.comm, self.axes, self.n, self.stats = comm, axes, n_experts, stats

    def __call__(self, index, experts, keep, capacity):
        counts = np.concatenate([np.bincount(experts.ravel(), minlength=self.n),
                                 np.bincount(experts[keep], minlength=self.n)]).astype(np.int64)
        if self.axes:
            counts = self.comm.backend.to_host(
                self.comm.all_reduce(counts, op="sum", group=self.axes))
        blocks = self.stats.setdefault("moe_blocks", {})
        blocks[index] = (counts[:self.n].tolist(), counts[self.n:].tolist())
        routed = np.sum([r for r, _ in blocks.values()], axis=0)
        kept = np.sum([k for _, k in blocks.values()], axis=0)
        self.stats.update(moe_routed=routed.tolist(), moe_kept=kept.tolist(),
                          moe_dropped=int(routed.sum() - kept.sum()), moe_capacity=capacity)


class AuxLoss:
    """HF's load-balancing loss over a train_step's rows (module docstring). The blocks call
    add(mb, index, experts, probs) in forward while `active` (begin(grad_scale) to end())
    and dprobs(xp, dtype) in backward; total() (collective over `axes`: the token axes, and
    pp under a pipeline) ends the forward's collection."""

    def __init__(self, comm, axes, model, n_average: int):
        self.comm, self.axes, self.n_average = comm, axes, n_average
        self.n, self.coef = model.n_experts, model.router_aux_loss_coef
        self.parts, self.grad, self.scale, self.active = {}, None, 1.0, False

    def begin(self, grad_scale) -> None:
        self.parts.clear()
        self.scale, self.active = grad_scale, True

    def end(self) -> None:
        self.grad, self.active = None, False

    def add(self, mb, index, experts, probs) -> None:
        if self.active:
            self.parts[(mb, index)] = (np.bincount(experts.ravel(), minlength=self.n),
                                       self.comm.backend.to_host(probs.sum(axis=0)),
                                       probs.shape[0])

    def total(self) -> float:
        """c aux over every rank's rows; sets the rows' gradient c E C / N^2 (scaled).

        The all_reduce(sum) of (C, P, n) over `axes` makes them the global batch's over every
        block; it needs no adjoint in backward: C is piecewise constant, and P's adjoint is
        the row gradient set here, which every block's backward adds to its dp itself."""
        parts = list(self.parts.values())
        v = np.concatenate([np.sum([c for c, _, _ in parts], axis=0),
                            np.sum([p for _, p, _ in parts], axis=0),
                            [sum(r for _, _, r in parts)]]).astype(np.float64)
        if self.axes:
            v = self.comm.backend.to_host(self.comm.all_reduce(v, op="sum", group=self.axes))
        counts, probs, rows = v[:self.n], v[self.n:2 * self.n], v[-1]
        self.grad = self.scale * self.n_average * self.coef * self.n * counts / rows ** 2
        self.parts.clear()
        self.active = False
        return self.coef * self.n * float(np.sum(counts / rows * (probs / rows)))

    def dprobs(self, xp, dtype):
        """The rows' dp_e of c aux, or None outside a train_step (engine.forward/backward:
        no auxiliary loss)."""
        return None if self.grad is None else xp.asarray(self.grad, dtype=dtype)


class LocalTokens:
    """(B, T) of the whole sequence (the step's padding mask) -> (B, t) of the tokens this
    rank's blocks route: cp rank r's chunks r and 2c-1-r (sequence_split.sequence_part), then
    under sequence_parallel tp rank s's s-th of t parts of them (as the embedding's
    reduce-scatter leaves them). No communication."""

    def __init__(self, cp: int, cp_rank: int, sp: int, sp_rank: int):
        self.cp, self.cp_rank, self.sp, self.sp_rank = cp, cp_rank, sp, sp_rank

    def __call__(self, mask):
        if self.cp > 1:
            mask = sequence_part(mask, self.cp, self.cp_rank)
        if self.sp > 1:                     # the blocks of the embedding's reduce_scatter
            mask = array_module(mask).array_split(mask, self.sp, axis=SEQ_AXIS)[self.sp_rank]
        return mask


def sparse_layers(units):
    """Every SparseMoE among `units` (nested Composites included)."""
    for u in units:
        if isinstance(u, SparseMoE):
            yield u
        elif isinstance(u, Composite):
            yield from sparse_layers(u.units)


def attach_experts(chunks, model, layout, comm, stats: dict):
    """Give each SparseMoE of this rank's chunks its ep exchange (comm's ep group), its
    statistics callback, its AuxLoss (router_aux_loss_coef > 0: over pp too), its tokens of
    a whole sequence (LocalTokens, for the padding mask) and, under sequence_parallel, the
    sum of its gradients over tp. Makes the statistics' and the
    AuxLoss's groups here, where every rank is at the same line. Returns the AuxLoss, or
    None."""
    axes = token_axes(layout)
    aux_axes = axes + (("pp",) if layout.size("pp") > 1 else ())
    aux = AuxLoss(comm, aux_axes, model, comm.mesh.size(AVERAGE_AXES)) \
        if model.router_aux_loss_coef > 0 else None
    for group in (axes, aux_axes if aux is not None else ()):
        if group:
            comm.mesh.comm(group)
    exchange = TokenExchange(comm, layout.size("ep"), model.n_experts, comm.xp)
    record = RoutingStats(comm, axes, model.n_experts, stats)
    sp = layout.size("tp") > 1 and layout.option("sequence_parallel", 0)
    coords = comm.mesh.coords
    local = LocalTokens(layout.size("cp"), coords["cp"], layout.size("tp") if sp else 1,
                        coords["tp"] if sp else 0)
    for chunk in chunks:
        for layer in sparse_layers(chunk):
            layer.exchange, layer.record, layer.aux = exchange, record, aux
            layer.local_tokens = local
            if sp:
                layer.access = SequenceParallelGrads(layer.access, comm.group("tp"),
                                                     layer.param_names)
    return aux

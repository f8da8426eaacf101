"""What a layout costs one rank, with no MPI: the memory it holds and the bytes it sends.

Every strategy file ends with its own cost model, two pure functions of a `RankView` (and a
model's own strategies, its spec's `cost_parts`, the same two methods):

    memory(view, n_state) -> {'parameters'|'gradients'|'optimizer': bytes}
        what the strategy holds beyond the base below (most add nothing)
    step_comm(view) -> {'train_step': {kind: bytes}, 'optimizer': {kind: bytes}}
        the bytes it sends in one `engine.train_step` (with sync) and one optimizer step

`rank_memory` and `step_comm` here add them up over `strategy_costs`; the `plan` and
`inspect` commands call only these. The shapes are the engine's own: `plan_params` gives
the placements and `placement.local_shape` the blocks, so what is printed is what the engine
holds (tests/parallel/test_mesh_compose.py) and sends (tests/cli/test_plan_bench.py).

Memory per rank: the base is one parameter block, one gradient block and `n_state` optimizer
state blocks (AdamW 2: exp_avg, exp_avg_sq; SGD with momentum 1; plain SGD 0) per parameter
the rank holds. A gradient block is the parameter block except under ZeRO-1/2, where it is the
owned 1/N slice (fsdp.gradient_layout). Transient buffers (all-gathered weights,
activations) are not included: the running engine's `memory_report()` measures them.

Communication is counted as `engine.comm_bytes` counts it (ring formulas: all_reduce
2(n-1)/n x array, all_gather (n-1)/n x the gathered array, reduce_scatter and all_to_all
(n-1)/n x the input, broadcast (n-1)/n x array on the root only, send the message). The
counters, and so these numbers, leave out the 96-byte header of every point-to-point message
and of a broadcast, the 8-byte length exchange before each all_gather, and an optional
gradient clipping (one world all_reduce of 8 bytes). Group sizes that are powers of two give
integers; otherwise the engine truncates each call's count, up to one byte per call below this.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from math import prod
from typing import ClassVar

from ..comm.mesh import Layout, coordinates
from ..parallel import context_parallel, data_parallel, fsdp, pipeline, tied
from ..parallel.compose import plan_params
from ..parallel.placement import local_shape
from ..validate import check_number

# The generic strategies between a model's own (its spec's cost_parts): each exposes
# memory(view, n_state) and step_comm(view)
GENERIC_COSTS = (context_parallel, pipeline, fsdp, data_parallel)
COMM_KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
PHASES = ("train_step", "optimizer")


@dataclass(frozen=True)
class RankView:
    """One rank of a layout as the cost models see it (no MPI)."""

    LOSS_BYTES: ClassVar[int] = 8    # the global mean loss travels as one float64

    model: object
    layout: Layout
    coords: dict             # the rank's mesh coordinates
    itemsize: int
    params: dict             # name -> ParamInfo of each parameter the rank holds, model order
    blocks: dict             # name -> shape of the stored parameter block
    grad_blocks: dict        # name -> shape of the gradient (and optimizer-state) block
    rows: int = 0            # rows the rank trains on per step (global batch / data ranks)
    microbatches: int = 1    # per train_step (1 without pp)

    def size(self, axes) -> int:
        """Ranks in a group over one axis or a tuple of axes."""
        axes = (axes,) if isinstance(axes, str) else axes
        return prod(self.layout.size(a) for a in axes)

    def nbytes(self, shape) -> int:
        return prod(shape) * self.itemsize

    def all_reduce_bytes(self, axes, nbytes) -> float:
        """What the engine counts for an all_reduce of `nbytes` over `axes` (ring)."""
        n = self.size(axes)
        return 2 * (n - 1) / n * nbytes

    @property
    def layers(self) -> list:
        """The model's layers whose parameters this rank holds (its pp stage's), in order."""
        return [spec for spec in self.model.layers()
                if any(name in self.params for name in spec.param_shapes)]


def strategy_costs(model) -> tuple:
    """Every cost model pricing `model`, in compose's order: its own tp parts (an MLP's, a
    decoder's with sequence_parallel and the vocab-parallel ends), cp, the pp stages, fsdp,
    dp, its own ep parts (a Mixtral's exchange), then the tied copies' exchange."""
    parts = model.cost_parts()
    return (*parts["tp"], *GENERIC_COSTS, *parts["ep"], tied)


def check_fit(model, layout, batch=None) -> int:
    """Raise ValueError (the engine's own, where it has one) unless `layout` can train `model`
    on a global batch of `batch` rows; returns the microbatches per step (1 without pp)."""
    plan_params(model, layout)          # tp must divide the hidden sizes, pp <= layers, ...
    model.check_costs(layout)           # a decoder's seq_len / cp over tp (sequence_parallel)
    m = pipeline.step_microbatches(layout)   # interleaved: microbatches a multiple of pp
    if batch is not None:
        check_number("batch", batch, low=1, integer=True)
        n = layout.data_parallel_size
        if batch % n:
            raise ValueError(f"batch {batch} does not divide by the {n} data-parallel ranks "
                             f"of layout {layout.text!r}")
        if (batch // n) % m:
            raise ValueError(f"microbatches={m} does not divide the local batch of "
                             f"{batch // n} rows (batch {batch} / {n} data-parallel ranks) "
                             f"of layout {layout.text!r}")
    return m


def rank_view(model, layout, rank: int, itemsize: int = 8, batch=None) -> RankView:
    """The RankView of `rank`; with `batch` (global rows per step) also its rows and
    microbatches. Raises check_fit's ValueError for a layout the engine refuses."""
    microbatches = check_fit(model, layout, batch)
    coords = coordinates(layout, rank)
    params = {name: info for name, info in plan_params(model, layout).items()
              if coords["pp"] in info.placement.stages and info.placement.held_at(coords)}
    sizes = layout.sizes
    # ZeRO-1/2 gradients are owned slices (with fsdp=1 the added split changes no shape)
    grad_placements, _ = fsdp.gradient_layout({n: i.placement for n, i in params.items()})
    return RankView(
        model, layout, coords, itemsize, params,
        blocks={n: local_shape(i.full_shape, i.placement, sizes) for n, i in params.items()},
        grad_blocks={n: local_shape(i.full_shape, grad_placements[n], sizes) for n, i in
                     params.items()},
        rows=0 if batch is None else batch // layout.data_parallel_size,
        microbatches=microbatches)


def optimizer_state_arrays(optimizer: str = "adamw", momentum: float = 0.0) -> int:
    """State arrays per parameter block: AdamW 2, SGD with momentum 1, plain SGD 0."""
    return {"adamw": 2, "adam": 2, "sgd": 1 if momentum else 0}.get(optimizer, 2)


def rank_memory(model, layout, rank: int, itemsize: int = 8, optimizer: str = "adamw",
                momentum: float = 0.0) -> dict:
    """Bytes of parameters, gradients and optimizer state held by `rank` (no MPI), their
    'total', and 'shapes': name -> the stored parameter block."""
    view = rank_view(model, layout, rank, itemsize)
    n_state = optimizer_state_arrays(optimizer, momentum)
    held = Counter(parameters=0, gradients=0, optimizer=0)
    for name in view.params:
        grad = view.nbytes(view.grad_blocks[name])
        held.update(parameters=view.nbytes(view.blocks[name]), gradients=grad,
                    optimizer=n_state * grad)
    for strategy in strategy_costs(model):
        held.update(strategy.memory(view, n_state))
    return {**held, "total": sum(held.values()), "shapes": dict(view.blocks)}


def step_comm(model, layout, rank: int, batch: int, itemsize: int = 8) -> dict:
    """Bytes `rank` sends in one training step, per kind, as `engine.comm_bytes` counts them:
    {'train_step': {kind: bytes}, 'optimizer': {kind: bytes}}, kinds with bytes only.

    'train_step' is `engine.train_step(x, t, loss)` with sync (forward, backward, gradient
    sync, the global loss); 'optimizer' is `opt.step()` (ZeRO-1/2 all-gather there)."""
    view = rank_view(model, layout, rank, itemsize, batch)
    sent = {phase: Counter() for phase in PHASES}
    for strategy in strategy_costs(model):
        for phase, kinds in strategy.step_comm(view).items():
            sent[phase].update(kinds)
    return {phase: {k: v for k, v in kinds.items() if v} for phase, kinds in sent.items()}


def step_comm_total(model, layout, rank, batch, itemsize=8) -> dict:
    """{kind: bytes} of one training step, both phases added."""
    total = Counter()
    for kinds in step_comm(model, layout, rank, batch, itemsize).values():
        total.update(kinds)
    return dict(total)

"""Megatron tensor parallelism: column-parallel then row-parallel linear layers.

With t = tp ranks, hidden size F and f = F / t, a pair of layers act(x W0 + b0) W1 + b1 runs as

    x (B, D) replicated
      -> f: identity forward / all-reduce(sum) backward          (CopyToTP)
      -> column layer  'bd,df->bf'  W0: (D, f)  b0: (f,)         y0 sharded on features
      -> act (element-wise, stays sharded)
      -> row layer     'bf,fd->bd'  W1: (f, D)                   partial sums
      -> g: all-reduce(sum) forward / identity backward          (ReduceFromTP)
      -> + b1 (replicated)

so each pair costs one all-reduce in the forward (g) and one in the backward (f), the latter
only because dL/dx is needed by whatever comes before (it is skipped for the model's first
layer). Layers are paired by their index: even layers are column-parallel, odd layers
row-parallel. With an odd number of layers the last one is replicated on every tp rank: its
input is the full (all-reduced) activation, so every tp rank computes the same small output
layer and the same gradients, with no communication and no divisibility constraint on the
output width.

Placements: column W (Shard('tp', 1)), column b (Shard('tp', 0)), row W (Shard('tp', 0)),
row b and the replicated last layer: replicated on tp.
"""
from __future__ import annotations

from collections import Counter

from ..nn.layers import Layer, Linear
from .placement import Shard


def tp_role(index: int, n_layers: int) -> str:
    """'column', 'row' or 'replicated' for layer `index` of `n_layers` under tp > 1."""
    if index % 2 == 1:
        return "row"
    return "replicated" if index == n_layers - 1 else "column"


def tp_shards(role: str, param: str) -> tuple:
    """Placement steps on the tp axis for a parameter ('weights' or 'bias') of a layer role."""
    if role == "column":
        return (Shard("tp", 1),) if param == "weights" else (Shard("tp", 0),)
    if role == "row":
        return (Shard("tp", 0),) if param == "weights" else ()
    return ()


def check_tp(model_layers, tp: int) -> None:
    """Every hidden size split by tp must divide by tp (raises the same ValueError on every
    rank, before any communication)."""
    n = len(model_layers)
    for spec in model_layers:
        if tp_role(spec.index, n) == "column" and spec.d_out % tp:
            raise ValueError(f"tp={tp} does not divide the hidden size {spec.d_out} of layer "
                             f"{spec.index} ({spec.d_in} -> {spec.d_out}); Megatron splits "
                             f"it column-wise")


class CopyToTP(Layer):
    """Megatron's f, before a column-parallel layer: identity forward / all-reduce(sum) over
    tp backward. Each tp rank's column block contributes a partial dL/dx; their sum is the
    full gradient.

    tp: the Comm of this rank's tp group.
    """

    def __init__(self, tp):
        super().__init__()
        self.tp = tp

    def __repr__(self):
        return "CopyToTP"

    def forward(self, x, mb=0, record=True):
        return x                                                   # identity forward

    def backward(self, dy, mb=0):
        return self.tp.all_reduce(dy, op="sum")                    # adjoint: all-reduce


class ReduceFromTP(Layer):
    """Megatron's g, after a row-parallel layer: all-reduce(sum) over tp forward / identity
    backward. The partial products x_local W[block, :] of the tp ranks add up to x W; dL/dy
    is already the full, replicated gradient, so the backward passes it through.
    """

    def __init__(self, tp):
        super().__init__()
        self.tp = tp

    def __repr__(self):
        return "ReduceFromTP"

    def forward(self, partial, mb=0, record=True):
        return self.tp.all_reduce(partial, op="sum")               # g: all-reduce forward

    def backward(self, dy, mb=0):
        return dy                                                  # adjoint: identity


class ColumnParallelLinear(Linear):
    """y_local = x W[:, block] + b[block]   'bd,df->bf' with f = F / tp.

    Weights and math are a plain Linear on the column block; the communication is in the
    CopyToTP before it.
    """


class RowParallelLinear(Linear):
    """y = ReduceFromTP(x_local W[block, :]) + b     'bf,fd->bd' with f = F / tp.

    A Linear whose partial products go through ReduceFromTP before the (replicated) bias is
    added. Its backward is Linear's on the full dy: dW = 'bf,bd->fd', db = sum_b dy,
    dx = 'bd,fd->bf' (dx stays sharded, as the column layer before it needs).
    """

    def __init__(self, tp, access, w_name, b_name=None, need_dx=True):
        super().__init__(access, w_name, b_name, need_dx, reduce=ReduceFromTP(tp))


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def output_width(spec, n_layers: int, tp: int) -> int:
    """Width of a layer's output on one tp rank: d_out / tp after a column-parallel layer (the
    activation stays sharded on features until the row layer), d_out otherwise."""
    column = tp > 1 and tp_role(spec.index, n_layers) == "column"
    return spec.d_out // tp if column else spec.d_out


def memory(view, n_state) -> dict:
    """Nothing beyond the base: the placement already splits the column and row blocks."""
    return {}


def step_comm(view) -> dict:
    """Per column layer but the model's first, CopyToTP's all_reduce of dL/dx (rows x d_in) in
    the backward; per row layer, ReduceFromTP's all_reduce of its partial output
    (rows x d_out) in the forward; the replicated odd last layer sends nothing."""
    tp = view.size("tp")
    if tp == 1:
        return {}
    n_layers = view.model.n_layers
    sent = 0.0
    for spec in view.layers:
        role = tp_role(spec.index, n_layers)
        if role == "column" and spec.index > 0:
            sent += view.all_reduce_bytes("tp", view.rows * spec.d_in * view.itemsize)
        elif role == "row":
            sent += view.all_reduce_bytes("tp", view.rows * spec.d_out * view.itemsize)
    return {"train_step": {"all_reduce": sent}}


def step_calls(view) -> Counter:
    """The calls behind step_comm's bytes: one all_reduce per column layer but the first and
    per row layer, each microbatch."""
    if view.size("tp") == 1:
        return Counter()
    n = view.model.n_layers
    per_mb = sum(1 for spec in view.layers
                 if tp_role(spec.index, n) == "row" or
                 tp_role(spec.index, n) == "column" and spec.index > 0)
    return Counter(all_reduce=view.microbatches * per_mb)

"""Megatron tensor parallelism: column-parallel then row-parallel linear layers.

With t = tp ranks, hidden size F and f = F / t, a pair of layers act(x W0 + b0) W1 + b1 runs as

    x (B, D) replicated
      -> f: identity forward / all-reduce(sum) backward          (CopyToTP)
      -> column layer  'bd,df->bf'  W0: (D, f)  b0: (f,)         y0 sharded on features
      -> act (element-wise, stays sharded)
      -> row layer     'bf,fd->bd'  W1: (f, D)                   partial sums
      -> g: all-reduce(sum) forward / identity backward, then + b1 (replicated)

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

from ..nn import functional as nn
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
    """Megatron's f: identity forward / all-reduce(sum) over tp backward.

    Each tp rank's column block contributes a partial dL/dx; their sum is the full gradient.
    """

    def __init__(self, engine):
        super().__init__()
        self.engine = engine

    def forward(self, x, mb=0, record=True):
        return x                                                   # identity forward

    def backward(self, dy, mb=0):
        return self.engine.all_reduce(dy, op="sum", group="tp")    # adjoint: all-reduce


class ColumnParallelLinear(Linear):
    """y_local = x W[:, block] + b[block]   'bd,df->bf' with f = F / tp.

    Weights and math are a plain Linear on the column block; the communication is in the
    CopyToTP before it.
    """


class RowParallelLinear(Linear):
    """y = all_reduce_tp(x_local W[block, :]) + b     'bf,fd->bd' with f = F / tp.

    g: all-reduce(sum) forward / identity backward: dy is already the full, replicated
    gradient, so each rank's block gradient needs no communication: the backward is
    Linear's (dW = 'bf,bd->fd', db = sum_b dy, dx = 'bd,fd->bf', dx stays sharded).
    """

    def __init__(self, engine, access, w_name, b_name=None, need_dx=True):
        super().__init__(access, w_name, b_name, need_dx)
        self.engine = engine

    def forward(self, x, mb=0, record=True):
        w = self.access.get(self.w_name, mb)
        partial = nn.einsum("bf,fd->bd", x, w)                      # local partial sum
        self.access.release(self.w_name, mb)
        y = self.engine.all_reduce(partial, op="sum", group="tp")  # g: all-reduce forward
        if self.b_name:
            y += self.access.get(self.b_name, mb)                   # bias once, after the sum
            self.access.release(self.b_name, mb)                    # FSDP drops the gathered b
        self.save(mb, record, x)
        return y

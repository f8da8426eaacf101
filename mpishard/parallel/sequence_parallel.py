"""Megatron sequence parallelism (`tp=N,sequence_parallel=1`): the regions between the tensor-
parallel layers (LayerNorm, residual adds) split along the sequence over the tp group.

Without it, each tp rank holds the full (B, T, D) activations of every LayerNorm and residual
and computes them redundantly. With it, rank r holds (B, T/t, D), sequence positions
r*T/t:(r+1)*T/t, and the two Megatron operators change into a gather and a scatter:

    (B, T/t, D) -> LayerNorm (local rows)
      -> GatherFromSP: all-gather along T forward / reduce-scatter(sum) along T backward
      -> column layer  'bd,df->bf'  (B, T, f), f = F / t
      -> ... -> row layer 'bf,fd->bd' partial sums (B, T, D)
      -> ScatterToSP:  reduce-scatter(sum) along T forward / all-gather along T backward
      -> + bias (replicated), residual add on (B, T/t, D)

The same bytes move as with the all-reduce (an all-reduce is a reduce-scatter then an
all-gather), but activations between the layers shrink by t. The parameters used on the
split region only (LayerNorm scale/shift, the positions) are replicated on tp while each rank
sees only its part of the sequence, so their gradients are partial sums: `SequenceParallelGrads`
all-reduces them over tp before they reach the store. (A row layer's bias is added on the
split region too, but its Linear backward sums the all-gathered dy over every position: its
gradient is already whole.)
"""
from __future__ import annotations

from ..nn.layers import Layer, Linear

SEQ_AXIS = 1                      # activations are (B, T, features)


class GatherFromSP(Layer):
    """Before a column-parallel layer: all-gather along the sequence forward / reduce-scatter
    (sum) along the sequence backward (each rank's column block gives a partial dL/dx for
    every position; the sum of the rank's own positions is its gradient). tp: the group's Comm.
    """

    def __init__(self, tp):
        super().__init__()
        self.tp = tp

    def __repr__(self):
        return "GatherFromSP"

    def forward(self, x, mb=0, record=True):
        return self.tp.all_gather(x, axis=SEQ_AXIS)                 # (B, T/t, D) -> (B, T, D)

    def backward(self, dy, mb=0):
        return self.tp.reduce_scatter(dy, op="sum", axis=SEQ_AXIS)  # adjoint: reduce-scatter


class ScatterToSP(Layer):
    """After a row-parallel layer: reduce-scatter(sum) along the sequence forward (the partial
    products add up and each rank keeps its positions) / all-gather along the sequence
    backward (dL/dy of every position, which the row layer's local block needs)."""

    def __init__(self, tp):
        super().__init__()
        self.tp = tp

    def __repr__(self):
        return "ScatterToSP"

    def forward(self, partial, mb=0, record=True):
        return self.tp.reduce_scatter(partial, op="sum", axis=SEQ_AXIS)   # (B, T/t, D)

    def backward(self, dy, mb=0):
        return self.tp.all_gather(dy, axis=SEQ_AXIS)                # adjoint: all-gather


class SequenceParallelRowLinear(Linear):
    """y = ScatterToSP(x_local W[block, :]) + b    'bf,fd->bd', f = F / tp, y (B, T/t, D).

    Linear's backward runs on the all-gathered dy (ScatterToSP's adjoint comes first): dW =
    'bf,bd->fd' and db = sum of dy over every position (both whole, the same on every tp
    rank), dx = 'bd,fd->bf' (stays sharded on features)."""

    def __init__(self, tp, access, w_name, b_name=None, need_dx=True):
        super().__init__(access, w_name, b_name, need_dx, reduce=ScatterToSP(tp))


class SequenceParallelGrads:
    """An access policy around another: gradients of `names` (parameters replicated on tp but
    used on sequence-split activations) are all-reduced (sum) over tp before `add_grad`.

    The forward used the same parameter on every rank (a broadcast over tp's sequence parts);
    its adjoint is the sum of the parts' gradients. Everything else passes through."""

    def __init__(self, inner, tp, names):
        self.inner, self.tp, self.names = inner, tp, frozenset(names)

    def get(self, name, mb=0):
        return self.inner.get(name, mb)

    def release(self, name, mb=0) -> None:
        self.inner.release(name, mb)

    def add_grad(self, name, g) -> None:
        if name in self.names:
            g = self.tp.all_reduce(g, op="sum")                     # adjoint of the broadcast
        self.inner.add_grad(name, g)

    def __getattr__(self, attr):            # on_load, owned, prefetcher, ...: the inner one's
        return getattr(self.inner, attr)


# -- cost model (no MPI): bytes per train_step, read by decoder_tensor_parallel.step_comm -------
def operator_comm(view, act: float, gathers: int, scatters: int) -> dict:
    """`gathers` all-gathers along T into (B, T, D) activations of `act` bytes and `scatters`
    reduce-scatters of (B, T, D) partial sums over tp = t ranks: (t-1)/t x act each. A
    GatherFromSP costs one of each (all-gather forward, reduce-scatter backward), and so does
    a ScatterToSP (reduce-scatter forward, all-gather backward)."""
    t = view.size("tp")
    return {"all_gather": gathers * (t - 1) / t * act,
            "reduce_scatter": scatters * (t - 1) / t * act}


def split_grads_comm(view, names) -> dict:
    """SequenceParallelGrads: one all_reduce(sum) over tp of the full gradient of each of
    `names` this rank holds, per microbatch (every backward adds it once)."""
    held = [view.params[n].full_shape for n in names if n in view.params]
    return {"all_reduce": view.microbatches * sum(view.all_reduce_bytes("tp", view.nbytes(s))
                                                  for s in held)}

"""An MLP's cost model (no MPI): parameter uses, its tp traffic, GEMMs and element-wise work.

Parameter uses are the generic table's (parallel/unit_costs.py) but for the first layer's
weight: its backward needs no dx of the model input, so it is fetched once.

A pipeline boundary is the last layer's output on one tp rank (tensor_parallel.output_width).
Its tp traffic is tensor_parallel.py's (column and row layers alternating).

Step time (costs/step_time.py): per weight block forward 2 r d_in d_out, backward twice that
less the first layer's dx, a forward more under recompute=1. Element-wise, per layer its
activation and bias (forward + backward) and the MSE, CopyToTP's dx under tp.
"""
from __future__ import annotations

from ...parallel import tensor_parallel
from ...parallel.placement import local_shape
from ...parallel.tensor_parallel import output_width, tp_role
from ...parallel.unit_costs import CostPart, unit_uses

FIRST_WEIGHTS = "layer_0/weights"


def param_uses(model, layout, name: str, held=None) -> tuple:
    gets, grads = unit_uses(name)
    return (1 if name == FIRST_WEIGHTS else gets), grads   # no backward get: no dx needed


def boundary_width(model, layout, layer) -> int:
    return output_width(layer, model.n_layers, layout.size("tp"))


class MLPTensorParallel(CostPart):
    """The column and row layers' all_reduces (tensor_parallel.step_comm, step_calls)."""

    def memory(self, view, n_state) -> dict:
        return tensor_parallel.memory(view, n_state)

    def step_comm(self, view) -> dict:
        return tensor_parallel.step_comm(view)

    def step_calls(self, view):
        return tensor_parallel.step_calls(view)


def gemms(model, view) -> list:
    """(flops per GEMM call, calls per step, 'gemm') of each weight block the rank holds."""
    layout, m = view.layout, view.microbatches
    forwards = 2 if layout.option("recompute") == "1" else 1
    out = []
    for name, info in view.params.items():
        shape = view.blocks[name]
        if len(shape) != 2:
            continue                                  # biases
        size = shape[0] * shape[1] * (layout.size("fsdp") if not
                                      info.placement.is_replicated_on("fsdp") else 1)
        passes = forwards + (1 if name == FIRST_WEIGHTS else 2)
        out.append((2 * view.rows / m * size, passes * m, "gemm"))
    return out


def elementwise(model, view, op, fixed) -> float:
    """Seconds of element-wise work per train_step (module docstring); op(name, elements):
    the calibrated seconds of one call."""
    m = view.microbatches
    rows, tp = view.rows / m, view.layout.size("tp")
    seconds = 0.0
    for spec in view.layers:
        size = rows * output_width(spec, model.n_layers, tp)
        last = spec.index == model.n_layers - 1
        seconds += op(model.final_activation if last else model.activation, size)
        seconds += (2 * (f"layer_{spec.index}/bias" in view.params)   # bias: add, gradient
                    + 3 * last) * op("pass", size)                    # MSE
        if tp > 1 and tp_role(spec.index, model.n_layers) == "column" and spec.index:
            seconds += op("pass", rows * spec.d_in)                   # CopyToTP's dx
    return m * (seconds + len(view.layers) * fixed["mlp_layer"] + fixed["mlp_base"])


def model_flops(dims, batch: int) -> int:
    """FLOPs of one training step of an MLP of `dims`: 3 x the forward's matmuls F, less the
    first layer's dx: 3F - 2 B d_0 d_1; 2 FLOPs per multiply-add."""
    forward = 2 * batch * sum(a * b for a, b in zip(dims[:-1], dims[1:]))
    return 3 * forward - 2 * batch * dims[0] * dims[1]


def activation_elements(model, view, recompute: str) -> dict:
    """Per batch row, the elements this rank's layers keep for backward (costs/peak_memory.py
    adds them up), from each weight's tp-local (d_in, d_out) block (fsdp gathers it whole):
    each Linear keeps its input d_in, each hidden activation its input d_out; the last layer's
    output d_out is the loss's input (logits) and its weight block the head's.
    workspace: the most a layer's backward holds beyond everything saved, less the later
    layers' saves it has freed: its input, its dy d_out and its dx d_in (twice for a column
    layer under tp, whose dx is all-reduced into a new array). The layout's recompute option
    changes nothing here (an MLP has no recomputable unit)."""
    sizes, tp = {**view.layout.sizes, "fsdp": 1}, view.layout.size("tp")
    saved, logits, head, moments = 0, 0, 0, []
    for spec in view.layers:
        name = f"layer_{spec.index}/weights"
        d_in, d_out = local_shape(view.params[name].full_shape, view.params[name].placement,
                                  sizes)
        last = spec.index == model.n_layers - 1
        copies = 2 if tp > 1 and spec.index and tp_role(spec.index, model.n_layers) == \
            "column" else 1
        moments.append(saved + d_in + d_out + copies * d_in)
        saved += d_in + (0 if last else d_out)
        if last:
            logits, head = d_out, d_in * d_out
    return {"saved": saved, "workspace": max(0, max(moments) - saved), "logits": logits,
            "head_weights": head, "vocab_parallel": False,
            "input_bytes": model.dims[0] * view.itemsize + 8}

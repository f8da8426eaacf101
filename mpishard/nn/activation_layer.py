"""The activation unit: act(z) element-wise, between two linear layers.

    Activation      z -> act(z)         (pointwise.activation_forward / _backward)
    keep_low_around the Linear before an Activation and the one after it hand it 16-bit
                    arrays under a device's 16-bit compute (low_out, low_dx)
"""
from __future__ import annotations

from . import functional as nn
from .gemm import is_low
from .layers import Layer, Linear
from .pointwise import LowSaved, low_activation_backward, low_activation_forward


class Activation(Layer):
    """Element-wise act(z); works on full or feature-sharded activations alike.

    overwrite_input: the unit before returns a fresh array that nothing else keeps (a linear
    layer's product: Linear saves its input, not its output), so the activation may write
    its output over it (GELU on numpy with numba: pointwise.gelu_forward).

    A 16-bit z (keep_low_around, under a device's 16-bit compute with the fused kernels)
    gives a 16-bit y, act's float32 value rounded (what the next matmul takes):
    pointwise.low_activation_forward."""

    reads_low = True

    def __init__(self, name, overwrite_input=False):
        super().__init__()
        self.name = nn.check_activation(name)
        self.overwrite_input = bool(overwrite_input)

    def __repr__(self):
        return f"Activation({self.name})"

    def forward(self, z, mb=0, record=True):
        if is_low(z):
            y, saved = low_activation_forward(self.name, z)
        else:
            y, saved = nn.activation_forward(self.name, z, self.overwrite_input)
        self.save(mb, record, saved)
        return y

    def backward(self, dy, mb=0):
        saved = self.pop(mb)
        if isinstance(saved, LowSaved) or is_low(dy):
            return low_activation_backward(self.name, dy, saved)
        return nn.activation_backward(self.name, dy, saved, overwrite=True)


def keep_low_around(units) -> list:
    """Mark the Linear before each unit in `units` that `reads_low` (an Activation, the
    Llama's SwiGLU) `low_out` and the first Linear after it `low_dx`: under a device's 16-bit
    compute, where the fused kernels run, that unit then reads its input and its gradient in
    16 bits, as stored (no float32 copy of either; autocast.Narrow.linear_kept, grad_kept).
    Returns units."""
    for i, unit in enumerate(units):
        if getattr(unit, "reads_low", False):
            before = units[i - 1] if i else None
            after = next((u for u in units[i + 1:] if isinstance(u, Linear)), None)
            if isinstance(before, Linear) and before.reduce is None and after is not None:
                before.low_out, after.low_dx = True, True
    return units

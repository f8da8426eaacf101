"""Qwen2 units: the Llama's (llama/units.py), with biases on the q, k and v projections.

    block i   Residual[RMSNorm ln_1, BiasedFusedLinear(q, k, v), Rotary, attention core,
                       attn proj]
              Residual[RMSNorm ln_2, FusedLinear(gate, up), SwiGLU, mlp down]

(a LlamaBlock whose q | k | v unit is the spec's qkv_projection: spec.py).

Under tp each bias is this rank's block of its projection's columns (whole heads, like the
weight's: parallelize.py), so y = [q_r | k_r | v_r] + [bq_r | bk_r | bv_r]; under fsdp the
biases are fetched through the access policy like every parameter.
"""
from __future__ import annotations

from ...nn import functional as nn
from ..llama.units import FusedLinear

BIASED = ("attn/q", "attn/k", "attn/v")          # the projections with a bias


class BiasedFusedLinear(FusedLinear):
    """FusedLinear(W_1, W_2, ...) plus their biases: y = x cat(W_i) + cat(b_i).

    forward   y = x W + b   'bd,df->bf' + b    (b = cat(b_1, b_2, ...), fetched per use)
    backward  dx = dy W^T (FusedLinear's);  per projection i, its columns dy_i of dy:
              dW_i = x^T dy_i, db_i = sum over rows of dy_i (undoes the broadcast of b_i)
              (zero bubble: the W pass adds dW_i, db_i, last projection first)"""

    def __init__(self, access, w_names, b_names):
        super().__init__(access, w_names)
        self.biases = tuple(b_names)
        self.param_names = tuple(n for pair in zip(self.weights, self.biases) for n in pair)

    def forward(self, x, mb=0, record=True):
        cast = self.autocast
        w, widths = self._joined(mb)
        b, _ = self._fetched(self.biases, mb, axis=0)
        x = cast.round(x)
        self.save(mb, record, (x, widths))
        return cast.output(nn.linear_forward(x, cast.round(w), cast.round(b)))   # x W + b

    def add_grads(self, i: int, x2, dy_i) -> None:
        super().add_grads(i, x2, dy_i)                           # dW_i = x^T dy_i
        self.access.add_grad(self.biases[i], self.autocast.output(nn.column_sums(dy_i)))

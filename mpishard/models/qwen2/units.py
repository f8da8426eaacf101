"""Qwen2 units: the Llama's (llama/units.py), with biases on the q, k and v projections.

    block i   Residual[RMSNorm ln_1, BiasedFusedLinear(q, k, v), Rotary, attention core,
                       attn proj]
              Residual[RMSNorm ln_2, FusedLinear(gate, up), SwiGLU, mlp down]

(a LlamaBlock whose FusedLinear(q, k, v) parallelize.py makes a BiasedFusedLinear).

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
        self.weights, self.biases = tuple(w_names), tuple(b_names)
        self.param_names = tuple(n for pair in zip(w_names, b_names) for n in pair)

    def __repr__(self):
        return f"BiasedFusedLinear({', '.join(n.rsplit('/', 2)[-2] for n in self.weights)})"

    def forward(self, x, mb=0, record=True):
        w, widths = self._joined(mb)
        b, _ = self._fetched(self.biases, mb, axis=0)
        self.save(mb, record, (x, widths))
        return nn.linear_forward(x, w, b)                        # 'bd,df->bf' + b

    def _joined(self, mb):
        """W = cat(W_1, W_2, ...) and the widths of the W_i (param_names holds the b_i too)."""
        return self._fetched(self.weights, mb, axis=1)

    def _fetched(self, names, mb, axis):
        """The parameters `names` through the access policy, joined along `axis`, and their
        sizes along it."""
        arrays = [self.access.get(n, mb) for n in names]
        joined = nn.array_module(arrays[0]).concatenate(arrays, axis=axis)
        for n in names:
            self.access.release(n, mb)
        return joined, [a.shape[axis] for a in arrays]

    def backward_weights(self, mb=0) -> None:
        x, dy, widths = self.deferred.pop(mb)
        end = sum(widths)
        for w_name, b_name, width in reversed(list(zip(self.weights, self.biases, widths))):
            dw, db = nn.linear_backward_weights(dy[..., end - width:end], x)  # Linear's pair
            self.access.add_grad(w_name, dw)
            self.access.add_grad(b_name, db)
            end -= width

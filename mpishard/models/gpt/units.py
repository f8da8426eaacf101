"""GPT layers: the units an engine stacks into pipeline stages (spec: spec.py).

    Embedding       tokens (B, T) ints -> h (B, T, D)           embed/tokens, embed/positions
    Block i         h -> h                                      block_{i}/...
                      Residual[LayerNorm ln_1, qkv, CausalSelfAttention, attn proj]
                      Residual[LayerNorm ln_2, fc, GELU (tanh), mlp proj]
    FinalNormHead   h -> logits (B, T, V)                       ln_f, head/weights or the
                                                                tied embed/tokens^T

The generic pieces (LayerNorm, the attention core, the embedding, the tied head) are
nn/transformer.py's. Tensor parallelism plugs in without new math: `Block(..., linear=...)`
builds each projection from a factory given the role ('column' for qkv and fc, 'row' for the
two output projections), so a tp engine passes [CopyToTP, ColumnParallelLinear] and
[RowParallelLinear] and the local head count; `FinalNormHead(..., head=...)` takes a
vocab-parallel head the same way (tensor_parallel.py).
"""
from __future__ import annotations

from ...nn.activation_layer import Activation, keep_low_around
from ...nn.layers import Composite, Head, Residual
from ...nn.transformer import (CausalSelfAttention, Embedding, LayerNorm, leading_positions,
                               model_head, plain_linear)


class Block(Composite):
    """Pre-LayerNorm GPT-2 block i: h + attn(ln_1(h)), then h + mlp(ln_2(h)).

    linear(access, w_name, b_name, role) -> units of one projection, role 'column' (qkv, fc)
    or 'row' (attn proj, mlp proj); n_heads: the heads this rank computes; attention(n_heads):
    the attention unit (context parallelism passes its ring or Ulysses unit).
    """

    recomputable = True        # what recompute=1 wraps (nn/recompute.py)

    def __init__(self, access, index, n_heads, linear=plain_linear,
                 attention=CausalSelfAttention):
        p = f"block_{index}"
        attn = Residual([LayerNorm(access, f"{p}/ln_1"),
                         *linear(access, f"{p}/attn/qkv/weights", f"{p}/attn/qkv/bias",
                                 "column"),
                         attention(n_heads),
                         *linear(access, f"{p}/attn/proj/weights", f"{p}/attn/proj/bias",
                                 "row")])
        mlp = Residual(keep_low_around([   # 16-bit compute on a device: GELU reads 16 bits
            LayerNorm(access, f"{p}/ln_2"),
            *linear(access, f"{p}/mlp/fc/weights", f"{p}/mlp/fc/bias", "column"),
            Activation("gelu", overwrite_input=True),              # tanh; y over fc's out
            *linear(access, f"{p}/mlp/proj/weights", f"{p}/mlp/proj/bias", "row")]))
        super().__init__([attn, mlp])
        self.index = index

    def __repr__(self):
        return f"Block({self.index})"


class FinalNormHead(Head):
    """ln_f, then the head: logits (B, T, V) = ln_f(h) head/weights, or ln_f(h) embed/tokens^T
    when `tied`. head: replacement head units (e.g. a vocab-parallel head)."""

    def __init__(self, access, tied=False, head=None):
        head = model_head(access, tied) if head is None else head
        super().__init__([LayerNorm(access, "ln_f"), *head])

    def __repr__(self):
        return "FinalNormHead"


def gpt_units(model, access, blocks, first: bool, last: bool, attention=CausalSelfAttention,
              token_positions=leading_positions) -> list:
    """The units of a pipeline chunk holding `blocks` (block indices), with the embedding in
    front when it is the first chunk and ln_f + head behind when it is the last. attention,
    token_positions: see Block and Embedding (context parallelism sets both)."""
    units = [Embedding(access, token_positions=token_positions)] if first else []
    units += [Block(access, i, model.n_heads, attention=attention) for i in blocks]
    if last:
        units.append(FinalNormHead(access, model.tied))
    return units

"""A GPT in plain torch ops over our parameter dict, for the autocast comparisons
(tests/hf/test_autocast_torch.py, tests/hf/test_autocast_training.py).

Weights are ours, (in, out), used through F.linear(x, W^T, b). Attention is written out
(q k^T * scale, the causal mask, softmax, p v) so that torch.autocast("cpu") runs each matmul
in bfloat16 with float32 accumulation and a bfloat16 output. Softmax and LayerNorm get float32
inputs explicitly: that is CUDA autocast's fp32 list, the policy the engine follows (CPU
autocast would leave them in the dtype they are given); a float32 input is what they get
anyway under CPU autocast for LayerNorm (the residual stream is float32).
"""
import math

import numpy as np
import torch
import torch.nn.functional as F


def params_to_torch(params: dict) -> dict:
    """name -> a float32 leaf tensor needing its gradient."""
    return {n: torch.tensor(np.asarray(a, dtype=np.float32), requires_grad=True)
            for n, a in params.items()}


def layer_norm(x, p, prefix):
    return F.layer_norm(x.float(), x.shape[-1:], p[f"{prefix}/scale"], p[f"{prefix}/shift"],
                        eps=1e-5)


def linear(x, p, name):
    return F.linear(x, p[f"{name}/weights"].t(), p.get(f"{name}/bias"))


def attention(a, n_heads):
    """(B, T, 3 D) q | k | v -> (B, T, D): causal softmax attention, matmuls written out."""
    b, t, three_d = a.shape
    dh = three_d // (3 * n_heads)
    q, k, v = a.reshape(b, t, 3, n_heads, dh).permute(2, 0, 3, 1, 4)
    s = (q @ k.transpose(-1, -2)) * (1.0 / math.sqrt(dh))
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    p = torch.softmax(s.float(), dim=-1)
    return (p @ v).transpose(1, 2).reshape(b, t, n_heads * dh)


def block(h, p, i, n_heads):
    """Pre-LayerNorm GPT-2 block i (GELU tanh form), as models/gpt/units.Block."""
    pre = f"block_{i}"
    a = linear(layer_norm(h, p, f"{pre}/ln_1"), p, f"{pre}/attn/qkv")
    h = h + linear(attention(a, n_heads), p, f"{pre}/attn/proj")
    z = linear(layer_norm(h, p, f"{pre}/ln_2"), p, f"{pre}/mlp/fc")
    return h + linear(F.gelu(z, approximate="tanh"), p, f"{pre}/mlp/proj")


def gpt_logits(ids, p, n_heads, n_layers):
    """ids (B, T) int64 -> logits (B, T, V) of an untied GPT (head/weights)."""
    t = ids.shape[1]
    h = p["embed/tokens"][ids] + p["embed/positions"][:t]
    for i in range(n_layers):
        h = block(h, p, i, n_heads)
    return linear(layer_norm(h, p, "ln_f"), p, "head")


def gpt_loss(ids, targets, p, n_heads, n_layers):
    """Mean cross entropy over every position (float32, autocast's fp32 list)."""
    logits = gpt_logits(ids, p, n_heads, n_layers)
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))

"""The Qwen2 spec: a Llama whose q, k and v projections carry biases. No weights live here.

`Qwen2(vocab_size, seq_len, d_model, n_heads, n_layers, n_kv_heads=None, d_ff=None,
rope_theta=10000.0, norm_eps=1e-6, tied=False)` has the Llama's parameters (llama/spec.py) and,
after each of block i's q, k and v weights, its bias (names and shapes are a contract;
H = n_heads, K = n_kv_heads, Dh = d_model / H):

    block_{i}/attn/q/bias (H Dh,)                   HF self_attn.q_proj.bias
    block_{i}/attn/k/bias (K Dh,)                   HF self_attn.k_proj.bias
    block_{i}/attn/v/bias (K Dh,)                   HF self_attn.v_proj.bias

Forward (Hugging Face's Qwen2ForCausalLM without a sliding window): the Llama's, with
q = x Wq + bq, k = x Wk + bk, v = x Wv + bv before the rotary positions; o_proj and the MLP
have no bias. No mixture of experts. The defaults are Qwen2Config's (rms_norm_eps 1e-6).

`init(seed)` is Hugging Face's Qwen2PreTrainedModel init: the Llama's N(0, 0.02) weights and
unit RMSNorm scales, biases 0; float64 numpy, the same on every rank for a seed.
"""
from __future__ import annotations

import numpy as np

from ..llama.spec import Llama
from . import hf, parallelize
from .units import BIASED, BiasedFusedLinear

EXPERT_KEYS = ("n_experts", "top_k", "capacity_factor", "router_aux_loss_coef")


class Qwen2(Llama):
    """A Qwen2 decoder spec: the Llama's (see llama/spec.py) plus q, k and v biases."""

    kind = "qwen2"
    # -- data and command line (interface.py): `--model qwen2:KEY=VALUE,...`, the dense Llama's
    flag_defaults = {**{k: v for k, v in Llama.flag_defaults.items() if k not in EXPERT_KEYS},
                     "norm_eps": 1e-6}
    flag_types = {k: v for k, v in Llama.flag_types.items() if k not in EXPERT_KEYS}

    def __init__(self, vocab_size, seq_len, d_model, n_heads, n_layers, n_kv_heads=None,
                 d_ff=None, rope_theta=10000.0, norm_eps=1e-6, tied=False):
        super().__init__(vocab_size, seq_len, d_model, n_heads, n_layers, n_kv_heads, d_ff,
                         rope_theta, norm_eps, tied)

    # -- Hugging Face (interface.py): Qwen2ForCausalLM (hf.py) ---------------------------------
    @classmethod
    def hf_maps(cls) -> tuple:
        return (hf,)

    def hf_map(self):
        return hf

    # -- parallel plan: the Llama's (llama/parallelize.py), asking these for the biases -------
    def qkv_projection(self, access, prefix: str):
        """Block `prefix`'s q | k | v projection with its biases (units.py)."""
        return BiasedFusedLinear(access, [f"{prefix}/{p}/weights" for p in BIASED],
                                 [f"{prefix}/{p}/bias" for p in BIASED])

    def tp_table(self, tp: int) -> dict:
        return parallelize.tp_table(super().tp_table(tp))

    def tp_replicated_params(self, tp: int) -> list:
        return parallelize.tp_replicated_params(super().tp_replicated_params(tp))

    # -- parameters ----------------------------------------------------------------------------
    def block_param_shapes(self, i: int) -> dict:
        """The Llama block's parameters, each biased projection's bias after its weights."""
        shapes = {}
        for name, shape in super().block_param_shapes(i).items():
            shapes[name] = shape
            if name.endswith(tuple(f"{p}/weights" for p in BIASED)):
                shapes[name[:-len("weights")] + "bias"] = (shape[1],)
        return shapes

    def init(self, seed: int = 0) -> dict:
        """The Llama's init (N(0, 0.02) weights, unit scales) with zero biases (HF's)."""
        params = super().init(seed)
        return {name: np.zeros_like(p) if name.endswith("/bias") else p
                for name, p in params.items()}

    def __repr__(self) -> str:
        return (f"Qwen2(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
                f"d_model={self.d_model}, n_heads={self.n_heads}, n_layers={self.n_layers}, "
                f"n_kv_heads={self.n_kv_heads}, d_ff={self.d_ff}, "
                f"rope_theta={self.rope_theta}, norm_eps={self.norm_eps}, tied={self.tied})")

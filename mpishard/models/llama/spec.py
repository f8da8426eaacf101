"""The Llama spec: a Llama-shaped decoder's sizes and parameter names. No weights live here.

`Llama(vocab_size, seq_len, d_model, n_heads, n_layers, n_kv_heads=None, d_ff=None,
rope_theta=10000.0, norm_eps=1e-5, tied=False, n_experts=None, top_k=2, capacity_factor=None,
router_aux_loss_coef=0.0)`, with D = d_model, H = n_heads,
K = n_kv_heads (default H; H % K == 0), Dh = D / H, F = d_ff (default 4 D), V = vocab_size,
has the parameters (names and shapes are a contract, in this order; weights are (in, out),
the transpose of Hugging Face's nn.Linear weights)

    embed/tokens (V, D)                             HF model.embed_tokens.weight
    block_{i}/ln_1/scale (D,)                       HF input_layernorm.weight
    block_{i}/attn/q/weights (D, H Dh)              HF self_attn.q_proj.weight^T
    block_{i}/attn/k/weights (D, K Dh)              HF self_attn.k_proj.weight^T
    block_{i}/attn/v/weights (D, K Dh)              HF self_attn.v_proj.weight^T
    block_{i}/attn/proj/weights (H Dh, D)           HF self_attn.o_proj.weight^T
    block_{i}/ln_2/scale (D,)                       HF post_attention_layernorm.weight
    block_{i}/mlp/gate/weights (D, F)               HF mlp.gate_proj.weight^T
    block_{i}/mlp/up/weights (D, F)                 HF mlp.up_proj.weight^T
    block_{i}/mlp/down/weights (F, D)               HF mlp.down_proj.weight^T
    ln_f/scale (D,)                                 HF model.norm.weight
    head/weights (D, V)                             HF lm_head.weight^T (absent when tied)

Forward on integer tokens (B, T), T <= S = seq_len (Hugging Face's LlamaForCausalLM, no
biases): h = rows of embed/tokens; each block is h += proj(attn(rms_1(h))), then
h += down(silu(rms_2(h) gate) * (rms_2(h) up)). RMSNorm y = x rsqrt(mean(x^2) + eps) scale.
Attention: q = x Wq, k = x Wk, v = x Wv cut into heads of Dh columns, rotary positions on q
and k (rotate-half: inv_freq = 1 / theta^(arange(0, Dh, 2) / Dh), angle = pos inv_freq,
cos/sin = cat(angle, angle), q' = q cos + rotate_half(q) sin, rotate_half(x) = cat(-x2, x1)),
query head h attends with kv head h // (H / K) (grouped-query attention), causal
softmax(q' k'^T / sqrt(Dh)) v, heads concatenated in order. Logits = rms_f(h) head/weights
(or rms_f(h) embed/tokens^T when tied), shape (B, T, V). The units are in units.py.

Mixture of experts (Mixtral; n_experts=E set, None = the dense Llama above): each block's
mlp/* names are replaced by (ours (in, out); HF MixtralSparseMoeBlock, legacy per-expert names)

    block_{i}/moe/router/weights (D, E)             HF block_sparse_moe.gate.weight^T
    block_{i}/moe/experts/gate/weights (E, D, F)    expert j: HF experts.j.w1.weight^T
    block_{i}/moe/experts/up/weights (E, D, F)      expert j: HF experts.j.w3.weight^T
    block_{i}/moe/experts/down/weights (E, F, D)    expert j: HF experts.j.w2.weight^T

and the mlp computes, per token x: p = softmax(x router) over E, the top_k experts by p, their
weights w = p_top / sum(p_top), y = sum_k w_k (silu(x gate_e) * (x up_e)) down_e (units:
moe_units.py). capacity_factor (None: no drops, as HF) drops assignments over
ceil(cf t k / E) per expert in each sequence's t tokens of a forward (in KV-cached generation
the prompt, then each new token, which is never dropped); router_aux_loss_coef adds HF's
load-balancing loss to train_step's loss (on every layout; under pp with schedule=gpipe only).

A Llama-derived spec (models/qwen2) adds parameters by overriding block_param_shapes, the
block's q | k | v unit (`qkv_projection`), the tp table (`tp_table`) and the parameters whose
gradients tp sums (`tp_replicated_params`); the plan and units ask the spec for these.

`init(seed)` is Hugging Face's LlamaPreTrainedModel init: N(0, 0.02) for every weight and the
embedding, RMSNorm scales 1; float64 numpy, the same on every rank for a seed.
"""
from __future__ import annotations

import numpy as np

from ..gpt.spec import GPT, DecoderSpec, positive_int
from . import hf, hf_mixtral, parallelize, tensor_parallel
from . import costs
from .units import FusedLinear

INIT_STD = 0.02


def _positive_float(what, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) \
            or not np.isfinite(v) or v <= 0:
        raise ValueError(f"Llama {what} must be a positive number, got {v!r}")
    return float(v)


class Llama(DecoderSpec):
    """A Llama-shaped decoder spec (RMSNorm, rotary, SwiGLU, GQA); see the module docstring.
    The sizes' checks, d_head, layers, param_shapes, check_input, output_shape:
    gpt.DecoderSpec's."""

    kind = "llama"
    # -- data and command line (interface.py): `--model llama:KEY=VALUE,...`, GPT's keys and more
    flag_defaults = {**GPT.flag_defaults, "n_kv_heads": None, "rope_theta": 10000.0,
                     "norm_eps": 1e-5, "n_experts": None, "top_k": 2, "capacity_factor": None,
                     "router_aux_loss_coef": 0.0}
    flag_types = {**GPT.flag_types, "rope_theta": "number", "norm_eps": "number",
                  "capacity_factor": "number", "router_aux_loss_coef": "weight"}

    def __init__(self, vocab_size, seq_len, d_model, n_heads, n_layers, n_kv_heads=None,
                 d_ff=None, rope_theta=10000.0, norm_eps=1e-5, tied=False, n_experts=None,
                 top_k=2, capacity_factor=None, router_aux_loss_coef=0.0):
        super().__init__(vocab_size, seq_len, d_model, n_heads, n_layers, d_ff, tied)
        self.n_experts = None if n_experts is None else \
            positive_int("n_experts", n_experts, "Llama")
        self.top_k = positive_int("top_k", top_k, "Llama")
        if self.n_experts is not None and self.top_k > self.n_experts:
            raise ValueError(f"Llama top_k={top_k} must lie in [1, n_experts={n_experts}]")
        self.capacity_factor = None if capacity_factor is None else \
            _positive_float("capacity_factor", capacity_factor)
        coef = router_aux_loss_coef
        if isinstance(coef, bool) or not isinstance(coef, (int, float, np.integer,
                                                           np.floating)) or not coef >= 0:
            raise ValueError(f"Llama router_aux_loss_coef must be a number >= 0, got {coef!r}")
        self.router_aux_loss_coef = float(coef)
        self.n_kv_heads = self.n_heads if n_kv_heads is None else \
            positive_int("n_kv_heads", n_kv_heads, "Llama")
        self.rope_theta = _positive_float("rope_theta", rope_theta)
        self.norm_eps = _positive_float("norm_eps", norm_eps)
        if self.d_head % 2:
            raise ValueError(f"Llama head size d_model/n_heads={self.d_head} must be even "
                             f"(rotary embeddings rotate pairs of columns)")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"Llama n_heads={self.n_heads} does not divide into "
                             f"n_kv_heads={self.n_kv_heads} groups")

    # -- Hugging Face (interface.py): LlamaForCausalLM (hf.py), MixtralForCausalLM (hf_mixtral.py)
    @classmethod
    def hf_maps(cls) -> tuple:
        return (hf, hf_mixtral)

    def hf_map(self):
        """A dense Llama saves as LlamaForCausalLM, one with experts as MixtralForCausalLM."""
        return hf if self.n_experts is None else hf_mixtral

    # -- parallel plan (interface.py): parallelize.py, tensor_parallel.py ----------------------
    def plan_params(self, layout) -> dict:
        return parallelize.plan_params(self, layout)

    def build(self, layout, comm, access, stats: dict):
        return parallelize.build(self, layout, comm, access, stats)

    def grads_overlap(self, layout) -> bool:
        """Not when tied (embed/tokens gets two gradients), nor with experts over ep."""
        return not (self.tied or layout.size("ep") > 1)

    # -- what a Llama-derived spec overrides for parameters of its own (models/qwen2) ---------
    def qkv_projection(self, access, prefix: str):
        """Block `prefix`'s q | k | v projection unit (units.LlamaBlock): one FusedLinear on
        its three weights."""
        return FusedLinear(access, [f"{prefix}/attn/{w}/weights" for w in "qkv"])

    def tp_table(self, tp: int) -> dict:
        """{name suffix: tp steps of its placement} on tp = `tp` ranks (tensor_parallel.py);
        a parameter no suffix ends is replicated on tp."""
        return tensor_parallel.tp_table(self, tp)

    def tp_replicated_params(self, tp: int) -> list:
        """Parameters replicated on tp = `tp` ranks of which each rank uses a part (the kv
        weights when tp does not divide the kv heads): tensor_parallel.py sums their gradients
        over tp, and costs.py prices that sum."""
        return tensor_parallel.replicated_kv_params(self, tp)

    def kv_width(self, tp: int) -> int:
        return tensor_parallel.kv_width(self, tp)

    # -- cost model (interface.py): costs.py (the decoder's, with SwiGLU and experts) ---------
    def cost_parts(self) -> dict:
        return costs.cost_parts(self)

    def step_gemms(self, view) -> list:
        return costs.gemms(self, view)

    def step_elementwise(self, view, op, fixed: dict) -> float:
        return costs.elementwise(self, view, op, fixed)

    def planned_experts(self):
        return self.n_experts

    def activation_elements(self, view, recompute: str) -> dict:
        return costs.activation_elements(self, view, recompute)

    # -- parameters ----------------------------------------------------------------------------
    def block_param_shapes(self, i: int) -> dict:
        d, p = self.d_model, f"block_{i}"
        q, kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        return {f"{p}/ln_1/scale": (d,),
                f"{p}/attn/q/weights": (d, q), f"{p}/attn/k/weights": (d, kv),
                f"{p}/attn/v/weights": (d, kv), f"{p}/attn/proj/weights": (q, d),
                f"{p}/ln_2/scale": (d,), **self.mlp_param_shapes(i)}

    def mlp_param_shapes(self, i: int) -> dict:
        """Block i's MLP: the dense SwiGLU's three matrices, or the router and the stacked
        experts (n_experts set)."""
        d, f, p = self.d_model, self.d_ff, f"block_{i}"
        if self.n_experts is None:
            return {f"{p}/mlp/gate/weights": (d, f), f"{p}/mlp/up/weights": (d, f),
                    f"{p}/mlp/down/weights": (f, d)}
        e = self.n_experts
        return {f"{p}/moe/router/weights": (d, e), f"{p}/moe/experts/gate/weights": (e, d, f),
                f"{p}/moe/experts/up/weights": (e, d, f),
                f"{p}/moe/experts/down/weights": (e, f, d)}

    def embed_param_shapes(self) -> dict:
        return {"embed/tokens": (self.vocab_size, self.d_model)}

    def head_param_shapes(self) -> dict:
        """ln_f and the head (the tied head reuses embed/tokens and adds nothing)."""
        shapes = {"ln_f/scale": (self.d_model,)}
        if not self.tied:
            shapes["head/weights"] = (self.d_model, self.vocab_size)
        return shapes

    def init(self, seed: int = 0) -> dict:
        """Full checkpoint, float64, the same on every rank for the same seed (HF's init)."""
        rng = np.random.default_rng(seed)
        return {name: np.ones(shape) if name.endswith("/scale") else
                rng.normal(0.0, INIT_STD, shape)
                for name, shape in self.param_shapes().items()}

    def __repr__(self) -> str:
        return (f"Llama(vocab_size={self.vocab_size}, seq_len={self.seq_len}, "
                f"d_model={self.d_model}, n_heads={self.n_heads}, n_layers={self.n_layers}, "
                f"n_kv_heads={self.n_kv_heads}, d_ff={self.d_ff}, "
                f"rope_theta={self.rope_theta}, norm_eps={self.norm_eps}, tied={self.tied}"
                + ("" if self.n_experts is None else
                   f", n_experts={self.n_experts}, top_k={self.top_k}, "
                   f"capacity_factor={self.capacity_factor}, "
                   f"router_aux_loss_coef={self.router_aux_loss_coef}") + ")")


def Mixtral(vocab_size, seq_len, d_model, n_heads, n_layers, n_experts, top_k=2, **kw) -> Llama:
    """ms.Mixtral: the Llama spec with a mixture of experts in every block (n_experts
    required; the other keywords are Llama's). Returns an ms.Llama (kind "llama")."""
    if n_experts is None:
        raise ValueError("Mixtral needs n_experts (ms.Llama without it is the dense model)")
    return Llama(vocab_size, seq_len, d_model, n_heads, n_layers, n_experts=n_experts,
                 top_k=top_k, **kw)

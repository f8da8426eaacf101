"""Mixtral (`MixtralForCausalLM`) <-> ms.Llama(n_experts=E, top_k=k): fields and the name map.

A Mixtral is a Llama whose MLP is a sparse mixture of E SwiGLU experts (spec.py with
n_experts): router logits x Wr, softmax over E, the top k renormalised over the k, the
weighted sum of the chosen experts' (silu(x Wg) * (x Wu)) Wd. Attention, norms, embedding and
head map as in hf.py; the block's MLP maps as (ours (in, out); E experts, F = d_ff):

    block_{i}/moe/router/weights (D, E)        layers.{i}.block_sparse_moe.gate.weight^T (E, D)
    block_{i}/moe/experts/gate/weights (E, D, F)   expert j: ...experts.{j}.w1.weight^T (F, D)
    block_{i}/moe/experts/up/weights (E, D, F)     expert j: ...experts.{j}.w3.weight^T (F, D)
    block_{i}/moe/experts/down/weights (E, F, D)   expert j: ...experts.{j}.w2.weight^T (D, F)

That per-expert layout is what the Hub's Mixtral files hold and what transformers 5.x's
`save_pretrained` still writes (it converts its fused parameters back on save). Its in-memory
fused layout is read too, where a file holds it (keys under `layers.{i}.mlp.`):

    mlp.gate.weight (E, D)                   router^T
    mlp.experts.gate_up_proj (E, 2F, D)      [:, :F] = gate^T per expert, [:, F:] = up^T
    mlp.experts.down_proj (E, D, F)          down^T per expert

Each of our expert tensors is a lazily read view (hfmap.views' `Stacked`, `Fused`): slicing
it reads only the experts and the region sliced, so `load_into` under ep reads only a rank's
experts.
`save` writes the per-expert layout.

Config: an absent field takes MixtralConfig's default (DEFAULTS), never LlamaConfig's: rope_theta
1e6, rms_norm_eps 1e-5, 8 kv heads. num_local_experts (alias num_experts) -> n_experts,
num_experts_per_tok -> top_k; the auxiliary loss is
added by transformers only with output_router_logits, so router_aux_loss_coef is the file's
coefficient when output_router_logits is true and 0 otherwise (save writes it back alike).
Refused (they change the math): sliding_window other than null, router_jitter_noise > 0,
and every field hf.py refuses. capacity_factor is mpishard's (no drops: None, as HF).
"""
from __future__ import annotations

from ...hfmap.fields import field, ints, only
from ...hfmap.views import Fused, Stacked
from . import hf as llama

ARCHITECTURE = "MixtralForCausalLM"
MODEL_TYPE = "mixtral"
SIZE_FIELDS = llama.SIZE_FIELDS + ("num_local_experts", "num_experts_per_tok",
                                   "output_router_logits", "sliding_window",
                                   "router_jitter_noise")
# MixtralConfig's defaults (transformers 5.x), not LlamaConfig's: rope_theta 1e6 (its
# default_theta), rms_norm_eps 1e-5, 8 kv heads when the field is absent (as many as the heads
# when it is null), 131072 positions, 8 experts, top-2.
DEFAULTS = dict(llama.DEFAULTS, intermediate_size=14336, num_key_value_heads=8,
                max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=1e6,
                sliding_window=None, num_local_experts=8, num_experts_per_tok=2,
                output_router_logits=False, router_aux_loss_coef=0.001, router_jitter_noise=0.0)
ignored = llama.ignored
fresh_config = llama.fresh_config


def spec_args(cfg: dict) -> dict:
    """The ms.Llama keywords (with experts) a MixtralForCausalLM config.json describes, an
    absent field read as MixtralConfig's default (DEFAULTS)."""
    a, dflt = ARCHITECTURE, DEFAULTS
    only(cfg, a, "sliding_window", (None,))
    jitter = field(cfg, dflt, "router_jitter_noise")
    if not isinstance(jitter, (int, float)) or isinstance(jitter, bool) or jitter != 0:
        raise ValueError(f"{a} config.json field router_jitter_noise={jitter!r} is not "
                         f"supported by mpishard (supported: 0.0)")
    n_experts = ints(field(cfg, dflt, "num_local_experts", "num_experts"), "num_local_experts")
    top_k = ints(field(cfg, dflt, "num_experts_per_tok"), "num_experts_per_tok")
    only(cfg, a, "output_router_logits", (False, True), dflt["output_router_logits"])
    coef = float(field(cfg, dflt, "router_aux_loss_coef")) if cfg.get("output_router_logits") \
        else 0.0
    return llama.spec_args(cfg, a, dflt, n_experts=n_experts, top_k=top_k,
                             router_aux_loss_coef=coef)


def to_config(model) -> dict:
    """The MixtralForCausalLM config.json fields of `model`."""
    out = {k: v for k, v in llama.to_config(model).items() if not k.endswith("_bias")}
    out.update(num_local_experts=model.n_experts, num_experts_per_tok=model.top_k,
               output_router_logits=model.router_aux_loss_coef > 0, sliding_window=None,
               router_jitter_noise=0.0)
    if model.router_aux_loss_coef > 0:
        out["router_aux_loss_coef"] = model.router_aux_loss_coef
    return out


def name_map(model, keys=None) -> dict:
    """{our name: (file key, transposed) or a Stacked/Fused entry}; `keys` (the file's, or
    None to save) says which layout each layer's experts are in (module docstring)."""
    out = {n: e for n, e in llama.name_map(model).items() if "/mlp/" not in n}
    keys = keys or ()
    for i in range(model.n_layers):
        ours, theirs = f"block_{i}/moe", f"model.layers.{i}"
        if f"{theirs}.mlp.experts.gate_up_proj" in keys:
            f, fused = model.d_ff, f"{theirs}.mlp.experts"
            out[f"{ours}/router/weights"] = (f"{theirs}.mlp.gate.weight", True)
            out[f"{ours}/experts/gate/weights"] = Fused(f"{fused}.gate_up_proj", 0, f)
            out[f"{ours}/experts/up/weights"] = Fused(f"{fused}.gate_up_proj", f, 2 * f)
            out[f"{ours}/experts/down/weights"] = Fused(f"{fused}.down_proj", 0, model.d_model)
            continue
        moe = f"{theirs}.block_sparse_moe"
        out[f"{ours}/router/weights"] = (f"{moe}.gate.weight", True)
        for mine, w in (("gate", "w1"), ("up", "w3"), ("down", "w2")):
            out[f"{ours}/experts/{mine}/weights"] = Stacked(
                [f"{moe}.experts.{j}.{w}.weight" for j in range(model.n_experts)])
    return out


def tiny_config() -> dict:
    """A tiny MixtralForCausalLM config (Llama's tiny one with 4 experts, top-2) that the
    conformance test (tests/hf/test_architectures.py) builds a random transformers model from."""
    return dict(llama.tiny_config(), num_local_experts=4, num_experts_per_tok=2)

"""Llama (`LlamaForCausalLM`) <-> ms.Llama: the config fields and the one name map.

ms.Llama (spec.py) computes HF's LlamaForCausalLM exactly: RMSNorm, rotate-half rotary
positions, SwiGLU, grouped-query attention, no biases. HF's weights are nn.Linear (out, in);
ours are (in, out), so every projection is transposed (the norms and embedding are not):

    model.embed_tokens.weight (V, D)                    embed/tokens
    model.layers.{i}.input_layernorm.weight (D,)         block_{i}/ln_1/scale
    model.layers.{i}.self_attn.q_proj.weight (H Dh, D)   block_{i}/attn/q/weights (D, H Dh)
    model.layers.{i}.self_attn.k_proj.weight (K Dh, D)   block_{i}/attn/k/weights (D, K Dh)
    model.layers.{i}.self_attn.v_proj.weight (K Dh, D)   block_{i}/attn/v/weights (D, K Dh)
    model.layers.{i}.self_attn.o_proj.weight (D, H Dh)   block_{i}/attn/proj/weights (H Dh, D)
    model.layers.{i}.post_attention_layernorm.weight     block_{i}/ln_2/scale
    model.layers.{i}.mlp.gate_proj.weight (F, D)         block_{i}/mlp/gate/weights (D, F)
    model.layers.{i}.mlp.up_proj.weight (F, D)           block_{i}/mlp/up/weights (D, F)
    model.layers.{i}.mlp.down_proj.weight (D, F)         block_{i}/mlp/down/weights (F, D)
    model.norm.weight (D,)                               ln_f/scale
    lm_head.weight (V, D)                                head/weights (D, V); absent when tied

A field the config.json omits takes LlamaConfig's default (DEFAULTS: rope_theta 10000,
rms_norm_eps 1e-6, as many kv heads as heads, untied, ...); hf_mixtral.py passes MixtralConfig's.
Refused config fields (they change the math): hidden_act other than silu, head_dim other
than hidden_size / num_attention_heads, attention_bias, mlp_bias, any rope scaling
(rope_scaling, or rope_parameters with a rope_type other than default), sliding windows
(sliding_window, use_sliding_window, layer_types other than full_attention), interleaved
rotary pairs (rope_interleaved; HF's Llama rotates halves).
"""
from __future__ import annotations

from ...hfmap.fields import field, ints, only

ARCHITECTURE = "LlamaForCausalLM"
MODEL_TYPE = "llama"
SIZE_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
               "max_position_embeddings", "rms_norm_eps", "rope_theta", "rope_scaling",
               "rope_parameters", "attention_bias", "mlp_bias", "tie_word_embeddings")
# LlamaConfig's defaults (transformers 5.x) for the fields read here: what an absent field
# means. num_key_value_heads None: as many as the attention heads; head_dim None: D / H;
# rope_theta: the class's default_theta, where an absent rope_parameters takes it from.
DEFAULTS = {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": None,
            "head_dim": None, "hidden_act": "silu", "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_theta": 10000.0,
            "attention_bias": False, "mlp_bias": False}


def _rope_theta(cfg: dict, a: str, defaults: dict) -> float:
    only(cfg, a, "rope_scaling", (None,))
    rope = cfg.get("rope_parameters")
    if rope is None:
        return float(field(cfg, defaults, "rope_theta"))
    if not isinstance(rope, dict):
        raise ValueError(f"{a} config.json field rope_parameters={rope!r} is not a table")
    only(rope, a, "rope_type", ("default",), "default")
    extra = sorted(set(rope) - {"rope_type", "rope_theta"})
    if extra:
        raise ValueError(f"{a} config.json field rope_parameters has {extra}, which mpishard "
                         f"does not implement (plain rotary only)")
    return float(rope.get("rope_theta", field(cfg, defaults, "rope_theta")))


def spec_args(cfg: dict, a: str = ARCHITECTURE, defaults=None, **experts) -> dict:
    """The ms.Llama keywords a LlamaForCausalLM config.json describes (Llama.from_hf_config
    builds the spec; ValueError naming a field), an absent field read as `defaults` (the
    architecture's transformers config class: DEFAULTS, LlamaConfig's, unless given). `a` names
    the architecture in errors; `experts`: hf_mixtral.py's MoE keyword arguments."""
    dflt = DEFAULTS if defaults is None else defaults
    for name, allowed in (("hidden_act", ("silu",)), ("attention_bias", (False,)),
                          ("mlp_bias", (False,)), ("sliding_window", (None,)),
                          ("use_sliding_window", (False,)),
                          ("rope_interleaved", (False,))):      # SmolLM's configs carry it
        only(cfg, a, name, allowed, dflt.get(name, allowed[0]))
    layer_types = cfg.get("layer_types")
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        raise ValueError(f"{a} config.json field layer_types={layer_types!r} is not supported "
                         f"by mpishard (supported: full_attention only)")
    d = ints(field(cfg, dflt, "hidden_size"), "hidden_size")
    h = ints(field(cfg, dflt, "num_attention_heads"), "num_attention_heads")
    if cfg.get("head_dim") is not None and cfg["head_dim"] * h != d:
        raise ValueError(f"{a} config.json field head_dim={cfg['head_dim']!r} is not supported "
                         f"by mpishard (supported: hidden_size / num_attention_heads = "
                         f"{d / h:g})")
    # absent: the class's default (Llama: the heads, Mixtral: 8); null: the heads (both)
    kv = cfg["num_key_value_heads"] if "num_key_value_heads" in cfg else \
        dflt["num_key_value_heads"]
    return dict(vocab_size=ints(field(cfg, dflt, "vocab_size"), "vocab_size"),
                seq_len=ints(field(cfg, dflt, "max_position_embeddings"),
                             "max_position_embeddings"),
                d_model=d, n_heads=h,
                n_layers=ints(field(cfg, dflt, "num_hidden_layers"), "num_hidden_layers"),
                n_kv_heads=None if kv is None else ints(kv, "num_key_value_heads"),
                d_ff=ints(field(cfg, dflt, "intermediate_size"), "intermediate_size"),
                rope_theta=_rope_theta(cfg, a, dflt),
                norm_eps=float(field(cfg, dflt, "rms_norm_eps")),
                tied=bool(field(cfg, dflt, "tie_word_embeddings")), **experts)


def to_config(model) -> dict:
    """The LlamaForCausalLM config.json fields of `model` (sizes and the math)."""
    return {"vocab_size": model.vocab_size, "hidden_size": model.d_model,
            "intermediate_size": model.d_ff, "num_hidden_layers": model.n_layers,
            "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_kv_heads,
            "head_dim": model.d_head, "hidden_act": "silu",
            "max_position_embeddings": model.seq_len, "rms_norm_eps": model.norm_eps,
            "rope_theta": model.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": model.rope_theta},
            "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": model.tied}


def fresh_config() -> dict:
    """Fields of a model that came from no file: no dropout, no token ids."""
    return {"attention_dropout": 0.0, "bos_token_id": None, "eos_token_id": None}


def name_map(model, keys=None) -> dict:
    """{our name: (file key, transposed)} (`keys` unused: Llama files have one prefix)."""
    out = {"embed/tokens": ("model.embed_tokens.weight", False)}
    for i in range(model.n_layers):
        ours, theirs = f"block_{i}", f"model.layers.{i}"
        out[f"{ours}/ln_1/scale"] = (f"{theirs}.input_layernorm.weight", False)
        out[f"{ours}/ln_2/scale"] = (f"{theirs}.post_attention_layernorm.weight", False)
        for mine, hf in (("attn/q", "self_attn.q_proj"), ("attn/k", "self_attn.k_proj"),
                         ("attn/v", "self_attn.v_proj"), ("attn/proj", "self_attn.o_proj"),
                         ("mlp/gate", "mlp.gate_proj"), ("mlp/up", "mlp.up_proj"),
                         ("mlp/down", "mlp.down_proj")):
            out[f"{ours}/{mine}/weights"] = (f"{theirs}.{hf}.weight", True)
    out["ln_f/scale"] = ("model.norm.weight", False)
    if not model.tied:
        out["head/weights"] = ("lm_head.weight", True)
    return out


def ignored(key: str, model) -> bool:
    """File keys that are not parameters: rotary buffers of old files, a tied lm_head copy."""
    return key.endswith(".rotary_emb.inv_freq") or (model.tied and key == "lm_head.weight")


def tiny_config() -> dict:
    """A tiny LlamaForCausalLM config (an odd vocabulary, 2 kv heads for 4, untied) that the
    conformance test (tests/hf/test_architectures.py) builds a random transformers model from."""
    return {"vocab_size": 97, "max_position_embeddings": 16, "hidden_size": 32,
            "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rope_theta": 500.0, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False}

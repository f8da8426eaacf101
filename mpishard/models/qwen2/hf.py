"""Qwen2 (`Qwen2ForCausalLM`) <-> ms.Qwen2: the config fields and the one name map.

ms.Qwen2 computes HF's Qwen2ForCausalLM exactly when no layer slides its attention window:
the Llama's math (llama's name map, transposed projections) plus the q, k and v biases,
which are vectors and kept as they are:

    model.layers.{i}.self_attn.q_proj.bias (H Dh,)       block_{i}/attn/q/bias
    model.layers.{i}.self_attn.k_proj.bias (K Dh,)       block_{i}/attn/k/bias
    model.layers.{i}.self_attn.v_proj.bias (K Dh,)       block_{i}/attn/v/bias

A field the config.json omits takes Qwen2Config's default (DEFAULTS: a 151936 vocabulary,
rope_theta 10000, rms_norm_eps 1e-6, 32 kv heads, ...). Refused fields are the Llama's
(hidden_act other than silu, a head_dim other than hidden_size / num_attention_heads, rope
scaling, interleaved rotary pairs, layer_types other than full_attention), and a sliding
window: use_sliding_window true. Real Qwen2 configs carry a sliding_window size (and
max_window_layers) with use_sliding_window false, where transformers slides no layer: those
load.
"""
from __future__ import annotations

from ...hfmap.fields import only
from ..llama import hf as llama
from .units import BIASED

ARCHITECTURE = "Qwen2ForCausalLM"
MODEL_TYPE = "qwen2"
# what to_config writes, and the Llama's head_dim and bias flags (no Qwen2Config fields), which
# to_config drops: listed here, save copies none of them from a source config either
SIZE_FIELDS = llama.SIZE_FIELDS + ("use_sliding_window",)
# Qwen2Config's fields that only matter with use_sliding_window true (transformers sets
# sliding_window to None otherwise); layer_types stays the Llama's check (full_attention only:
# transformers itself refuses a sliding layer type without a window)
WINDOW_FIELDS = ("use_sliding_window", "sliding_window", "max_window_layers")
# Qwen2Config's defaults (transformers 5.x) for the fields read here: what an absent field
# means. rope_theta: the class's default_theta, where an absent rope_parameters takes it from.
DEFAULTS = {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016,
            "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32,
            "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False, "rope_theta": 10000.0, "use_sliding_window": False}


def spec_args(cfg: dict, a: str = ARCHITECTURE) -> dict:
    """The ms.Qwen2 keywords a Qwen2ForCausalLM config.json describes (ValueError naming a
    field): the Llama's reading with Qwen2Config's defaults, once the window is checked off."""
    only(cfg, a, "use_sliding_window", (False,), DEFAULTS["use_sliding_window"])
    return llama.spec_args({k: v for k, v in cfg.items() if k not in WINDOW_FIELDS}, a,
                           DEFAULTS)


def to_config(model) -> dict:
    """The Qwen2ForCausalLM config.json fields of `model`: the Llama's that Qwen2Config has,
    and no sliding window."""
    cfg = {k: v for k, v in llama.to_config(model).items()
           if k not in ("head_dim", "attention_bias", "mlp_bias")}
    return dict(cfg, use_sliding_window=False)


fresh_config = llama.fresh_config


def name_map(model, keys=None) -> dict:
    """{our name: (file key, transposed)}: the Llama's and the q, k, v biases (as they are)."""
    out = {}
    for ours, (key, transposed) in llama.name_map(model, keys).items():
        out[ours] = (key, transposed)
        if ours.endswith(tuple(f"{p}/weights" for p in BIASED)):
            out[ours[:-len("weights")] + "bias"] = (key[:-len("weight")] + "bias", False)
    return out


ignored = llama.ignored


def tiny_config() -> dict:
    """A tiny Qwen2ForCausalLM config (the Llama's: an odd vocabulary, 2 kv heads for 4; tied
    like the small Qwen2 models) that the conformance test (tests/hf/test_architectures.py)
    builds a random transformers model from."""
    return dict(llama.tiny_config(), tie_word_embeddings=True)

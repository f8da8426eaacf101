"""GPT-2 (`GPT2LMHeadModel`) <-> ms.GPT: the config fields and the one name map.

ms.GPT is GPT-2's layout (spec.py): pre-LayerNorm blocks, tanh GELU, LayerNorm eps 1e-5, and
GPT-2's Conv1D weights are already (in, out), ours too, so no weight is transposed except an
untied lm_head (an nn.Linear, (V, D)). The fused qkv (D, 3D) splits q | k | v in the same order.

    transformer.wte.weight (V, D)            embed/tokens
    transformer.wpe.weight (S, D)            embed/positions       S = n_positions
    transformer.h.{i}.ln_1.weight / .bias    block_{i}/ln_1/scale / shift
    transformer.h.{i}.attn.c_attn.weight     block_{i}/attn/qkv/weights (D, 3D), .bias (3D,)
    transformer.h.{i}.attn.c_proj.weight     block_{i}/attn/proj/weights (D, D), .bias
    transformer.h.{i}.ln_2.weight / .bias    block_{i}/ln_2/scale / shift
    transformer.h.{i}.mlp.c_fc.weight        block_{i}/mlp/fc/weights (D, F), .bias
    transformer.h.{i}.mlp.c_proj.weight      block_{i}/mlp/proj/weights (F, D), .bias
    transformer.ln_f.weight / .bias          ln_f/scale / shift
    lm_head.weight (V, D)                    head/weights (D, V), transposed; absent when tied

A field the config.json omits takes GPT2Config's default (DEFAULTS: 1024 positions, tied
embeddings, ...); the aliases transformers maps (hidden_size, max_position_embeddings,
num_attention_heads, num_hidden_layers) read too, and an old config's n_ctx stands in for an
absent n_positions. Files written by `save_pretrained` carry the `transformer.` prefix; the
original `gpt2` upload does not (`wte.weight`, `h.0.attn...`): both read. The causal-mask buffers
`attn.bias` / `attn.masked_bias` of old files are ignored. Refused config fields (they change
the math): activation_function other than gelu_new / gelu_pytorch_tanh, layer_norm_epsilon
other than 1e-5, scale_attn_weights False, scale_attn_by_inverse_layer_idx,
reorder_and_upcast_attn, add_cross_attention. Dropout probabilities are kept in the config
but mpishard trains without dropout.
"""
from __future__ import annotations

import re

from ...hfmap.fields import field, ints, only

ARCHITECTURE = "GPT2LMHeadModel"
MODEL_TYPE = "gpt2"
PREFIX = "transformer."
IGNORED = re.compile(r"^(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)$")
# The fields to_config writes (the model's math); save copies the source's others over.
SIZE_FIELDS = ("vocab_size", "n_positions", "n_ctx", "n_embd", "n_layer", "n_head", "n_inner",
               "activation_function", "layer_norm_epsilon", "scale_attn_weights",
               "scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn",
               "add_cross_attention", "tie_word_embeddings")
# GPT2Config's defaults (transformers 5.x) for the fields read here: what an absent field means.
DEFAULTS = {"vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12,
            "n_head": 12, "n_inner": None, "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-5, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "add_cross_attention": False, "tie_word_embeddings": True}


def spec_args(cfg: dict) -> dict:
    """The ms.GPT keywords a GPT2LMHeadModel config.json describes (GPT.from_hf_config builds
    the spec), an absent field read as GPT2Config's default (DEFAULTS); ValueError naming a
    field we lack."""
    a, dflt = ARCHITECTURE, DEFAULTS
    for name, allowed in (("activation_function", ("gelu_new", "gelu_pytorch_tanh")),
                          ("layer_norm_epsilon", (1e-5,)), ("scale_attn_weights", (True,)),
                          ("scale_attn_by_inverse_layer_idx", (False,)),
                          ("reorder_and_upcast_attn", (False,)),
                          ("add_cross_attention", (False,))):
        only(cfg, a, name, allowed, dflt[name])
    d = ints(field(cfg, dflt, "n_embd", "hidden_size"), "n_embd")
    inner = cfg.get("n_inner")
    return dict(vocab_size=ints(field(cfg, dflt, "vocab_size"), "vocab_size"),
                seq_len=ints(field(cfg, dflt, "n_positions", "max_position_embeddings",
                                   "n_ctx"), "n_positions"),
                d_model=d, n_heads=ints(field(cfg, dflt, "n_head", "num_attention_heads"),
                                        "n_head"),
                n_layers=ints(field(cfg, dflt, "n_layer", "num_hidden_layers"), "n_layer"),
                d_ff=4 * d if inner is None else ints(inner, "n_inner"),
                tied=bool(field(cfg, dflt, "tie_word_embeddings")))


def to_config(model) -> dict:
    """The GPT2LMHeadModel config.json fields of `model` (sizes and the math)."""
    return {"vocab_size": model.vocab_size, "n_positions": model.seq_len,
            "n_ctx": model.seq_len, "n_embd": model.d_model, "n_layer": model.n_layers,
            "n_head": model.n_heads,
            "n_inner": None if model.d_ff == 4 * model.d_model else model.d_ff,
            "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "add_cross_attention": False,
            "tie_word_embeddings": model.tied}


def fresh_config() -> dict:
    """Fields of a model that came from no file: no dropout (mpishard has none), no ids."""
    return {"resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "bos_token_id": None, "eos_token_id": None}


def name_map(model, keys=None) -> dict:
    """{our name: (file key, transposed)}; the prefix is the one `keys` use (default
    `transformer.`, what save_pretrained writes)."""
    p = "" if keys is not None and "wte.weight" in keys else PREFIX
    out = {"embed/tokens": (f"{p}wte.weight", False),
           "embed/positions": (f"{p}wpe.weight", False)}
    for i in range(model.n_layers):
        ours, theirs = f"block_{i}", f"{p}h.{i}"
        for norm in ("ln_1", "ln_2"):
            out[f"{ours}/{norm}/scale"] = (f"{theirs}.{norm}.weight", False)
            out[f"{ours}/{norm}/shift"] = (f"{theirs}.{norm}.bias", False)
        for mine, hf in (("attn/qkv", "attn.c_attn"), ("attn/proj", "attn.c_proj"),
                         ("mlp/fc", "mlp.c_fc"), ("mlp/proj", "mlp.c_proj")):
            out[f"{ours}/{mine}/weights"] = (f"{theirs}.{hf}.weight", False)
            out[f"{ours}/{mine}/bias"] = (f"{theirs}.{hf}.bias", False)
    out["ln_f/scale"] = (f"{p}ln_f.weight", False)
    out["ln_f/shift"] = (f"{p}ln_f.bias", False)
    if not model.tied:
        out["head/weights"] = ("lm_head.weight", True)
    return out


def ignored(key: str, model) -> bool:
    """File keys that are not parameters: the mask buffers, and a tied file's lm_head copy."""
    return bool(IGNORED.match(key)) or (model.tied and key == "lm_head.weight")


def tiny_config() -> dict:
    """A tiny GPT2LMHeadModel config (an odd vocabulary, 2 blocks of 4 heads, untied) that the
    conformance test (tests/hf/test_architectures.py) builds a random transformers model from."""
    return {"vocab_size": 97, "n_positions": 16, "n_embd": 32, "n_inner": 48, "n_layer": 2,
            "n_head": 4, "tie_word_embeddings": False}

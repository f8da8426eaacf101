"""ms.hf with Llama (serial): load equals transformers' LlamaForCausalLM logits in float64
(GQA, odd vocabulary, perturbed RMSNorm weights, tied and untied), save loads back in
transformers bit for bit, dtypes and sharded files, and every refused config field.

Run: `pytest -q tests/hf/test_hf_llama.py` (needs the hf extra: transformers, torch CPU).
"""
import os

import ml_dtypes
import numpy as np
import pytest
import torch

import mpishard as ms
from conftest import assert_close
from hf_models import check_save_round_trip, edit_config, hf_logits, llama, our_logits, tokens

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kv", [2, 4, 1])
def test_load_gives_transformers_logits(tmp_path, tied, kv):
    d, ref = llama(tmp_path, tied=tied, num_key_value_heads=kv)
    model, params = ms.hf.load(d)
    assert (model.kind, model.tied, model.n_kv_heads, model.rope_theta, model.norm_eps) == \
        ("llama", tied, kv, 500.0, 1e-6)
    assert params["block_1/attn/k/weights"].shape == (32, kv * 8)
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x),
                 what=f"llama tied={tied} kv={kv}")


@pytest.mark.parametrize("tied", [False, True])
def test_save_loads_in_transformers_bit_for_bit(tmp_path, tied):
    cfg = check_save_round_trip(llama, tmp_path, tied)
    assert (cfg["num_key_value_heads"], cfg["rope_theta"], cfg["tie_word_embeddings"]) == \
        (2, 500.0, tied)
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["rms_norm_eps"] == 1e-6


def test_bfloat16_round_trip_and_a_fresh_spec(tmp_path):
    d, ref = llama(tmp_path / "src", dtype=torch.bfloat16)
    model, params = ms.hf.load(d)
    assert {a.dtype for a in params.values()} == {np.dtype(ml_dtypes.bfloat16)}
    out = ms.hf.save(tmp_path / "out", model, {k: v.astype(np.float64)
                                               for k, v in params.items()})
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.dtype == torch.bfloat16
    # the source as transformers loads it (the in-memory `ref` holds its rotary inv_freq
    # buffer cast to bfloat16 by .to(), a loaded model keeps it float32)
    src = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    x = tokens(ref)
    assert np.array_equal(hf_logits(back, x), hf_logits(src, x))
    fresh = ms.Llama(vocab_size=31, seq_len=8, d_model=16, n_heads=4, n_layers=1, n_kv_heads=2,
                     d_ff=24, rope_theta=1e4, norm_eps=1e-5)
    p = fresh.init(seed=2)
    out = ms.hf.save(tmp_path / "fresh", fresh, p, dtype="float64")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    x = tokens(31, T=8)
    assert_close(hf_logits(back, x), our_logits(fresh, p, x), what="fresh llama export")


def test_sharded_files_with_an_index(tmp_path):
    d, ref = llama(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    model, params = ms.hf.load(d)
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x), what="llama sharded")


@pytest.mark.parametrize("fields,match", [
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"attention_bias": True}, "attention_bias=True"),
    ({"mlp_bias": True}, "mlp_bias=True"),
    ({"head_dim": 16}, "head_dim=16"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0}}, "rope_scaling="),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}},
     "rope_type='llama3'"),
    ({"sliding_window": 4}, "sliding_window=4"),
    ({"rope_interleaved": True}, "rope_interleaved=True"),
    ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types="),
])
def test_unsupported_config_fields_are_named(tmp_path, fields, match):
    d, _ = llama(tmp_path)
    edit_config(d, **fields)
    with pytest.raises(ValueError, match=match):
        ms.hf.load(d)

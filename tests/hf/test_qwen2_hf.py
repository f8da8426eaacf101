"""ms.Qwen2 against transformers' Qwen2ForCausalLM (serial): load gives its float64 logits at
rtol 1e-9 (GQA, odd vocabulary, perturbed RMSNorm weights and q/k/v biases, tied and untied),
every gradient equals its autograd's, and greedy generation its ids; save loads back in
transformers bit for bit; a fresh ms.Qwen2 exports; a real Qwen2 config's sliding_window size
with use_sliding_window false loads, and use_sliding_window true is refused naming the field,
as are the Llama's unsupported fields; DEFAULTS are the installed Qwen2Config's.

Run: `pytest -q tests/hf/test_qwen2_hf.py` (needs the hf extra: transformers, torch CPU).
"""
import json
import os

import numpy as np
import pytest
import torch

import mpishard as ms
from conftest import assert_close
from hf_models import _perturbed, _save, check_save_round_trip, edit_config, float64_llama, \
    hf_logits, our_logits, tokens
from mpishard.models.qwen2 import hf as qwen2_hf
from test_generate_hf import NEW, PROMPTS, transformers_greedy

transformers = pytest.importorskip("transformers")

SIZES = dict(vocab_size=97, max_position_embeddings=16, hidden_size=32, intermediate_size=48,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             rope_parameters={"rope_type": "default", "rope_theta": 500.0}, rms_norm_eps=1e-6)
BIASES = ("q_proj.bias", "k_proj.bias", "v_proj.bias")


def qwen2(directory, tied=False, seed=0, dtype=torch.float64, **sizes):
    """A Qwen2ForCausalLM saved under `directory`, its RMSNorm weights and q/k/v biases moved
    off 1 and 0 (transformers initialises biases to 0, which would hide a missing bias):
    (directory, model)."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2Config(**{**SIZES, **sizes}, tie_word_embeddings=tied,
                                   bos_token_id=0, eos_token_id=1)
    model = _perturbed(transformers.Qwen2ForCausalLM(cfg), seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(BIASES):
                p.add_(torch.randn_like(p) * 0.3)
    model = model.to(dtype)
    return _save(model, directory, None), model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("kv", [2, 4, 1])
def test_load_gives_transformers_logits(tmp_path, tied, kv):
    d, ref = qwen2(tmp_path, tied=tied, num_key_value_heads=kv)
    model, params = ms.hf.load(d)
    assert isinstance(model, ms.Qwen2) and model.kind == "qwen2"
    assert (model.tied, model.n_kv_heads, model.rope_theta, model.norm_eps) == \
        (tied, kv, 500.0, 1e-6)
    assert params["block_1/attn/k/bias"].shape == (kv * 8,)
    assert np.abs(params["block_0/attn/q/bias"]).min() > 0
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x),
                 what=f"qwen2 tied={tied} kv={kv}")


@pytest.mark.parametrize("tied", [False, True])
def test_every_gradient_equals_transformers_autograd(tmp_path, tied):
    """train_step's loss and the gradient of every parameter (the biases included) equal
    autograd's through Qwen2ForCausalLM (float64, its float32 steps in float64)."""
    d, ref = qwen2(tmp_path, tied=tied)
    model, params = ms.hf.load(d)
    x, t = tokens(ref), tokens(ref, seed=6)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    value, grads = engine.train_step(x, t, ms.losses.CrossEntropy())
    with float64_llama(ref):
        logits = ref(torch.as_tensor(x)).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.as_tensor(t).reshape(-1))
        loss.backward()
    assert_close(value, loss.item(), what="qwen2 loss vs transformers")
    theirs = dict(ref.named_parameters())
    for ours, (key, transposed) in qwen2_hf.name_map(model).items():
        g = theirs[key].grad.numpy()
        assert_close(grads[ours], g.T if transposed else g, what=f"qwen2 d {ours}")


def test_greedy_ids_equal_transformers_generate(tmp_path):
    d, ref = qwen2(tmp_path)
    want = transformers_greedy(ref, PROMPTS)
    assert any(len(r) == NEW for r in want), "every row ended at once: a weak comparison"
    engine = ms.SingleDevice(ms.hf.read_model(d))
    ms.hf.load_into(engine, d)
    got = engine.generate(PROMPTS, NEW, temperature=0, eos=1)
    assert got == want, f"qwen2: {got} != transformers' {want}"


@pytest.mark.parametrize("tied", [False, True])
def test_save_loads_in_transformers_bit_for_bit(tmp_path, tied):
    cfg = check_save_round_trip(qwen2, tmp_path, tied)
    assert cfg["architectures"] == ["Qwen2ForCausalLM"] and cfg["model_type"] == "qwen2"
    assert (cfg["num_key_value_heads"], cfg["tie_word_embeddings"], cfg["rms_norm_eps"]) == \
        (2, tied, 1e-6)
    assert cfg["use_sliding_window"] is False


def test_a_fresh_spec_exports(tmp_path):
    fresh = ms.Qwen2(vocab_size=31, seq_len=8, d_model=16, n_heads=4, n_layers=1,
                     n_kv_heads=2, d_ff=24, rope_theta=1e4)
    p = fresh.init(seed=2)
    assert not p["block_0/attn/v/bias"].any(), "biases start at 0, as transformers' do"
    p = {k: v + 0.1 if k.endswith("/bias") else v for k, v in p.items()}
    out = ms.hf.save(tmp_path / "fresh", fresh, p, dtype="float64")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "Qwen2ForCausalLM"
    x = tokens(31, T=8)
    assert_close(hf_logits(back, x), our_logits(fresh, p, x), what="fresh qwen2 export")


def test_a_sliding_window_size_without_use_sliding_window_loads(tmp_path):
    """Real Qwen2 configs carry sliding_window 4096 (and max_window_layers) with
    use_sliding_window false: transformers slides no layer, and neither do we."""
    d, ref = qwen2(tmp_path)
    edit_config(d, sliding_window=4, use_sliding_window=False, max_window_layers=1,
                layer_types=["full_attention", "full_attention"])
    back = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    x = tokens(ref, T=12)
    want = hf_logits(ref, x)
    assert np.array_equal(hf_logits(back, x), want), "transformers slides no window either"
    model, params = ms.hf.load(d)
    assert_close(our_logits(model, params, x), want, what="qwen2 sliding_window unused")


@pytest.mark.parametrize("fields,match", [
    ({"use_sliding_window": True}, "use_sliding_window=True"),
    ({"use_sliding_window": True, "sliding_window": 4096}, "use_sliding_window=True"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types="),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 16}, "head_dim=16"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling="),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}},
     "rope_type='yarn'"),
])
def test_unsupported_config_fields_are_named(tmp_path, fields, match):
    d, _ = qwen2(tmp_path)
    edit_config(d, **fields)
    with pytest.raises(ValueError, match=match):
        ms.hf.load(d)


def test_the_defaults_are_the_installed_transformers_ones():
    c = transformers.Qwen2Config()
    for name, value in qwen2_hf.DEFAULTS.items():
        want = c.rope_parameters["rope_theta"] if name == "rope_theta" else getattr(c, name)
        assert value == want and type(value) is type(want), (name, value, want)
    model = ms.Qwen2.from_hf_config({"architectures": ["Qwen2ForCausalLM"]}, qwen2_hf)
    assert (model.vocab_size, model.seq_len, model.d_model, model.n_layers, model.n_heads,
            model.n_kv_heads, model.d_ff, model.rope_theta, model.norm_eps, model.tied) == (
        c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_hidden_layers,
        c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
        c.rope_parameters["rope_theta"], c.rms_norm_eps, c.tie_word_embeddings)


def test_a_config_of_sizes_only_gives_transformers_logits(tmp_path):
    """A config.json holding only the sizes: the absent fields mean Qwen2Config's defaults
    (rms_norm_eps 1e-6, rope_theta 10000) to transformers and to ms.hf alike."""
    d, ref = qwen2(tmp_path, rope_parameters=None, rms_norm_eps=1e-6)
    sizes = {k: v for k, v in SIZES.items() if k not in ("rope_parameters", "rms_norm_eps")}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(dict(sizes, architectures=["Qwen2ForCausalLM"], model_type="qwen2"), f)
    x = tokens(ref)
    back = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    want = hf_logits(back, x)
    model, params = ms.hf.load(d)
    assert (model.rope_theta, model.norm_eps, model.tied) == (1e4, 1e-6, False)
    assert_close(our_logits(model, params, x), want, what="qwen2 from its sizes alone")

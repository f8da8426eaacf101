"""ms.hf with GPT-2 (serial): load equals transformers' logits in float64, save loads back in
transformers bit for bit, sharded and prefix-less files, dtypes, and every refused input.

Run: `pytest -q tests/hf/test_hf_gpt2.py` (needs the hf extra: transformers, torch CPU).
"""
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import mpishard as ms
from conftest import assert_close
from hf_models import check_save_round_trip, edit_config, gpt2, hf_logits, our_logits, tokens

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("tied", [True, False])
def test_load_gives_transformers_logits(tmp_path, tied):
    d, ref = gpt2(tmp_path, tied=tied)
    model, params = ms.hf.load(d)
    assert model.kind == "gpt" and model.tied == tied and model.vocab_size == 97
    assert ("head/weights" in params) == (not tied)
    assert all(a.dtype == np.float64 and isinstance(a, np.ndarray) for a in params.values())
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x), what=f"gpt2 tied={tied}")


def test_n_inner_is_our_d_ff(tmp_path):
    d, ref = gpt2(tmp_path, n_inner=40)
    model, params = ms.hf.load(d)
    assert model.d_ff == 40
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x), what="gpt2 n_inner=40")


@pytest.mark.parametrize("tied", [True, False])
def test_save_loads_in_transformers_bit_for_bit(tmp_path, tied):
    cfg = check_save_round_trip(gpt2, tmp_path, tied)
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["tie_word_embeddings"]) == (0, 1, tied)
    assert cfg["architectures"] == ["GPT2LMHeadModel"] and cfg["dtype"] == "float64"


@pytest.mark.parametrize("dtype,np_dtype", [(torch.float32, np.float32),
                                            (torch.bfloat16, ml_dtypes.bfloat16)])
def test_round_trip_keeps_the_source_dtype(tmp_path, dtype, np_dtype):
    d, ref = gpt2(tmp_path / "src", dtype=dtype)
    model, params = ms.hf.load(d)
    assert {a.dtype for a in params.values()} == {np.dtype(np_dtype)}
    src = load_file(os.path.join(d, "model.safetensors"))
    # trained in float64 on the engine, then saved: cast back to the source dtype
    wide = {k: v.astype(np.float64) for k, v in params.items()}
    out = ms.hf.save(tmp_path / "out", model, wide)
    saved = load_file(os.path.join(out, "model.safetensors"))
    assert saved.keys() == src.keys() - {"lm_head.weight"}
    assert all(saved[k].dtype == np.dtype(np_dtype) and np.array_equal(
        saved[k].view(np.uint8), src[k].view(np.uint8)) for k in saved)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.dtype == dtype
    x = tokens(ref)
    assert np.array_equal(hf_logits(back, x), hf_logits(ref, x))


def test_a_spec_built_in_code_saves_float32_or_the_dtype_asked(tmp_path):
    model = ms.GPT(vocab_size=53, seq_len=8, d_model=16, n_heads=2, n_layers=1, tied=True)
    params = model.init(seed=3)
    out = ms.hf.save(tmp_path / "f32", model, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.dtype == torch.float32
    x = tokens(53, T=8)
    assert_close(hf_logits(back, x), our_logits(model, params, x), rtol=1e-5, what="float32")
    out = ms.hf.save(tmp_path / "f64", model, params, dtype="float64")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert_close(hf_logits(back, x), our_logits(model, params, x), what="float64 export")
    out = ms.hf.save(tmp_path / "bf16", model, params, dtype="bfloat16")
    _, p16 = ms.hf.load(out)
    want = params["embed/tokens"].astype(ml_dtypes.bfloat16)
    assert np.array_equal(p16["embed/tokens"].view(np.uint16), want.view(np.uint16))
    with pytest.raises(ValueError, match="dtype must be one of"):
        ms.hf.save(tmp_path / "bad", model, params, dtype="int8")


def test_sharded_files_with_an_index(tmp_path):
    d, ref = gpt2(tmp_path, max_shard_size="20KB")
    assert os.path.isfile(os.path.join(d, "model.safetensors.index.json"))
    assert len([f for f in os.listdir(d) if f.endswith(".safetensors")]) > 2
    model, params = ms.hf.load(d)
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x), what="gpt2 sharded")


def test_the_original_upload_layout(tmp_path):
    """The `gpt2` hub files: no `transformer.` prefix, and the causal-mask buffers; an old
    config's n_ctx where n_positions is absent."""
    d, ref = gpt2(tmp_path)
    edit_config(d, n_positions=None, n_ctx=16)
    f = os.path.join(d, "model.safetensors")
    tensors = {k.removeprefix("transformer."): v for k, v in load_file(f).items()}
    tensors["h.0.attn.bias"] = np.tril(np.ones((16, 16)))[None, None].astype(np.float64)
    tensors["h.1.attn.masked_bias"] = np.array(-1e4)
    save_file(tensors, f, metadata={"format": "pt"})
    model, params = ms.hf.load(d)
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x), what="prefix-less gpt2")


@pytest.mark.parametrize("fields,match", [
    ({"activation_function": "relu"}, "activation_function='relu'"),
    ({"layer_norm_epsilon": 1e-6}, "layer_norm_epsilon=1e-06"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx=True"),
    ({"reorder_and_upcast_attn": True}, "reorder_and_upcast_attn=True"),
    ({"scale_attn_weights": False}, "scale_attn_weights=False"),
    ({"add_cross_attention": True}, "add_cross_attention=True"),
    ({"architectures": ["BertForMaskedLM"]}, "architectures=\\['BertForMaskedLM'\\]"),
    ({"architectures": None, "model_type": "t5"}, "model_type='t5'"),
    ({"n_embd": "32"}, "n_embd must be an integer"),
])
def test_unsupported_config_fields_are_named(tmp_path, fields, match):
    d, _ = gpt2(tmp_path)
    edit_config(d, **fields)
    with pytest.raises(ValueError, match=match):
        ms.hf.load(d)
    with pytest.raises(ValueError, match=match):
        ms.hf.read_model(d)


def test_missing_unknown_and_mixed_tensors_are_refused(tmp_path):
    d, _ = gpt2(tmp_path)
    f = os.path.join(d, "model.safetensors")
    full = load_file(f)
    save_file({k: v for k, v in full.items() if k != "transformer.h.1.mlp.c_fc.bias"}, f,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="missing .*h.1.mlp.c_fc.bias"):
        ms.hf.load(d)
    save_file({**full, "transformer.h.0.attn.q_norm.weight": np.ones(8)}, f)
    with pytest.raises(ValueError, match="does not have .*q_norm"):
        ms.hf.load(d)
    save_file({**full, "transformer.ln_f.bias": full["transformer.ln_f.bias"].astype(
        np.float32)}, f)
    with pytest.raises(ValueError, match="several dtypes"):
        ms.hf.load(d)
    save_file({**full, "transformer.wpe.weight": full["transformer.wpe.weight"][:8]}, f)
    with pytest.raises(ValueError, match="embed/positions.*shape \\(8, 32\\)"):
        ms.hf.load(d)


def test_a_directory_without_safetensors_is_refused(tmp_path):
    d, _ = gpt2(tmp_path)
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(ValueError, match="neither model.safetensors nor"):
        ms.hf.load(d)
    with pytest.raises(ValueError, match="not a directory"):
        ms.hf.load(tmp_path / "nowhere")
    os.remove(os.path.join(d, "config.json"))
    with pytest.raises(ValueError, match="cannot read the model config"):
        ms.hf.load(d)


def test_save_refuses_other_models_and_wrong_params(tmp_path):
    with pytest.raises(ValueError, match="only GPT and Llama"):
        ms.hf.save(tmp_path, ms.MLP(dims=[4, 2]), ms.MLP(dims=[4, 2]).init())
    model = ms.GPT(vocab_size=11, seq_len=4, d_model=8, n_heads=2, n_layers=1)
    params = model.init()
    del params["ln_f/shift"]
    with pytest.raises(ValueError, match="missing \\['ln_f/shift'\\]"):
        ms.hf.save(tmp_path, model, params)


def test_load_into_hands_bfloat16_over_as_float32(tmp_path):
    """cupy has no bfloat16: load_into widens bfloat16 slices on the host (exactly) and still
    counts the bytes it read from the file."""
    d, _ = gpt2(tmp_path, dtype=torch.bfloat16)
    model = ms.hf.read_model(d)
    engine = ms.SingleDevice(model, dtype=np.float32)
    handed, load = set(), engine.load_checkpoint

    def hook(params):                # reads every tensor whole once more, while it is open
        handed.update((t.dtype, t[...].dtype) for t in params.values())
        load(params)
    engine.load_checkpoint = hook
    nbytes = ms.hf.load_into(engine, d)
    assert handed == {(np.dtype(np.float32), np.dtype(np.float32))}
    _, params = ms.hf.load(d)
    assert nbytes == 2 * sum(a.nbytes for a in params.values())     # 2 bytes an element
    got = engine.gather_params()
    assert all(np.array_equal(got[k], params[k].astype(np.float32)) for k in params)
    assert ms.hf.source(model)["dtype"] == "bfloat16"

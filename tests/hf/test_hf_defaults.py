"""A config.json that omits a field means what transformers makes of it: each architecture
reads an absent field with the default of its own transformers config class (GPT2Config,
LlamaConfig, MixtralConfig), never another's (a Mixtral without rope_theta or rms_norm_eps
rotates with 1e6 and normalises with 1e-5, MixtralConfig's, not Llama's 10000 and 1e-6).

Per architecture: a random-init float64 model built by transformers from its sizes alone
(everything else the class's default), saved, and its config.json rewritten to hold only the
size fields: ms.hf.load gives transformers' logits at rtol 1e-9 (float64 throughout; the
float32 steps of transformers' Llama/Mixtral run in float64 through hf_models.float64_llama),
and transformers itself reads the rewritten directory as the model it saved. And DEFAULTS of
each architecture module equal the installed transformers' class defaults, field by field.
"""
import json
import os

import pytest

import mpishard as ms
from conftest import assert_close
from mpishard.hf.convert import from_config
from mpishard.models.gpt import hf as gpt2
from mpishard.models.llama import hf as llama
from mpishard.models.llama import hf_mixtral as mixtral

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hf_models import (_perturbed, assert_same_logits, hf_logits, our_logits,  # noqa: E402
                       tokens)                                                # (needs torch)

# Only the sizes: vocabulary, width, MLP width, layers, heads, kv heads, experts and experts
# per token where they apply, positions.
SIZES = {
    "gpt2": dict(vocab_size=97, n_embd=32, n_inner=48, n_layer=2, n_head=4, n_positions=16),
    "llama": dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16),
    "mixtral": dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                    num_experts_per_tok=2, max_position_embeddings=16),
}
CLASSES = {"gpt2": ("GPT2Config", "GPT2LMHeadModel", gpt2),
           "llama": ("LlamaConfig", "LlamaForCausalLM", llama),
           "mixtral": ("MixtralConfig", "MixtralForCausalLM", mixtral)}


def _sizes_only(directory, kind):
    """A transformers `kind` model built from SIZES alone, saved to `directory`, whose
    config.json then keeps only the sizes (and the architecture): (directory, model)."""
    config_cls, model_cls, arch = (CLASSES[kind][0], CLASSES[kind][1], CLASSES[kind][2])
    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**SIZES[kind])
    model = _perturbed(getattr(transformers, model_cls)(cfg), 0)
    model.save_pretrained(str(directory))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(dict(SIZES[kind], architectures=[arch.ARCHITECTURE],
                       model_type=arch.MODEL_TYPE), f)
    return str(directory), model


@pytest.mark.parametrize("kind", sorted(SIZES))
def test_a_config_of_sizes_only_gives_transformers_logits(tmp_path, kind):
    d, ref = _sizes_only(tmp_path, kind)
    x = tokens(ref)
    want = hf_logits(ref, x)
    back = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
    assert_same_logits(hf_logits(back, x), want)     # transformers reads the sizes alone alike
    model, params = ms.hf.load(d)
    assert_close(our_logits(model, params, x), want, what=f"{kind} from its sizes alone")


def test_a_mixtral_takes_mixtrals_defaults_not_llamas(tmp_path):
    d, ref = _sizes_only(tmp_path, "mixtral")
    model = ms.hf.read_model(d)
    assert (model.rope_theta, model.norm_eps, model.tied) == (1e6, 1e-5, False)
    assert ref.config.rope_parameters["rope_theta"] == 1e6 and ref.config.rms_norm_eps == 1e-5


def _transformers_default(cls, name):
    """What an absent `name` means to a default-built transformers config `cls()`."""
    c = cls()
    if name == "rope_theta":
        return c.rope_parameters["rope_theta"]
    if name == "n_inner":                               # None: 4 x n_embd, in GPT2MLP
        return c.n_inner
    if name == "head_dim":                              # None or D / H: the same model
        return None if c.head_dim in (None, c.hidden_size // c.num_attention_heads) \
            else c.head_dim
    if name == "num_key_value_heads" and cls.__name__ == "LlamaConfig":
        assert c.num_key_value_heads == c.num_attention_heads
        return None                                     # None: as many as the heads
    return getattr(c, name)


@pytest.mark.parametrize("kind", sorted(SIZES))
def test_the_defaults_are_the_installed_transformers_ones(kind):
    cls = getattr(transformers, CLASSES[kind][0])
    arch = CLASSES[kind][2]
    lacking = {"attention_bias", "mlp_bias"} if kind == "mixtral" else set()
    for name, value in arch.DEFAULTS.items():
        if name in lacking:                             # MixtralConfig has none: no biases
            assert not hasattr(cls(), name)
            continue
        want = _transformers_default(cls, name)
        assert value == want and type(value) is type(want), (kind, name, value, want)
    assert not {"vocab_size", "tie_word_embeddings"} - set(arch.DEFAULTS)


@pytest.mark.parametrize("kind", sorted(SIZES))
def test_an_empty_config_is_the_default_model(kind):
    """Even the sizes default: the spec read from {architectures} alone is the one the class's
    defaults describe (checked on the spec; no tensors at that size are built)."""
    cls = getattr(transformers, CLASSES[kind][0])
    arch = CLASSES[kind][2]
    c = cls()
    model = from_config({"architectures": [arch.ARCHITECTURE]})
    if kind == "gpt2":
        assert (model.vocab_size, model.seq_len, model.d_model, model.n_layers, model.n_heads,
                model.d_ff, model.tied) == (c.vocab_size, c.n_positions, c.n_embd, c.n_layer,
                                            c.n_head, 4 * c.n_embd, c.tie_word_embeddings)
        return
    assert (model.vocab_size, model.seq_len, model.d_model, model.n_layers, model.n_heads,
            model.n_kv_heads, model.d_ff, model.rope_theta, model.norm_eps, model.tied) == (
        c.vocab_size, c.max_position_embeddings, c.hidden_size, c.num_hidden_layers,
        c.num_attention_heads, c.num_key_value_heads, c.intermediate_size,
        c.rope_parameters["rope_theta"], c.rms_norm_eps, c.tie_word_embeddings)
    if kind == "mixtral":
        assert (model.n_experts, model.top_k, model.router_aux_loss_coef) == (
            c.num_local_experts, c.num_experts_per_tok, 0.0)
    # null kv heads: as many as the heads (LlamaConfig's rule; MixtralConfig's strict field
    # refuses a null, mpishard reads it as Llama does)
    nulled = from_config({"architectures": [arch.ARCHITECTURE],
                          "num_key_value_heads": None})
    assert nulled.n_kv_heads == c.num_attention_heads == 32
    if kind == "llama":
        assert cls(num_key_value_heads=None).num_key_value_heads == 32

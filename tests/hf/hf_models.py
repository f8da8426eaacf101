"""Reference models for tests/hf: small random-init transformers models, saved to a directory.

Each builder makes the same float64 model on every rank for a seed (torch's generator), with
an odd vocabulary and norm weights (and biases) pushed away from 1 and 0 so a swapped or
untransposed tensor cannot pass, saves it with `save_pretrained` and returns (directory, the
torch model in eval mode). `hf_logits` runs it on token ids; no internet is needed anywhere.
"""
import json
import os
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

GPT2_SIZES = dict(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4)
LLAMA_SIZES = dict(vocab_size=97, max_position_embeddings=16, hidden_size=32,
                   intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, rope_theta=500.0, rms_norm_eps=1e-6)
MIXTRAL_SIZES = dict(LLAMA_SIZES, num_local_experts=4, num_experts_per_tok=2)
NORMS = ("ln_", "layernorm", "norm.")


def _perturbed(model, seed):
    """`model` in float64, eval mode, every norm weight/bias moved by N(0, 0.3)."""
    torch.manual_seed(seed + 1)
    model = model.double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(k in name for k in NORMS):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def gpt2(directory, tied=True, **kw):
    """A GPT2LMHeadModel saved under `directory`: (directory, model)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    return _build(GPT2Config, GPT2LMHeadModel, GPT2_SIZES, directory, tied, **kw)


def llama(directory, tied=False, **kw):
    """A LlamaForCausalLM (GQA: 2 kv heads for 4) saved under `directory`: (directory, model)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    return _build(LlamaConfig, LlamaForCausalLM, LLAMA_SIZES, directory, tied, **kw)


def mixtral(directory, tied=False, fused=False, **kw):
    """A MixtralForCausalLM (GQA, 4 experts, top-2) saved under `directory`, in the per-expert
    layout save_pretrained writes, or (fused) rewritten in transformers' fused in-memory one:
    (directory, model)."""
    from transformers import MixtralConfig, MixtralForCausalLM

    d, model = _build(MixtralConfig, MixtralForCausalLM, MIXTRAL_SIZES, directory, tied, **kw)
    if fused:
        _fuse(d, model.config.num_hidden_layers, model.config.num_local_experts)
    return d, model


def _fuse(directory, n_layers, n_experts):
    """Rewrite directory's per-expert Mixtral tensors as the fused mlp.experts layout."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(directory, "model.safetensors")
    t = load_file(path)
    for i in range(n_layers):
        old, new = f"model.layers.{i}.block_sparse_moe", f"model.layers.{i}.mlp"
        w = {n: [t.pop(f"{old}.experts.{j}.{n}.weight") for j in range(n_experts)]
             for n in ("w1", "w2", "w3")}
        t[f"{new}.gate.weight"] = t.pop(f"{old}.gate.weight")
        t[f"{new}.experts.gate_up_proj"] = np.stack(
            [np.concatenate([a, b]) for a, b in zip(w["w1"], w["w3"])])
        t[f"{new}.experts.down_proj"] = np.stack(w["w2"])
    save_file(t, path, metadata={"format": "pt"})


def _build(config_cls, model_cls, defaults, directory, tied, seed=0, dtype=torch.float64,
           max_shard_size=None, **sizes):
    torch.manual_seed(seed)
    cfg = config_cls(**{**defaults, **sizes}, tie_word_embeddings=tied, bos_token_id=0,
                     eos_token_id=1)
    model = _perturbed(model_cls(cfg), seed).to(dtype)
    return _save(model, directory, max_shard_size), model


def _save(model, directory, max_shard_size):
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(str(directory), **kwargs)
    return str(directory)


def same_weights(a, b) -> bool:
    """Two torch modules hold the same tensors, bit for bit, under the same names."""
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sb)


def assert_same_logits(got, want) -> None:
    """Logits of two torch models of the same weights (same_weights) agree to float64 rounding:
    on an AMD EPYC host two instances of one set of weights differ in the last bit (1.8e-16
    of the largest logit; torch's CPU kernels pick their paths by where a tensor lies), so
    bitwise equality of logits is not theirs to promise; the weights' is (same_weights)."""
    assert got.shape == want.shape
    assert np.abs(got - want).max() <= 1e-14 * np.abs(want).max(), \
        np.abs(got - want).max() / np.abs(want).max()


def hf_logits(model, x) -> np.ndarray:
    """transformers' logits of token ids `x` (B, T), as float64 numpy. A float64 Llama, Qwen2
    or Mixtral runs with float64_llama: its float32 steps in float64."""
    with torch.no_grad(), float64_llama(model):
        return model(torch.as_tensor(np.asarray(x))).logits.double().numpy()


@contextmanager
def float64_llama(model):
    """transformers' LlamaForCausalLM takes three steps in float32 whatever the model's dtype:
    the rotary angles, RMSNorm (it casts its input to float32) and the eager softmax. For a
    float64 model they run in float64 here (the same math, rounded like the rest); sdpa
    attention keeps the model's dtype. A Qwen2ForCausalLM has the same three; a
    MixtralForCausalLM has them and float64_moe's. Other models and dtypes run as they are."""
    kind = type(model).__name__
    if kind not in ("LlamaForCausalLM", "MixtralForCausalLM", "Qwen2ForCausalLM") or \
            model.dtype != torch.float64:
        yield
        return
    cfg, rotary = model.config, model.model.rotary_emb
    norm_cls, forward = type(model.model.norm), type(model.model.norm).forward
    dh = cfg.hidden_size // cfg.num_attention_heads
    theta = (cfg.rope_parameters or {}).get("rope_theta", getattr(cfg, "rope_theta", None))

    def rope64(x, position_ids):
        inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
        emb = torch.cat([position_ids[..., None].double() * inv] * 2, -1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)

    def rms64(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))
    attn = cfg._attn_implementation
    rotary.forward, norm_cls.forward = rope64, rms64
    model.set_attn_implementation("sdpa")
    try:
        with float64_moe(model) if kind == "MixtralForCausalLM" else nullcontext():
            yield
    finally:
        del rotary.forward
        norm_cls.forward = forward
        model.set_attn_implementation(attn)


@contextmanager
def float64_moe(model):
    """A float64 Mixtral's own float32 steps in float64: the router's softmax, and the
    load-balancing loss's sums (load_balancing_loss_func: the same reductions, float64);
    the eager experts (the default grouped_mm takes no float64)."""
    from transformers.models.mixtral import modeling_mixtral as M

    def router64(self, x):
        logits = torch.nn.functional.linear(x.reshape(-1, self.hidden_dim), self.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), self.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index

    def aux64(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        assert attention_mask is None, "float64_moe: no attention mask"
        probs = torch.softmax(torch.cat(gate_logits, 0), dim=-1)       # (layers x tokens, E)
        chosen = torch.topk(probs, top_k, dim=-1).indices
        counts = torch.nn.functional.one_hot(chosen, num_experts).double().sum((0, 1))
        n = probs.shape[0]
        return num_experts * torch.sum(counts / n * probs.sum(0) / n)

    patches = [(M.MixtralTopKRouter, "forward", router64), (M, "load_balancing_loss_func", aux64)]
    old = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    experts = model.config._experts_implementation
    for obj, name, new in patches:
        setattr(obj, name, new)
    model.set_experts_implementation("eager")
    try:
        yield
    finally:
        for obj, name, f in old:
            setattr(obj, name, f)
        model.set_experts_implementation(experts)


def our_logits(model, params, x) -> np.ndarray:
    """mpishard's single-device float64 logits of `params` (any float dtype) on ids `x`."""
    import mpishard as ms

    engine = ms.SingleDevice(model)
    engine.load_checkpoint({k: np.asarray(v, dtype=np.float64) for k, v in params.items()})
    return engine.predict(x)


def check_save_round_trip(build, tmp_path, tied) -> dict:
    """build -> ms.hf.load -> ms.hf.save -> transformers' from_pretrained: the same class and
    dtype, identical logits; ms.hf.load of the saved directory: the same spec and bits.
    Returns the saved config.json."""
    import mpishard as ms
    from transformers import AutoModelForCausalLM

    d, ref = build(tmp_path / "src", tied=tied)
    model, params = ms.hf.load(d)
    out = ms.hf.save(tmp_path / "out", model, params)
    back = AutoModelForCausalLM.from_pretrained(out).eval()
    assert back.dtype == torch.float64 and type(back) is type(ref)
    assert same_weights(back, ref)                   # transformers reads back the same bits
    x = tokens(ref)
    assert_same_logits(hf_logits(back, x), hf_logits(ref, x))
    again, params2 = ms.hf.load(out)                  # save -> load: bit-exact
    assert repr(again) == repr(model) and params2.keys() == params.keys()
    assert all(np.array_equal(params2[k], params[k]) for k in params)
    with open(os.path.join(out, "config.json")) as f:
        return json.load(f)


def edit_config(directory, **fields):
    """Overwrite fields of directory/config.json."""
    path = os.path.join(directory, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(path, "w") as f:
        json.dump(cfg, f)


def tokens(model_or_vocab, rows=3, T=11, seed=5) -> np.ndarray:
    vocab = getattr(getattr(model_or_vocab, "config", None), "vocab_size", model_or_vocab)
    return np.random.default_rng(seed).integers(0, vocab, (rows, T))

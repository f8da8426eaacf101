"""Reference models for tests/hf: small random-init transformers models, saved to a directory.

Each builder makes the same float64 model on every rank for a seed (torch's generator), with
an odd vocabulary and norm weights (and biases) pushed away from 1 and 0 so a swapped or
untransposed tensor cannot pass, saves it with `save_pretrained` and returns (directory, the
torch model in eval mode). `hf_logits` runs it on token ids; no internet is needed anywhere.
"""
import numpy as np
import torch

GPT2_SIZES = dict(vocab_size=97, n_positions=16, n_embd=32, n_layer=2, n_head=4)
LLAMA_SIZES = dict(vocab_size=97, max_position_embeddings=16, hidden_size=32,
                   intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, rope_theta=500.0, rms_norm_eps=1e-6)
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


def hf_logits(model, x) -> np.ndarray:
    """transformers' logits of token ids `x` (B, T), as float64 numpy."""
    with torch.no_grad():
        return model(torch.as_tensor(np.asarray(x))).logits.double().numpy()


def tokens(model_or_vocab, rows=3, T=11, seed=5) -> np.ndarray:
    vocab = getattr(getattr(model_or_vocab, "config", None), "vocab_size", model_or_vocab)
    return np.random.default_rng(seed).integers(0, vocab, (rows, T))

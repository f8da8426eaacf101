"""Hugging Face models in and out: GPT-2, Llama and Mixtral directories as ms.GPT / ms.Llama.

    model, params = ms.hf.load("gpt2")          # spec + full params (our names, file dtype)
    model = ms.hf.read_model("gpt2")            # the spec alone (config.json, tensor headers)
    engine = ms.make_engine(model, "tp=2,pp=2")
    nbytes = ms.hf.load_into(engine, "gpt2")    # collective: each rank reads only its slices
    ms.hf.save("out", model, engine.gather_params(), dtype="bfloat16")
    tok = ms.hf.tokenizer("gpt2")               # tokenizers.Tokenizer or None
    ms.hf.source(model)       # {"config", "dtype"} it was read from (JSON), for a checkpoint

A directory is `config.json` plus `model.safetensors`, or shards named by
`model.safetensors.index.json`; tensors are read with the safetensors library's numpy API
(never pickle or torch.load). Supported: `GPT2LMHeadModel` (gpt2.py), `LlamaForCausalLM`
(llama.py) and `MixtralForCausalLM` (mixtral.py: ms.Llama with n_experts); another
architecture, or a config field whose math mpishard lacks, raises ValueError naming it.
Each architecture keeps one name map used by every direction:
  files.py      the directory, lazily sliced safetensors (byte counting)
  fields.py     strict config.json reading
  gpt2.py       GPT-2's fields and name map
  llama.py      Llama's fields and name map
  mixtral.py    Mixtral's (Llama's plus the experts, per-expert and fused layouts)
  convert.py    read_model, load, load_into, save
  tokenizer.py  tokenizer.json
Layering: above the engine, beside train and checkpoint (it uses checkpoint's helpers), below
cli. `transformers` is never imported here (only the tests compare against it); `tokenizers` is
imported only by `tokenizer()`, `safetensors` only when a directory is read or written.
"""
from .convert import ARCHITECTURES, load, load_into, read_model, save, set_source, source
from .tokenizer import tokenizer

__all__ = ["load", "load_into", "save", "read_model", "tokenizer", "source", "set_source",
           "ARCHITECTURES"]

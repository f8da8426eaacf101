"""Hugging Face models in and out: a registered architecture's directories as its spec.

    model, params = ms.hf.load("gpt2")          # spec + full params (our names, file dtype)
    model = ms.hf.read_model("gpt2")            # the spec alone (config.json, tensor headers)
    engine = ms.make_engine(model, "tp=2,pp=2")
    nbytes = ms.hf.load_into(engine, "gpt2")    # collective: each rank reads only its slices
    ms.hf.save("out", model, engine.gather_params(), dtype="bfloat16")
    tok = ms.hf.tokenizer("gpt2")               # tokenizers.Tokenizer or None
    ms.hf.source(model)       # {"config", "dtype"} it was read from (JSON), for a checkpoint

A directory is `config.json` plus `model.safetensors`, or shards named by
`model.safetensors.index.json`; tensors are read with the safetensors library's numpy API
(never pickle or torch.load). Supported: the architectures of the registry's specs
(models.ARCHITECTURES): each spec's `hf_maps()` names its transformers architectures, whose
name maps live in its folder (models/<name>/hf*.py), and ARCHITECTURES here maps each name
to its map; another architecture, or a config field whose math mpishard lacks,
raises ValueError naming it. Each architecture keeps one name map (built from hfmap/'s field
readers and lazy views) used by every direction:
  files.py      the directory, lazily sliced safetensors (byte counting)
  convert.py    read_model, load, load_into, save
  tokenizer.py  tokenizer.json
Layering: above the engine and models/, beside train and checkpoint (it uses checkpoint's
helpers), below cli. `transformers` is never imported here (only the tests compare against
it); `tokenizers` is imported only by `tokenizer()`, `safetensors` only when a directory is
read or written.
"""
from .convert import ARCHITECTURES, load, load_into, read_model, save, set_source, source
from .tokenizer import tokenizer

__all__ = ["load", "load_into", "save", "read_model", "tokenizer", "source", "set_source",
           "ARCHITECTURES"]

"""safetensors interop: one consolidated file, and PyTorch's nn.Sequential layout.

    ms.checkpoint.export_safetensors("ckpt", "model.safetensors")      # or a full param dict
    ms.checkpoint.export_safetensors(engine.gather_params(), "t.safetensors", names="torch")
    params = ms.checkpoint.import_safetensors("torch_mlp.safetensors", model)

Name map between mpishard and a PyTorch `nn.Sequential` of `nn.Linear` (+ activations):

    nn.Sequential(Linear(784, 512), ReLU(), Linear(512, 10))
    '0.weight' (512, 784)  <->  'layer_0/weights' (784, 512)    transposed: torch is (out, in)
    '0.bias'   (512,)      <->  'layer_0/bias'    (512,)
    '2.weight' (10, 512)   <->  'layer_1/weights' (512, 10)

The Linear modules, in the order of their numeric index, are layer_0, layer_1, ...; modules
without a 2-D `weight` (activations) are skipped, so any numbering works on import. A common
prefix ('net.0.weight', 'model.layers.0.weight') is allowed. On export with names="torch" the
module index of layer i counts one module per Linear and one per activation other than
identity before it (the nn.Sequential a user would write for the same MLP).
"""
from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping

import numpy as np

from .format import model_spec
from .reader import load

_TORCH_KEY = re.compile(r"^(?P<prefix>.*?)(?P<idx>\d+)\.(?P<kind>weight|bias)$")
_OURS_KEY = re.compile(r"^layer_\d+/(weights|bias)$")


def torch_name_map(tensors: Mapping) -> dict:
    """{torch key: mpishard name} for the Linear weights/biases among `tensors` (name->array)."""
    linear = {}
    for key, a in tensors.items():
        m = _TORCH_KEY.match(key)
        if m and m["kind"] == "weight" and np.ndim(a) == 2:
            linear[(m["prefix"], int(m["idx"]))] = key
    if len({p for p, _ in linear}) > 1:
        raise ValueError(f"safetensors keys have several prefixes {sorted({p for p, _ in linear})}")
    out = {}
    for i, (prefix, idx) in enumerate(sorted(linear)):
        out[f"{prefix}{idx}.weight"] = f"layer_{i}/weights"
        if f"{prefix}{idx}.bias" in tensors:
            out[f"{prefix}{idx}.bias"] = f"layer_{i}/bias"
    return out


def _torch_indices(model, n_layers) -> list:
    if model is None:
        return [2 * i for i in range(n_layers)]
    out, k = [], 0
    for spec in model.layers():
        out.append(k)
        k += 1 + (spec.activation != "identity")
    return out


def export_safetensors(path_or_params, out_file, names: str = "mpishard", model=None) -> str:
    """Write one consolidated safetensors file from a checkpoint directory or a full dict
    (e.g. engine.gather_params()). names="torch" writes the nn.Sequential layout above."""
    from safetensors.numpy import save_file

    if names not in ("mpishard", "torch"):
        raise ValueError(f"names must be 'mpishard' or 'torch', got {names!r}")
    meta = {"format": "mpishard"}
    if isinstance(path_or_params, (str, os.PathLike)):
        ckpt = load(path_or_params)
        params = {k: np.asarray(v) for k, v in ckpt.items()}
        model = model or ckpt.model()
        meta["model"] = json.dumps(ckpt.model_spec)
    else:
        params = {k: (v.get() if hasattr(v, "get") and not isinstance(v, np.ndarray)
                      else np.asarray(v)) for k, v in path_or_params.items()}
    if model is not None:
        meta["model"] = json.dumps(model_spec(model))
    if names == "torch":
        n = len([k for k in params if k.endswith("/weights")])
        idx = _torch_indices(model, n)
        out = {}
        for k, v in params.items():
            i, kind = int(k.split("/")[0][6:]), k.split("/")[1]
            out[f"{idx[i]}.{'weight' if kind == 'weights' else 'bias'}"] = \
                np.ascontiguousarray(v.T if kind == "weights" else v)
        params, meta["format"] = out, "pt"
    tmp = f"{out_file}.tmp"
    save_file({k: np.ascontiguousarray(v) for k, v in params.items()}, tmp, metadata=meta)
    os.replace(tmp, out_file)
    return os.fspath(out_file)


def import_safetensors(file, model=None) -> dict:
    """Full parameter dict from a safetensors file written by export_safetensors or by
    PyTorch (`safetensors.torch.save_file(nn.Sequential(...).state_dict(), file)`; weights
    transposed through the name map above). `model=` checks names and shapes."""
    from safetensors.numpy import load_file

    tensors = load_file(os.fspath(file))
    if tensors and all(_OURS_KEY.match(k) for k in tensors):
        params = tensors
    else:
        mapping = torch_name_map(tensors)
        if not mapping:
            raise ValueError(f"{file}: neither mpishard names (layer_0/weights) nor an "
                             f"nn.Sequential of Linear ('0.weight'); keys {sorted(tensors)[:8]}")
        params = {ours: np.ascontiguousarray(tensors[k].T if ours.endswith("/weights")
                                             else tensors[k]) for k, ours in mapping.items()}
    if model is not None:
        model.check_params(params)
    return params

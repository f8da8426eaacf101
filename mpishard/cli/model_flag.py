"""`--model` of `plan` and `inspect --layout`: an MLP's dims or a GPT's sizes, no MPI.

    --model 784,512,256,10                                   ms.MLP (with --activation, --no-bias)
    --model gpt:d_model=64,n_heads=4,n_layers=2,seq_len=32,vocab=256      ms.GPT

GPT keys: vocab (vocab_size), seq_len, d_model, n_heads, n_layers, d_ff, tied (0/1); a key
left out takes its value from GPT_DEFAULTS. The plan costs full-length sequences (T = seq_len)
and counts a batch row as one sequence.
"""
from __future__ import annotations

from ..nn.gpt import GPT
from ..nn.models import MLP
from .usage import UsageError, parse_dims

GPT_DEFAULTS = {"vocab": 256, "seq_len": 64, "d_model": 128, "n_heads": 4, "n_layers": 4,
                "d_ff": None, "tied": 0}
GPT_PREFIX = "gpt:"


def model_from_flag(text, activation: str = "relu", bias: bool = True):
    """The model spec `--model` names (UsageError for a malformed flag, ValueError for sizes
    the model refuses)."""
    text = str(text).strip()
    if text == "gpt" or text.startswith(GPT_PREFIX):
        return gpt_from_flag(text[len(GPT_PREFIX):] if text != "gpt" else "")
    return MLP(parse_dims(text), activation=activation, bias=bias)


def gpt_from_flag(body: str) -> GPT:
    """'d_model=64,n_heads=4,...' -> ms.GPT over GPT_DEFAULTS."""
    sizes, given = dict(GPT_DEFAULTS), set()
    for item in filter(None, (s.strip() for s in body.split(","))):
        key, eq, value = (s.strip() for s in item.partition("="))
        key = "vocab" if key == "vocab_size" else key
        if not eq or key not in GPT_DEFAULTS or key in given:
            raise UsageError(f"--model gpt:{body}: expected distinct KEY=VALUE pairs with keys "
                             f"{', '.join(GPT_DEFAULTS)}; got {item!r}")
        given.add(key)
        try:
            sizes[key] = int(value)
        except ValueError:
            raise UsageError(f"--model gpt:{body}: {key}={value!r} is not an integer") from None
    if sizes["tied"] not in (0, 1):
        raise UsageError(f"--model gpt:{body}: tied must be 0 or 1, got {sizes['tied']}")
    return GPT(vocab_size=sizes["vocab"], seq_len=sizes["seq_len"], d_model=sizes["d_model"],
               n_heads=sizes["n_heads"], n_layers=sizes["n_layers"], d_ff=sizes["d_ff"],
               tied=bool(sizes["tied"]))

"""`--model` (and `--gpt`) of every command: an MLP's dims or a language model's sizes, no MPI.

    --model 784,512,256,10                                   ms.MLP (with --activation, --no-bias)
    --model gpt:d_model=64,n_heads=4,n_layers=2,seq_len=32   ms.GPT
    --model gpt --gpt d_model=64,n_heads=4,n_layers=2,seq_len=32     the same GPT
    --model llama:d_model=64,n_heads=4,n_kv_heads=2,n_layers=2,seq_len=32    ms.Llama

Both GPT spellings work in every command (train, plan, inspect, bench); keys given in both
places must not repeat. GPT keys: vocab (or vocab_size), seq_len, d_model, n_heads, n_layers,
d_ff (default 4 d_model), tied (0/1); a key left out takes its value from GPT.flag_defaults. A
Llama (`llama:KEY=VALUE,...`) takes the same keys and n_kv_heads (default n_heads),
rope_theta and norm_eps (numbers; Llama.flag_defaults), and for a mixture of experts (Mixtral)
n_experts, top_k (default 2), capacity_factor and router_aux_loss_coef (numbers). Each
architecture's spec gives its keys, their defaults and types (models/interface.py), the
registry (models.ARCHITECTURES) maps KIND to it, and any other --model text is an MLP's
dims. `train` takes its vocabulary from the data set (256 bytes) and refuses a vocab key.
The plan costs full-length sequences (T = seq_len) and counts a batch row as one sequence.

plan and inspect also take `--hf DIR` instead: the model (of any architecture hf.ARCHITECTURES
names) that DIR's config.json describes, as train's --init-from-hf reads it, but from
config.json alone (no weights read: a model can be planned before its weights are downloaded).

`train --resume` without --model takes these flags from the checkpoint's model spec
(`checkpoint_model_flags`); a --model that builds another model is refused naming both
(`check_resumed_model`).
"""
from __future__ import annotations

import inspect
import json
import os

from ..checkpoint import CheckpointError, model_spec, read_index
from ..checkpoint.format import model_from_spec, spec_text
from ..hf.convert import ARCHITECTURES as HF_ARCHITECTURES, from_config
from ..hf.files import CONFIG
from ..models.mlp.spec import MLP
from .cluster_options import AUTO
from .usage import KEYED, UsageError, check_directory, parse_dims

GPT_DEFAULTS = KEYED["gpt"].flag_defaults
# The registry's keyed kinds and their keys, and the Hugging Face architectures: the help texts
# list them, so a new architecture needs no CLI edit.
KEYED_HELP = ("a language model, KIND:KEY=VALUE,... (KIND --gpt KEY=VALUE,... is the same) "
              "with KIND and its keys: " + "; ".join(f"{kind}: {', '.join(cls.flag_defaults)}"
                                                     for kind, cls in KEYED.items()))
HF_NAMES = ", ".join(HF_ARCHITECTURES)
GPT_FLAG_HELP = "comma-separated MLP dims, e.g. 64,256,256,10, or " + KEYED_HELP


def split_model_flag(model):
    """(kind, KEY=VALUE text) of `--model KIND` or `--model KIND:KEY=VALUE,...` for a keyed
    architecture (KEYED), or None for an MLP's dims."""
    kind, colon, keys = str(model).strip().partition(":")
    return (kind, keys if colon else "") if kind in KEYED else None


def keys_flag(model, gpt=None) -> str:
    """The flag(s) the KEY=VALUE text of joined_model_spec came from, for its messages."""
    split = split_model_flag(model)
    keys = split is not None and split[1].strip()
    return "--model" if not (gpt or "").strip() else "--model/--gpt" if keys else "--gpt"


def joined_model_spec(model, gpt=None):
    """(kind, the KEY=VALUE text that --model and --gpt give together: '' for the defaults),
    or None when --model names an MLP (UsageError if --gpt came with one)."""
    split = split_model_flag(model)
    if split is None:
        if gpt is not None:
            raise UsageError(f"--gpt applies to --model gpt, not --model {model}")
        return None
    kind, keys = split
    return kind, ",".join(p for p in (keys, gpt or "") if p.strip())


def parse_gpt_spec(text, defaults=None, types=None, flag="--gpt") -> dict:
    """'d_model=64,n_heads=4,...' -> {key: value} over `defaults` (a spec's flag_defaults,
    GPT's by default; `types` its flag_types): UsageError for an unknown or repeated key, a
    missing '=', a value that is not a positive integer ("number": a positive number,
    "weight": a number >= 0, "switch": 0 or 1). The key vocab_size is read as vocab; `flag`
    (the flag the text came from) labels the messages."""
    defaults = GPT_DEFAULTS if defaults is None else defaults
    types = KEYED["gpt"].flag_types if types is None else types
    spec, given = dict(defaults), set()
    for item in ([] if text is None else str(text).split(",")):
        if not item.strip():
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        key = "vocab" if key == "vocab_size" else key
        if not eq:
            raise UsageError(f"{flag} {text!r}: expected KEY=VALUE pairs joined by commas, "
                             f"e.g. d_model=128,n_heads=4, got {item!r}")
        if key not in defaults:
            raise UsageError(f"{flag}: unknown key {key!r}; known keys: {', '.join(defaults)}")
        if key in given:
            raise UsageError(f"{flag}: {key} is given twice")
        given.add(key)
        spec[key] = _flag_value(key, value, types.get(key, "integer"), flag)
    return spec


def _flag_value(key, value, flag_type, flag):
    """One KEY=VALUE's value of `flag_type` (parse_gpt_spec), or UsageError."""
    real = flag_type in ("number", "weight")
    try:
        number = float(value) if real else int(value)
    except ValueError:
        raise UsageError(f"{flag}: {key}={value!r} is not "
                         f"{'a number' if real else 'an integer'}") from None
    if flag_type == "switch" and number not in (0, 1):
        raise UsageError(f"{flag}: {key} must be 0 or 1, got {value}")
    if flag_type == "weight" and number < 0:
        raise UsageError(f"{flag}: {key} must be a number >= 0, got {value}")
    if flag_type in ("number", "integer") and (number <= 0 if real else number < 1):
        raise UsageError(f"{flag}: {key} must be a positive "
                         f"{'number' if real else 'integer'}, got {value}")
    return number


def keyed_model(kind, text, flag="--gpt"):
    """The spec of architecture `kind` (KEYED) from its KEY=VALUE `text` (from `flag`)."""
    cls = KEYED[kind]
    return cls.from_flag(parse_gpt_spec(text, cls.flag_defaults, cls.flag_types, flag))


def with_vocab(spec, vocab_size: int):
    """The same decoder spec with another vocabulary (a data set's)."""
    kw = {k: v for k, v in vars(spec).items()
          if k in inspect.signature(type(spec)).parameters}
    return type(spec)(**{**kw, "vocab_size": vocab_size})


def model_from_flag(text, activation: str = "relu", bias: bool = True, gpt=None):
    """The model spec `--model` (and `--gpt`) name (UsageError for a malformed flag,
    ValueError for sizes the model refuses)."""
    joined = joined_model_spec(text, gpt)
    if joined is not None:
        return keyed_model(*joined, keys_flag(text, gpt))
    return MLP(parse_dims(text), activation=activation, bias=bias)


def spec_flags(spec: dict):
    """The train flags that rebuild a checkpoint's model spec (index.json's "model"): the
    rebuilt spec's flag_args ({"model": dims, "activation": ...} for an ms.MLP, {"model":
    "KIND:KEY=VALUE,..."} for a decoder, no vocab: train takes it from the data); None for a
    model no flag names (ms.MoE, an MLP without bias) or a spec that does not rebuild."""
    model = model_from_spec(spec)
    return None if model is None else model.flag_args()


def checkpoint_model_flags(path):
    """spec_flags of the checkpoint at `path` (a retention directory: its newest), or None
    when there is none to read: the run's own checks then say why."""
    if path is None:
        return None
    try:
        spec = read_index(path).get("model")
    except (CheckpointError, OSError, ValueError):
        return None
    return spec_flags(spec) if isinstance(spec, dict) else None


def resumed_model_flags(resume, checkpoint_dir):
    """checkpoint_model_flags of the checkpoint that train's --resume continues from: True
    (bare) and auto mean --checkpoint-dir's, any other text is its PATH."""
    return checkpoint_model_flags(checkpoint_dir if resume in (True, AUTO) else resume)


def check_resumed_model(model, path, flag: str) -> None:
    """UsageError unless `model` (built from `flag`, the user's --model) is the model of the
    checkpoint at `path` that the run resumes, naming both."""
    try:
        saved = read_index(path).get("model")
    except (CheckpointError, OSError, ValueError) as exc:
        raise UsageError(f"--resume: {exc}") from None
    ours = model_spec(model)
    if isinstance(saved, dict) and saved != ours:
        raise UsageError(f"--model {flag} builds {spec_text(ours)}, but the checkpoint {path} "
                         f"holds {spec_text(saved)}; leave out --model to take the "
                         f"checkpoint's")


def model_from_hf(path):
    """The model spec of Hugging Face directory `path`'s config.json, by the rules of
    ms.hf.read_model (the same architectures and fields), without reading its weights."""
    check_directory("--hf", path)
    try:
        with open(os.path.join(path, CONFIG), encoding="utf-8") as f:
            config = json.load(f)
        if not isinstance(config, dict):
            raise ValueError(f"{CONFIG} is not a JSON object")
        return from_config(config)
    except (OSError, ValueError, TypeError) as exc:
        raise UsageError(f"--hf {path}: {exc}") from None


def model_from_args(args, command: str):
    """The model of plan's and inspect's --model/--gpt (model_from_flag) or --hf DIR
    (model_from_hf): exactly one of them; UsageError naming `command` otherwise."""
    hf = getattr(args, "hf", None)
    if (hf is None) == (args.model is None):
        raise UsageError(f"{command}: give --model DIMS|{'|'.join(k + ':...' for k in KEYED)} "
                         f"or --hf DIR"
                         + (", not both" if hf is not None else ""))
    if hf is not None and args.gpt is not None:
        raise UsageError(f"{command}: --gpt applies to --model gpt, not to --hf {hf}")
    try:
        if hf is not None:
            return model_from_hf(hf)
        return model_from_flag(args.model, args.activation, bias=not args.no_bias,
                               gpt=args.gpt)
    except (ValueError, TypeError) as exc:
        raise UsageError(f"{command}: {exc}") from None


def add_model_arguments(p, required=True, hf=False):
    """--model and --gpt on parser `p` (plan, inspect, bench); `hf`: also --hf DIR (plan,
    inspect), which makes --model optional (model_from_args wants one of them)."""
    p.add_argument("--model", required=required and not hf, help=GPT_FLAG_HELP)
    p.add_argument("--gpt", metavar="KEY=VALUE,...", help="with --model gpt: the GPT's sizes, "
                   "the same keys as gpt:KEY=VALUE,...")
    if hf:
        p.add_argument("--hf", metavar="DIR", help="instead of --model: the model of a Hugging "
                       f"Face directory's config.json ({HF_NAMES}; no weights read)")

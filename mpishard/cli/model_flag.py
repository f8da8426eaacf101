"""`--model` (and `--gpt`) of every command: an MLP's dims or a GPT's sizes, no MPI.

    --model 784,512,256,10                                   ms.MLP (with --activation, --no-bias)
    --model gpt:d_model=64,n_heads=4,n_layers=2,seq_len=32   ms.GPT
    --model gpt --gpt d_model=64,n_heads=4,n_layers=2,seq_len=32     the same GPT
    --model llama:d_model=64,n_heads=4,n_kv_heads=2,n_layers=2,seq_len=32    ms.Llama

Both GPT spellings work in every command (train, plan, inspect, bench); keys given in both
places must not repeat. GPT keys: vocab (or vocab_size), seq_len, d_model, n_heads, n_layers,
d_ff (default 4 d_model), tied (0/1); a key left out takes its value from GPT_DEFAULTS. A
Llama (`llama:KEY=VALUE,...`) takes the same keys and n_kv_heads (default n_heads),
rope_theta and norm_eps (numbers; LLAMA_DEFAULTS), and for a mixture of experts (Mixtral)
n_experts, top_k (default 2), capacity_factor and router_aux_loss_coef (numbers). `train`
takes its vocabulary from the data set (256 bytes) and refuses a vocab key. The plan costs
full-length sequences (T = seq_len) and counts a batch row as one sequence.

plan and inspect also take `--hf DIR` instead: the GPT-2, Llama or Mixtral that DIR's
config.json describes, as train's --init-from-hf reads it, but from config.json alone (no
weights read: a model can be planned before its weights are downloaded).

`train --resume` without --model takes these flags from the checkpoint's model spec
(`checkpoint_model_flags`); a --model that builds another model is refused naming both
(`check_resumed_model`).
"""
from __future__ import annotations

import inspect
import json
import os

from ..checkpoint import CheckpointError, model_spec, read_index
from ..checkpoint.format import spec_text
from ..hf.convert import from_config
from ..hf.files import CONFIG
from ..models.gpt.spec import GPT
from ..models.llama.spec import Llama
from ..models.mlp.spec import MLP
from .cluster_options import AUTO
from .usage import UsageError, check_directory, parse_dims

GPT_DEFAULTS = {"d_model": 128, "n_heads": 4, "n_layers": 4, "seq_len": 64, "d_ff": None,
                "tied": 0, "vocab": 256}
GPT_PREFIX = "gpt:"
LLAMA_DEFAULTS = {**GPT_DEFAULTS, "n_kv_heads": None, "rope_theta": 10000.0, "norm_eps": 1e-5,
                  "n_experts": None, "top_k": 2, "capacity_factor": None,
                  "router_aux_loss_coef": 0.0}
LLAMA_PREFIX = "llama:"
# numbers; every other key is an integer (router_aux_loss_coef may be 0)
FLOAT_KEYS = ("rope_theta", "norm_eps", "capacity_factor", "router_aux_loss_coef")
GPT_FLAG_HELP = ("comma-separated MLP dims, e.g. 64,256,256,10, or a GPT: gpt:KEY=VALUE,... or "
                 "gpt with --gpt KEY=VALUE,... (keys " + ", ".join(GPT_DEFAULTS) + "), or a "
                 "Llama: llama:KEY=VALUE,... (also n_kv_heads, rope_theta, norm_eps; a Mixtral's "
                 "experts: n_experts, top_k, capacity_factor, router_aux_loss_coef)")


def joined_gpt_spec(model, gpt=None):
    """The GPT spec text that --model and --gpt give together ('' for a GPT of defaults), or
    None when --model names an MLP (UsageError if --gpt came with one)."""
    text = str(model).strip()
    if text != "gpt" and not text.startswith(GPT_PREFIX):
        if gpt is not None:
            raise UsageError(f"--gpt applies to --model gpt, not --model {model}")
        return None
    parts = [text[len(GPT_PREFIX):] if text != "gpt" else "", gpt or ""]
    return ",".join(p for p in parts if p.strip())


def parse_gpt_spec(text, defaults=None) -> dict:
    """'d_model=64,n_heads=4,...' -> {key: int} over `defaults` (GPT_DEFAULTS); UsageError for
    an unknown or repeated key, a missing '=', a value that is not a positive integer, tied not
    0/1. The key vocab_size is read as vocab."""
    defaults = GPT_DEFAULTS if defaults is None else defaults
    spec, given = dict(defaults), set()
    for item in ([] if text is None else str(text).split(",")):
        if not item.strip():
            continue
        key, eq, value = (s.strip() for s in item.partition("="))
        key = "vocab" if key == "vocab_size" else key
        if not eq:
            raise UsageError(f"--gpt {text!r}: expected KEY=VALUE pairs joined by commas, "
                             f"e.g. d_model=128,n_heads=4, got {item!r}")
        if key not in defaults:
            raise UsageError(f"--gpt: unknown key {key!r}; known keys: {', '.join(defaults)}")
        if key in given:
            raise UsageError(f"--gpt: {key} is given twice")
        given.add(key)
        try:
            number = float(value) if key in FLOAT_KEYS else int(value)
        except ValueError:
            raise UsageError(f"--gpt: {key}={value!r} is not "
                             f"{'a number' if key in FLOAT_KEYS else 'an integer'}") from None
        if key == "tied" and number not in (0, 1):
            raise UsageError(f"--gpt: tied must be 0 or 1, got {value}")
        if key == "router_aux_loss_coef" and number < 0:
            raise UsageError(f"--gpt: {key} must be a number >= 0, got {value}")
        if key not in ("tied", "router_aux_loss_coef") and \
                (number <= 0 if key in FLOAT_KEYS else number < 1):
            raise UsageError(f"--gpt: {key} must be a positive "
                             f"{'number' if key in FLOAT_KEYS else 'integer'}, got {value}")
        spec[key] = number
    return spec


def gpt_from_spec(spec: dict, vocab_size=None) -> GPT:
    """ms.GPT of a parse_gpt_spec table (vocab_size: instead of the table's vocab)."""
    return GPT(vocab_size=vocab_size or spec["vocab"], seq_len=spec["seq_len"],
               d_model=spec["d_model"], n_heads=spec["n_heads"], n_layers=spec["n_layers"],
               d_ff=spec["d_ff"], tied=bool(spec["tied"]))


def llama_from_spec(t: dict, vocab_size=None) -> Llama:
    """ms.Llama of a parse_gpt_spec table over LLAMA_DEFAULTS (vocab_size: instead of the
    table's vocab)."""
    return Llama(vocab_size=vocab_size or t["vocab"], seq_len=t["seq_len"],
                 d_model=t["d_model"], n_heads=t["n_heads"], n_layers=t["n_layers"],
                 n_kv_heads=t["n_kv_heads"], d_ff=t["d_ff"], rope_theta=t["rope_theta"],
                 norm_eps=t["norm_eps"], tied=bool(t["tied"]), n_experts=t["n_experts"],
                 top_k=t["top_k"], capacity_factor=t["capacity_factor"],
                 router_aux_loss_coef=t["router_aux_loss_coef"])


def with_vocab(spec, vocab_size: int):
    """The same GPT or Llama spec with another vocabulary (a data set's)."""
    kw = {k: v for k, v in vars(spec).items()
          if k in inspect.signature(type(spec)).parameters}
    return type(spec)(**{**kw, "vocab_size": vocab_size})


def model_from_flag(text, activation: str = "relu", bias: bool = True, gpt=None):
    """The model spec `--model` (and `--gpt`) name (UsageError for a malformed flag,
    ValueError for sizes the model refuses)."""
    if str(text).strip().startswith(LLAMA_PREFIX):
        return llama_from_spec(parse_gpt_spec(str(text).strip()[len(LLAMA_PREFIX):],
                                              LLAMA_DEFAULTS))
    spec = joined_gpt_spec(text, gpt)
    if spec is not None:
        return gpt_from_spec(parse_gpt_spec(spec))
    return MLP(parse_dims(text), activation=activation, bias=bias)


def spec_flags(spec: dict):
    """The train flags that rebuild a checkpoint's model spec (index.json's "model"):
    {"model": dims} and its activation for an ms.MLP, {"model": "gpt" or "llama", "gpt":
    KEY=VALUE,...} for an ms.GPT or ms.Llama (no vocab: train takes it from the data); None
    for a model no flag names (ms.MoE, an MLP without bias)."""
    cls = spec.get("class")
    if cls == "MLP" and spec.get("bias", True) and isinstance(spec.get("dims"), list):
        return {"model": ",".join(map(str, spec["dims"])), "activation": spec.get("activation")}
    keys = {"GPT": GPT_DEFAULTS, "Llama": LLAMA_DEFAULTS}.get(cls)
    if keys is None:
        return None
    text = ",".join(f"{k}={int(spec[k]) if isinstance(spec[k], bool) else spec[k]}"
                    for k in keys if k != "vocab" and spec.get(k) is not None)
    return {"model": cls.lower(), "gpt": text}


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
    """The ms.GPT or ms.Llama of Hugging Face directory `path`'s config.json, by the rules of
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
        raise UsageError(f"{command}: give --model DIMS|gpt:...|llama:... or --hf DIR"
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
        p.add_argument("--hf", metavar="DIR", help="instead of --model: the GPT-2, Llama or "
                       "Mixtral of a Hugging Face directory's config.json (no weights read)")

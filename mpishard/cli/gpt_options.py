"""The train command's GPT options: `--model gpt --gpt KEY=VALUE,...` on a `--dataset text`.

    python -m mpishard train --model gpt --gpt d_model=128,n_heads=4,n_layers=4,seq_len=64 \\
        --corpus 'src/**/*.py' --optimizer adamw --lr 0.003 --batch 32 --steps 300

`--gpt` keys: d_model, n_heads, n_layers, seq_len, d_ff (default 4 d_model) and tied (0/1);
a key left out takes its value from DEFAULT_GPT. The vocabulary is the data set's (256 bytes,
train/text.py). In a --config file, `gpt = "d_model=128,..."` or a `[gpt]` table of the same
keys. `--model llama:KEY=VALUE,...` trains an ms.Llama the same way (the same keys and
n_kv_heads, rope_theta, norm_eps; Llama.flag_defaults), as does any architecture of the
registry that takes token ids and has a KEY=VALUE spelling (LANGUAGE_MODELS). Everything here
is checked without MPI and the same on every rank; only the corpus read (in
`gpt_model_and_data`, inside train's `agreed`) touches files.
"""
from __future__ import annotations

import logging

from ..parallel.compose import plan_params
from ..parallel.stages import assign_stages
from ..train.text import (BYTE_VOCAB, DEFAULT_CORPUS_BYTES, DEFAULT_VAL_FRACTION,
                          text_dataset)
from . import model_flag
from .usage import UsageError, check_flags

TEXT_DATASET = "text"
DEFAULT_GPT = {k: v for k, v in model_flag.GPT_DEFAULTS.items() if k != "vocab"}
# the --model KIND that train reads a text or token data set for: gpt (or gpt:...), llama:...
LANGUAGE_MODELS = tuple(kind for kind, cls in model_flag.KEYED.items() if cls.takes_tokens)
TEXT_FLAGS = ("corpus", "corpus_bytes", "val_fraction", "train_stride")
# --clip when not given for a GPT: global-norm clipping at 1.0, GPT-2/nanoGPT practice (the
# GPT of docs/training.md reaches a lower validation loss with it, as PyTorch does on the same
# batches; docs/performance.md).
DEFAULT_GPT_CLIP = 1.0
# The learning-rate schedule when neither the command line nor the config gives one: cosine
# decay with a short warm-up, the GPT-2/nanoGPT recipe the PyTorch reference uses.
GPT_SCHEDULE_DEFAULTS = {"schedule": "cosine", "warmup": 20}


def add_gpt_arguments(model_group, data_group):
    """--gpt on the model group, --corpus/--corpus-bytes/--val-fraction on the data group
    (each the group's recording add_argument)."""
    model_group("--gpt", metavar="KEY=VALUE,...", help="with --model gpt: d_model, n_heads, "
                "n_layers, seq_len, d_ff, tied (default " + gpt_spec_text(DEFAULT_GPT) + "); "
                f"a GPT clips gradients at --clip {DEFAULT_GPT_CLIP} unless --clip is given")
    data_group("--text", "--corpus", dest="corpus", metavar="FILE|DIR|GLOB|synthetic:SEED",
               help="--dataset text: a file, a directory or a glob, read sorted as bytes "
               "(default: the Python standard library's *.py); synthetic:SEED: a seeded Markov "
               "grammar whose best achievable loss is reported (train/grammar.py)")
    data_group("--train-stride", type=int, help="--dataset text: training windows start every "
               "N bytes (default seq_len; 1: every offset, i.e. random offsets per batch)")
    data_group("--corpus-bytes", type=int, help="--dataset text: read at most this many bytes "
               f"of the corpus (default {DEFAULT_CORPUS_BYTES})")
    data_group("--val-fraction", type=float, help="--dataset text or jsonl:|parquet:|hfdisk: "
               "records: the last fraction of the bytes (of the examples) that is the "
               f"validation split, > 0 (default {DEFAULT_VAL_FRACTION}; tokens:DIR holds its "
               "own)")


def gpt_spec_text(table: dict) -> str:
    """A {key: value} table (a TOML [gpt] table) as --gpt text; booleans become 0/1."""
    return ",".join(f"{k}={int(v) if isinstance(v, bool) else v}" for k, v in table.items()
                    if v is not None)


def parse_gpt_spec(text, kind="gpt", flag="--gpt") -> dict:
    """--gpt text -> {key: value} over the flag_defaults of architecture `kind` (--model
    KIND:..., model_flag.parse_gpt_spec's checks) less vocab: the vocabulary is the data
    set's, so a vocab key is refused. `flag` (the flag the text came from) labels messages."""
    keys = [item.partition("=")[0].strip() for item in str(text or "").split(",")]
    if {"vocab", "vocab_size"} & set(keys):
        raise UsageError(f"{flag}: train takes the vocabulary from the data set ({BYTE_VOCAB} "
                         f"bytes); leave vocab out")
    cls = model_flag.KEYED[kind]
    defaults = {k: v for k, v in cls.flag_defaults.items() if k != "vocab"}
    return model_flag.parse_gpt_spec(text, defaults, cls.flag_types, flag)


def validate_gpt_args(args, layout):
    """For --model gpt or --dataset text: the GPT spec (vocabulary BYTE_VOCAB) after checking
    the flags and that the layout fits it; None for a table data set and an MLP (after
    checking that no text-only flag was given). Raises UsageError; no MPI."""
    if args.model not in LANGUAGE_MODELS and args.dataset != TEXT_DATASET:
        for name in TEXT_FLAGS + ("gpt",):
            if getattr(args, name) is not None:
                flag = "--" + name.replace("_", "-")
                raise UsageError(f"{flag} applies to --model gpt on --dataset text only")
        return None
    if args.model not in LANGUAGE_MODELS or args.dataset != TEXT_DATASET:
        raise UsageError(f"--dataset text trains --model gpt (got --dataset {args.dataset} "
                         f"and --model {args.model})")
    if args.loss not in (None, "cross_entropy"):
        raise UsageError(f"--loss {args.loss} does not fit --model gpt; its loss is "
                         f"cross_entropy (the mean over every token)")
    check_flags(args, ("corpus_bytes", "train_stride"), low=0, low_open=True)
    check_flags(args, ("val_fraction",), low=0, high=1, low_open=True)
    flag = getattr(args, "gpt_flag", "--gpt")      # train's: the flag the keys came from
    spec = parse_gpt_spec(args.gpt, args.model, flag)
    try:
        model = model_flag.KEYED[args.model].from_flag(spec, BYTE_VOCAB)
        plan_params(model, layout)        # every model kind's layout checks (ep: Mixtral)
        assign_stages(model, layout)
    except ValueError as exc:
        raise UsageError(f"{flag} {gpt_spec_text(spec)}: {exc}") from None
    if args.clip is None:                # not given: a GPT trains with clipping (see above)
        args.clip = DEFAULT_GPT_CLIP
    return model


def gpt_model_and_data(args, spec):
    """(decoder spec, TextDataset): the corpus read and cut into windows of spec.seq_len, and
    the model with the data set's vocabulary. UsageError when the corpus is missing or too small
    for seq_len."""
    try:
        data = text_dataset(spec.seq_len, args.corpus, args.corpus_bytes or DEFAULT_CORPUS_BYTES,
                            args.val_fraction or DEFAULT_VAL_FRACTION, args.train_stride)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--text: {exc}") from None
    return model_flag.with_vocab(spec, data.n_classes), data


def log_corpus(log: logging.Logger, data) -> None:
    c = data.corpus
    log.info("corpus %s: %d file(s), %d bytes, sha256 %s; %d train windows (%d bytes), "
             "%d validation windows (%d bytes) of %d+1 bytes", c["source"], c["files"],
             c["bytes"], c["sha256"][:16], c["train_windows"], c["train_bytes"],
             c["val_windows"], c["val_bytes"], data.seq_len)
    if "best_loss" in c:
        log.info("synthetic grammar: entropy rate %.4f nats/byte = the best achievable "
                 "loss", c["best_loss"])


__all__ = ["DEFAULT_GPT", "DEFAULT_GPT_CLIP", "LANGUAGE_MODELS",
           "GPT_SCHEDULE_DEFAULTS", "TEXT_DATASET",
           "add_gpt_arguments",
           "gpt_model_and_data", "gpt_spec_text", "log_corpus", "parse_gpt_spec",
           "validate_gpt_args"]

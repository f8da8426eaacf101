"""The train command's real-tokenizer options: `--tokenizer`, `--dataset tokens:DIR` and
`--init-from-hf DIR` (fine-tuning a Hugging Face model).

    train --model gpt:d_model=128,... --text notes/ --tokenizer ./gpt2     # tokenized in memory
    mpishard tokenize --tokenizer ./gpt2 --text notes/ --out notes-tok     # or once, to disk,
    train --model gpt:d_model=128,... --dataset tokens:notes-tok           # then memory-mapped
    train --init-from-hf ./gpt2 --text notes/ --seq-len 256 --layout dp=2,tp=2   # fine-tune

--tokenizer DIR|FILE|bytes: a model directory's tokenizer.json (ms.hf.tokenizer), a
tokenizer.json itself, or `bytes` (the default: byte-level, vocabulary 256). The eos token put
between documents is the directory's tokenizer_config.json eos_token when it names one
(train/tokenizer.py). With --dataset tokens:DIR the tokens are already made: --tokenizer, and
the tokenizer of an --init-from-hf directory, must then be the one the file records (its
sha256), or the run stops naming both.

The tokenizer travels with the model: the run's checkpoints carry its tokenizer.json and
companion files (train/data.py's `carried`), or for --dataset tokens:DIR without --tokenizer
the tokenizer files DIR holds (written there by `tokenize`, checked against the recorded
sha256); with --tokenizer (or --init-from-hf's), that one carrying the chat template DIR
holds, the one its examples were rendered with (directory_template). A --chat-template of
records encoded in memory travels likewise (sft_options.py). The path the header's
tokenizer.name gives is never followed: it is input, not a
place to read from. A token directory without tokenizer files (an older `tokenize`) gives
only the name and sha256, and a warning says so; byte-level runs record `bytes`.

--init-from-hf DIR: the model is DIR's (ms.hf.read_model: config.json, tensor headers), its
weights are read by ms.hf.load_into (each rank only its own slices), and the text is
tokenized with DIR's tokenizer unless --tokenizer says otherwise. --model and --gpt are refused
with it; --seq-len sets the training windows' length (default the model's seq_len). A GPT of
--model gpt takes its vocabulary from the tokenizer; an --init-from-hf model keeps its own,
which must cover the tokenizer's ids. Checks that need no file run in `validate_lm_args`, the
rest in train's `prepare_training` (no collective; agreed on every rank before the engine is
made), so every rank stops with the same error, even when only one rank's node lacks a file.
"""
from __future__ import annotations

import argparse
import os

from ..hf import load_into, read_model, source
from ..hf import tokenizer as hf_tokenizer
from ..hf.tokenizer import eos_token, from_files
from ..train.text import DEFAULT_CORPUS_BYTES, DEFAULT_VAL_FRACTION, text_dataset
from ..train.data import carried
from ..train.records import is_records_name
from ..train.tokenizer import (BYTES, CHAT_TEMPLATE_FILE, TOKENIZER_JSON, ByteTokenizer,
                               HFTokenizer, RecordedTokenizer, read_tokenizer_files,
                               same_tokenizer)
from ..train.tokens import (is_tokens_name, token_dataset, tokenized_text_dataset,
                            tokenizer_files, tokens_directory)
from .gpt_options import (DEFAULT_GPT_CLIP, LANGUAGE_MODELS, TEXT_DATASET, gpt_model_and_data,
                          log_corpus, validate_gpt_args)
from .model_flag import HF_NAMES, with_vocab
from .sft_options import (RECORDS, check_val_fraction, examples_dataset, log_examples,
                          validate_sft_args)
from .usage import UsageError, check_flags, refuse_flags

TOKEN_DEFAULTS = {"tokenizer": None, "init_from_hf": None, "seq_len": None}


def add_token_arguments(model_group, data_group):
    """--init-from-hf on the model group, --tokenizer and --seq-len on the data group (each
    the group's recording add_argument)."""
    model_group("--init-from-hf", metavar="DIR", help="fine-tune the Hugging Face model in DIR "
                f"(config.json + safetensors; {HF_NAMES}): its spec and "
                "weights, and its tokenizer.json unless --tokenizer is given; not with "
                "--model/--gpt")
    data_group("--tokenizer", metavar="DIR|FILE|bytes", help="tokenize --text with a model "
               "directory's tokenizer.json (or the file itself); bytes: byte-level, vocab 256 "
               "(default, or DIR's with --init-from-hf)")
    data_group("--seq-len", type=int, metavar="N", help="with --init-from-hf: the training "
               "windows' length (default the model's seq_len)")


# -- tokenizers (no MPI) -----------------------------------------------------------------------
def load_tokenizer(text, flag="--tokenizer"):
    """ByteTokenizer for 'bytes', else an HFTokenizer of DIR/tokenizer.json or of the file
    (UsageError when there is none or it does not read)."""
    if text == BYTES:
        return ByteTokenizer()
    try:
        if os.path.isdir(text):
            tok = hf_tokenizer(text)
        elif os.path.isfile(text):
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(text)
        else:
            tok = None
    except ImportError:
        raise UsageError(f"{flag} {text} needs the tokenizers library: pip install "
                         f"tokenizers") from None
    except Exception as exc:             # tokenizers raises its own Exception type
        raise UsageError(f"{flag} {text}: not a readable tokenizer.json ({exc})") from None
    if tok is None:
        raise UsageError(f"{flag} {text}: no tokenizer.json there (give a model directory, a "
                         f"tokenizer.json or '{BYTES}')")
    try:
        files = read_tokenizer_files(text)
        return HFTokenizer(tok, text, eos_token(files), files)
    except (OSError, ValueError) as exc:
        raise UsageError(f"{flag} {text}: {exc}") from None


def header_tokenizer(made: dict, directory: str):
    """The tokenizer of token directory `directory` whose header records `made` ({name,
    sha256, files}): ByteTokenizer for bytes; the HFTokenizer of the files DIR holds
    (tokens.tokenizer_files), ValueError when they are not the recorded sha256; a
    RecordedTokenizer (its identity only) when the header names no files. made["name"] is
    shown, never read."""
    if made.get("name") == BYTES:
        return ByteTokenizer()
    files = tokenizer_files(directory, made)
    if not files:
        return RecordedTokenizer(made)
    where = f"--dataset tokens:{directory}"
    try:
        tok = HFTokenizer(from_files(files), made["name"], eos_token(files), files)
    except ImportError:
        raise UsageError(f"{where} carries a tokenizer; reading it needs the tokenizers "
                         f"library: pip install tokenizers") from None
    except ValueError as exc:
        raise ValueError(f"{where}: its tokenizer files: {exc}") from None
    if not same_tokenizer(tok.identity(), made):
        raise ValueError(f"{where}: its {TOKENIZER_JSON} has sha256 {tok.sha256[:16]}..., "
                         f"tokens.json records {str(made.get('sha256'))[:16]}...")
    return tok


def directory_template(tok, made: dict, directory: str):
    """`tok` (the same tokenizer as the token directory's, `made`) carrying the chat template
    the directory holds as its chat_template.jinja, the one its examples were rendered with
    (a `tokenize --chat-template`), so the checkpoints carry it; `tok` when it holds none."""
    template = (tokenizer_files(directory, made) or {}).get(CHAT_TEMPLATE_FILE)
    return tok if template is None else tok.with_chat_template(template.decode("utf-8"))


def run_tokenizer(args):
    """The tokenizer that encodes this run's text: --tokenizer, else the --init-from-hf
    directory's, else None (the byte-level default)."""
    if args.tokenizer is not None:
        return load_tokenizer(args.tokenizer)
    if args.init_from_hf is not None:
        if hf_tokenizer(args.init_from_hf) is None:
            raise UsageError(f"--init-from-hf {args.init_from_hf} has no tokenizer.json; give "
                             f"--tokenizer DIR|FILE|{BYTES}")
        return load_tokenizer(args.init_from_hf, "--init-from-hf")
    return None


# -- validation (no MPI; identical on every rank) ----------------------------------------------
def validate_lm_args(args, layout):
    """The language model of --init-from-hf or --dataset tokens:DIR (after checking the
    flags), or None for everything else (after refusing --tokenizer / --seq-len where they do
    not apply). Raises UsageError."""
    hf, tokens = args.init_from_hf, is_tokens_name(args.dataset)
    records = validate_sft_args(args)       # jsonl:, parquet:, hfdisk: (sft_options.py)
    language = hf or tokens or records or args.model in LANGUAGE_MODELS or \
        args.dataset == TEXT_DATASET
    if args.tokenizer is not None and not language:
        raise UsageError("--tokenizer applies to a language model (--model gpt, "
                         "--init-from-hf, --dataset text, tokens:DIR or records)")
    if args.seq_len is not None and not hf:
        raise UsageError("--seq-len applies to --init-from-hf (a --model gpt takes seq_len "
                         "from --gpt)")
    if tokens:
        for name, flag in (("corpus", "--text"), ("corpus_bytes", "--corpus-bytes")):
            if getattr(args, name) is not None:
                raise UsageError(f"{flag} applies to --dataset text; {args.dataset} holds its "
                                 f"own tokens and split")
        refuse_flags(args, {"val_fraction": "--val-fraction"}, f"--dataset text and "
                     f"{RECORDS}; {args.dataset} holds its own split (made by `tokenize "
                     f"--val-fraction`)")
    check_val_fraction(args)
    if hf:
        return _validate_hf(args)
    if not (tokens or records):
        return None
    if args.model not in (None, *LANGUAGE_MODELS):
        raise UsageError(f"--dataset {args.dataset} trains --model gpt or --init-from-hf DIR "
                         f"(got --model {args.model})")
    args.model = args.model or "gpt"   # validate_gpt_args's checks, as for --dataset text
    as_text = argparse.Namespace(**{**vars(args), "dataset": TEXT_DATASET})
    model = validate_gpt_args(as_text, layout)
    args.clip = as_text.clip
    return model


def check_seq_len(args, spec, layout) -> None:
    """UsageError unless the rows' length (--seq-len, else the model's seq_len) divides into
    the 2*cp chunks context parallelism cuts each row into (ring and Ulysses alike), so a
    length that does not is refused by name before any model is loaded."""
    cp = layout.sizes.get("cp", 1)
    seq_len = args.seq_len or spec.seq_len
    if cp > 1 and seq_len % (2 * cp):
        what = f"--seq-len {seq_len}" if args.seq_len else f"the model's seq_len {seq_len}"
        raise UsageError(f"{what} does not divide by 2*cp = {2 * cp}: layout "
                         f"{layout.text!r} cuts each row into 2*cp chunks; give a multiple "
                         f"of {2 * cp}")


def _validate_hf(args):
    """--init-from-hf: no --model/--gpt, a text or tokens: data set, the spec from DIR."""
    if args.model is not None or args.gpt is not None:
        given = " and ".join(f for f, v in (("--model", args.model), ("--gpt", args.gpt))
                             if v is not None)
        raise UsageError(f"--init-from-hf {args.init_from_hf} takes the model from its "
                         f"config.json; leave out {given}")
    if args.dataset != TEXT_DATASET and not is_tokens_name(args.dataset) and \
            not validate_sft_args(args):
        raise UsageError(f"--init-from-hf trains on --dataset text or tokens:DIR, not "
                         f"{args.dataset} (or on jsonl:|parquet:|hfdisk: records)")
    if args.loss not in (None, "cross_entropy"):
        raise UsageError(f"--loss {args.loss} does not fit a language model; its loss is "
                         f"cross_entropy")
    check_flags(args, ("corpus_bytes", "train_stride", "seq_len"), low=0, low_open=True)
    check_flags(args, ("val_fraction",), low=0, high=1, low_open=True)
    try:
        model = read_model(args.init_from_hf)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--init-from-hf {args.init_from_hf}: {exc}") from None
    if args.seq_len is not None and args.seq_len > model.seq_len:
        raise UsageError(f"--seq-len {args.seq_len} exceeds the model's seq_len "
                         f"{model.seq_len} (--init-from-hf {args.init_from_hf})")
    if args.clip is None:
        args.clip = DEFAULT_GPT_CLIP
    return model


# -- build (train's prepare_training) -------------------------------------------------------------
def lm_model_and_data(args, spec):
    """(model, TextDataset) of a language-model run: the byte-level corpus (gpt_options), a
    corpus tokenized in memory, or a token file; the model is `spec` (--init-from-hf) or a GPT
    of spec's sizes with the data's vocabulary. UsageError for a tokenizer that does not match
    the token file or whose ids the model's vocabulary does not cover."""
    tok = run_tokenizer(args)
    hf = args.init_from_hf is not None
    seq_len = args.seq_len or spec.seq_len
    records = is_records_name(args.dataset)
    try:
        if records:                     # fine-tune records, encoded here (bytes by default)
            data = examples_dataset(args, tok or ByteTokenizer(), seq_len)  # its tokenizer
        elif is_tokens_name(args.dataset):
            data = examples_dataset(args, None, seq_len) or \
                token_dataset(args.dataset, seq_len, args.train_stride)
            made = data.corpus["tokenizer"]
            if tok is not None and not same_tokenizer(tok.identity(), made):
                raise UsageError(f"--dataset {args.dataset} was tokenized by {made['name']} "
                                 f"(sha256 {str(made['sha256'])[:12]}), not by {tok.name} "
                                 f"(sha256 {str(tok.identity()['sha256'])[:12]}); pass "
                                 f"--tokenizer naming the file's tokenizer")
            directory = tokens_directory(args.dataset)
            data.tokenizer = header_tokenizer(made, directory) if tok is None else \
                directory_template(tok, made, directory)
        elif (tok is None or tok.name == BYTES) and not hf:
            model, data = gpt_model_and_data(args, spec)
            data.tokenizer = ByteTokenizer()
            return model, data
        elif tok is None or tok.name == BYTES:
            data = text_dataset(seq_len, args.corpus, args.corpus_bytes or DEFAULT_CORPUS_BYTES,
                                args.val_fraction or DEFAULT_VAL_FRACTION, args.train_stride)
            data.tokenizer = ByteTokenizer()
        else:
            data = tokenized_text_dataset(seq_len, tok, args.corpus,
                                          args.corpus_bytes or DEFAULT_CORPUS_BYTES,
                                          args.val_fraction or DEFAULT_VAL_FRACTION,
                                          args.train_stride)
            data.tokenizer = tok
    except (OSError, ValueError) as exc:
        if isinstance(exc, UsageError):
            raise
        flag = "--dataset" if is_tokens_name(args.dataset) or records else "--text"
        raise UsageError(str(exc) if str(exc).startswith(flag) else f"{flag}: {exc}") from None
    if not hf:
        return with_vocab(spec, data.n_classes), data
    if data.n_classes > spec.vocab_size:
        what = data.corpus.get("tokenizer", {}).get("name", BYTES)
        raise UsageError(f"the tokenizer {what} has {data.n_classes} ids but the model of "
                         f"--init-from-hf {args.init_from_hf} has a vocabulary of "
                         f"{spec.vocab_size}; it must cover every id")
    return spec, data


def load_initial_params(engine, args, model) -> None:
    """Collective: DIR's weights (--init-from-hf, each rank reading only its slices), or the
    model's seeded init."""
    if args.init_from_hf is not None:
        load_into(engine, args.init_from_hf)
    else:
        engine.load_checkpoint(model.init(seed=args.seed))


def checkpoint_contents(args, model, data) -> tuple:
    """(extra, assets): what this run's checkpoints keep besides the Trainer's state. With
    --init-from-hf, the source's config.json and dtype under "hf", as `import` keeps them, so
    `export` writes the same config fields (token ids) in the same dtype without --source;
    and what the data carries (train/data.py's `carried`: the tokenizer and its files, a
    standardisation's arrays)."""
    extra, assets = carried(data)
    record = source(model) if args.init_from_hf is not None else None
    if record is not None:
        extra["hf"] = record
    return extra, assets


def log_lm_data(log, data) -> None:
    """One line on the data: log_corpus's for bytes, the tokenizer and token counts else."""
    c = data.corpus
    if "tokenizer" not in c:
        return log_corpus(log, data)
    t = c["tokenizer"]
    if isinstance(data.tokenizer, RecordedTokenizer):
        log.warning("%s holds no tokenizer files (an older tokenize wrote it): checkpoints "
                    "record the tokenizer %s (sha256 %s) by name only, and generate will need "
                    "--tokenizer DIR; pass --tokenizer DIR to carry it", data.name, t["name"],
                    str(t["sha256"])[:16])
    if data.masked:                     # fine-tune examples
        return log_examples(log, data)
    log.info("corpus %s: %d file(s), %d bytes, sha256 %s; tokenizer %s (vocab %d, eos %s, "
             "sha256 %s): %d train tokens in %d windows, %d validation tokens in %d "
             "windows of %d+1 tokens", c["source"], c["files"], c["bytes"], c["sha256"][:16],
             t["name"], data.n_classes, c["eos_id"], str(t["sha256"])[:16], c["train_tokens"],
             c["train_windows"], c["val_tokens"], c["val_windows"], data.seq_len)


__all__ = ["TOKEN_DEFAULTS", "add_token_arguments", "check_seq_len", "checkpoint_contents",
           "lm_model_and_data", "load_initial_params", "load_tokenizer", "log_lm_data",
           "run_tokenizer", "validate_lm_args"]

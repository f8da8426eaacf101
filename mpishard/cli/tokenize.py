"""`python -m mpishard tokenize`: a corpus to token files that `train --dataset tokens:DIR`
memory-maps (no MPI).

    python -m mpishard tokenize --tokenizer ./gpt2 --text 'notes/**/*.md' --out notes-tok
    python -m mpishard tokenize --tokenizer bytes --out stdlib-tok --corpus-bytes 4000000

Writes DIR/train.bin and DIR/val.bin (flat uint16, or uint32 for vocabularies over 65536
ids), the tokenizer's files (tokenizer.json and the companions it has: train on DIR carries
them into its checkpoints) and DIR/tokens.json (dtype, counts, vocabulary size, the
tokenizer's name, sha256 and files, the eos id put after each document, the corpus' sha256):
train/tokens.py. The corpus is read as
`train --text` reads it (a file, a directory, a glob; default the Python standard library's
*.py), one file per document, streamed to disk a batch of documents at a time; unlike the
in-memory `train --text`, nothing is capped unless --corpus-bytes is given. The last
--val-fraction of the tokens is the validation split, cut as `train --text` cuts it, so the
same corpus and tokenizer give the same training windows either way.

Fine-tune records (`--dataset`, train/records.py; the `sft` extra):

    python -m mpishard tokenize --tokenizer ./llama --dataset 'jsonl:chat/*.jsonl' --out chat-tok
    python -m mpishard tokenize --tokenizer ./gpt2 --dataset parquet:qa.parquet --out qa-tok
    python -m mpishard tokenize --tokenizer bytes --dataset hfdisk:saved --text-field body ...

`--dataset jsonl:FILE|GLOB`, `parquet:FILE|GLOB` or `hfdisk:DIR` is read through the datasets
library, a record at a time: plain text (`--text-field`, default "text"), prompt/completion
pairs or `messages` (rendered with the tokenizer's chat template, or `--chat-template FILE`),
the kind found from the first record. Each record is one example, written with its loss mask
and the examples' starts (a version-2 token directory, train/example_tokens.py); the last
--val-fraction of the examples is the validation split. A --chat-template is written among
the tokenizer's files as its chat_template.jinja, so training on DIR carries it into the
checkpoints and an export. Records whose training split counts no token (chat messages
without an 'assistant' role, e.g. ShareGPT's human/gpt) are refused, naming the roles
found. A record that lacks its fields or has the wrong types stops the command with a
one-line error naming its file and line.
"""
from __future__ import annotations

from ..train.example_tokens import write_examples
from ..train.examples import open_with_template
from ..train.records import is_records_name
from ..train.text import DEFAULT_VAL_FRACTION
from ..train.tokens import write_tokens
from .sft_options import check_val_fraction
from .token_options import load_tokenizer
from .usage import UsageError, check_flags, print_report, refuse_flags

# the flags of one source that the other refuses: {dest: flag}
RECORDS_ONLY = {"text_field": "--text-field", "chat_template": "--chat-template"}
CORPUS_ONLY = {"corpus": "--text", "corpus_bytes": "--corpus-bytes"}


def add_tokenize_arguments(p):
    p.add_argument("--tokenizer", default="bytes", metavar="DIR|FILE|bytes", help="a model "
                   "directory's tokenizer.json, the file itself, or bytes (byte-level, vocab "
                   "256; the default)")
    p.add_argument("--text", "--corpus", dest="corpus", metavar="FILE|DIR|GLOB",
                   help="the corpus: a file, a directory or a glob, read sorted (default: the "
                   "Python standard library's *.py)")
    p.add_argument("--dataset", metavar="jsonl:FILE|GLOB|parquet:FILE|GLOB|hfdisk:DIR",
                   help="fine-tune records instead of --text: JSON Lines, Parquet or a "
                   "dataset saved with save_to_disk (needs the sft extra); one example per "
                   "record, with a loss mask")
    p.add_argument("--text-field", metavar="NAME", help="with --dataset: every record is "
                   "plain text in field NAME (without it the kind comes from the first "
                   "record: messages, else prompt and completion, else text)")
    p.add_argument("--chat-template", metavar="FILE", help="with --dataset of messages: the "
                   "jinja chat template (a .jinja file, or a .json with a chat_template key) "
                   "instead of the tokenizer's")
    p.add_argument("--out", required=True, metavar="DIR", help="where train.bin, val.bin, "
                   "tokens.json and the tokenizer's files go (created; an existing token "
                   "directory is replaced)")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help=f"the last fraction of the tokens (of the examples with --dataset) "
                   f"that is validation (default {DEFAULT_VAL_FRACTION})")
    p.add_argument("--corpus-bytes", type=int, help="read at most this many bytes of the "
                   "corpus (default: all of it)")
    return p


def run_tokenize(args) -> int:
    check_flags(args, ("corpus_bytes",), low=0, low_open=True)
    check_val_fraction(args)
    check_flags(args, ("val_fraction",), low=0, high=1, low_open=True)
    if args.dataset is not None:
        return _tokenize_records(args)
    refuse_flags(args, RECORDS_ONLY, "--dataset jsonl:|parquet:|hfdisk:")
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        h = write_tokens(args.out, tokenizer, args.corpus, args.corpus_bytes,
                         args.val_fraction)
    except (OSError, ValueError) as exc:
        raise UsageError(f"tokenize: {exc}") from None
    c = h["corpus"]
    return print_report("\n".join([
        f"corpus {c['source']}: {c['files']} file(s), {c['bytes']} bytes, sha256 "
        f"{c['sha256'][:16]}",
        _tokenizer_line(h),
        f"wrote {args.out}: {h['train']['count']} train + {h['val']['count']} validation "
        f"tokens as {h['dtype']} (train --dataset tokens:{args.out})"]))


def _tokenizer_line(h) -> str:
    t = h["tokenizer"]
    return (f"tokenizer {t['name']}: vocab {h['vocab_size']}, eos "
            f"{'none' if h['eos_id'] is None else h['eos_id']}"
            + ("" if t["sha256"] is None else f", sha256 {t['sha256'][:16]}")
            + (f"; its files {', '.join(t['files'])} written beside the tokens" if t["files"]
               else ""))


def _tokenize_records(args) -> int:
    """tokenize --dataset: the records encoded as examples (write_examples)."""
    if not is_records_name(args.dataset):
        raise UsageError(f"--dataset {args.dataset!r}: give jsonl:FILE|GLOB, "
                         f"parquet:FILE|GLOB or hfdisk:DIR")
    refuse_flags(args, CORPUS_ONLY, f"a text corpus, not --dataset {args.dataset}")
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        records, template = open_with_template(args.dataset, args.text_field,
                                               args.chat_template)
        h = write_examples(args.out, tokenizer, records, chat_template=template,
                           val_fraction=args.val_fraction)
    except (ImportError, OSError, ValueError) as exc:    # ImportError: no jinja2 (sft extra)
        raise UsageError(f"tokenize: {exc}") from None
    r, ex = h["records"], h["examples"]
    template = r["chat_template"]
    return print_report("\n".join([
        f"records {r['source']}: {r['count']} {r['kind']} record(s) (fields "
        f"{', '.join(r['fields'])}) from {r['files']} file(s), sha256 {r['sha256'][:16]}"
        + ("" if template is None else f"; chat template sha256 {template['sha256'][:16]}"),
        _tokenizer_line(h),
        f"wrote {args.out}: {ex['train']['count']} train + {ex['val']['count']} validation "
        f"examples, {h['train']['count']} + {h['val']['count']} tokens as {h['dtype']}, "
        f"{ex['train']['counted']} + {ex['val']['counted']} counted in the loss (train "
        f"--dataset tokens:{args.out})"]))


__all__ = ["add_tokenize_arguments", "run_tokenize"]

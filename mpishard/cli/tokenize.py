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
"""
from __future__ import annotations

from ..train.text import DEFAULT_VAL_FRACTION
from ..train.tokens import write_tokens
from .token_options import load_tokenizer
from .usage import UsageError, check_flags, print_report


def add_tokenize_arguments(p):
    p.add_argument("--tokenizer", default="bytes", metavar="DIR|FILE|bytes", help="a model "
                   "directory's tokenizer.json, the file itself, or bytes (byte-level, vocab "
                   "256; the default)")
    p.add_argument("--text", "--corpus", dest="corpus", metavar="FILE|DIR|GLOB",
                   help="the corpus: a file, a directory or a glob, read sorted (default: the "
                   "Python standard library's *.py)")
    p.add_argument("--out", required=True, metavar="DIR", help="where train.bin, val.bin, "
                   "tokens.json and the tokenizer's files go (created; an existing token "
                   "directory is replaced)")
    p.add_argument("--val-fraction", type=float, default=DEFAULT_VAL_FRACTION,
                   help=f"the last fraction of the tokens that is validation (default "
                   f"{DEFAULT_VAL_FRACTION})")
    p.add_argument("--corpus-bytes", type=int, help="read at most this many bytes of the "
                   "corpus (default: all of it)")
    return p


def run_tokenize(args) -> int:
    check_flags(args, ("corpus_bytes",), low=0, low_open=True)
    check_flags(args, ("val_fraction",), low=0, high=1, low_open=True)
    tokenizer = load_tokenizer(args.tokenizer)
    try:
        h = write_tokens(args.out, tokenizer, args.corpus, args.corpus_bytes,
                         args.val_fraction)
    except (OSError, ValueError) as exc:
        raise UsageError(f"tokenize: {exc}") from None
    c, t = h["corpus"], h["tokenizer"]
    return print_report("\n".join([
        f"corpus {c['source']}: {c['files']} file(s), {c['bytes']} bytes, sha256 "
        f"{c['sha256'][:16]}",
        f"tokenizer {t['name']}: vocab {h['vocab_size']}, eos "
        f"{'none' if h['eos_id'] is None else h['eos_id']}"
        + ("" if t["sha256"] is None else f", sha256 {t['sha256'][:16]}")
        + (f"; its files {', '.join(t['files'])} written beside the tokens" if t["files"]
           else ""),
        f"wrote {args.out}: {h['train']['count']} train + {h['val']['count']} validation "
        f"tokens as {h['dtype']} (train --dataset tokens:{args.out})"]))


__all__ = ["add_tokenize_arguments", "run_tokenize"]

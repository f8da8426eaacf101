"""Token directories of examples (version 2): `tokenize --dataset jsonl:...` writes them,
`read_examples` reads them a window at a time, as version 1's tokens are read.

    header = write_examples("chat-tok", tokenizer, open_records("jsonl:chat.jsonl"))
    splits, header = read_examples("chat-tok")     # {"train", "val"} ExampleTokens
    ids, mask = splits["train"].example(3)

A version-2 directory is a version-1 one (tokens.py: train.bin, val.bin, the tokenizer's
files, tokens.json) plus, per split, the loss mask and the examples' starts:

    DIR/train.mask.bin    uint8, one per token of train.bin: 1 where the token counts
    DIR/train.starts.bin  int64, (examples + 1,): each example's first token, then the count
    DIR/val.mask.bin, DIR/val.starts.bin    the same for val.bin (starts from 0)
    DIR/tokens.json       version 2; beside version 1's fields:
        "examples": {"train": {"mask", "starts", "count", "counted"}, "val": {...}}
        "records": {source, format, files, kind, fields, count, bytes, sha256,
                    chat_template: {sha256} or null}   (examples.Encoder.info)
        "corpus": {source, files, bytes, sha256} of the records, as version 1 names a corpus

The examples are encoded as examples.encode_records encodes them (examples.Encoder), streamed
to disk a batch of records at a time; then the last ceil(n * val_fraction) examples move to
the val files (tokens.move_tail), so the directory holds exactly the splits that
encode_records makes in memory from the same records and tokenizer.

Reading: ids and mask are tokens.TokenFile (each read maps the file, copies and unmaps), the
starts are read whole (8 bytes per example). read_header checks the version-1 fields; here
the example files' sizes must match the token counts, and the starts must run from 0 to the
split's token count without decreasing, so no read passes a file's end.
"""
from __future__ import annotations

import os

import numpy as np

from .examples import Encoder, ExampleTokens
from .text import DEFAULT_VAL_FRACTION, split_point
from .tokens import (EXAMPLES_VERSION, FORMAT, HEADER, TRAIN_FILE, VAL_FILE, TokenFile, files_of,
                     move_tail, prepare_directory, publish, read_header)
from .untrusted import file_in, whole_number

SPLIT_FILES = {"train": (TRAIN_FILE, "train.mask.bin", "train.starts.bin"),
               "val": (VAL_FILE, "val.mask.bin", "val.starts.bin")}
MASK, STARTS = np.dtype(np.uint8), np.dtype("<i8")


def write_examples(out: str, tokenizer, records, kind=None, chat_template=None,
                   val_fraction=DEFAULT_VAL_FRACTION) -> dict:
    """Encode `records` (records.Records; kind/chat_template as examples.encode_records) with
    `tokenizer` into the version-2 token directory `out` (tokens.prepare_directory); returns
    the header written. A given chat template is written among the tokenizer's files, as
    its chat_template.jinja. ValueError for a bad record, naming where it is, and when the
    training split counts no token (examples.Encoder.check_counted)."""
    split_point(1, val_fraction)                           # ValueError for a bad fraction
    prepare_directory(out)
    if chat_template is not None:                          # the directory carries it
        tokenizer = tokenizer.with_chat_template(chat_template)
    encoder = Encoder(records, tokenizer, kind, chat_template)
    tmp = {name: os.path.join(out, name + ".tmp")
           for names in SPLIT_FILES.values() for name in names}
    ids_file, mask_file, _ = (tmp[n] for n in SPLIT_FILES["train"])
    lengths, counted = [], []
    with open(ids_file, "wb") as f_ids, open(mask_file, "wb") as f_mask:
        for ids, mask in encoder.examples():
            f_ids.write(ids.tobytes())
            f_mask.write(mask.astype(MASK).tobytes())
            lengths.append(len(ids))
            counted.append(int(mask.sum()))
    n = len(lengths)
    starts = np.zeros(n + 1, STARTS)
    np.cumsum(lengths, out=starts[1:])
    cut = split_point(n, val_fraction)
    if cut < 1:
        raise ValueError(f"{n} example(s): too few to keep one for training beside a "
                         f"validation fraction of {val_fraction}")
    at, total = int(starts[cut]), int(starts[-1])
    for k, dtype in ((0, encoder.dtype), (1, MASK)):
        move_tail(tmp[SPLIT_FILES["train"][k]], tmp[SPLIT_FILES["val"][k]], dtype, at, total)
    encoder.check_counted(cut, sum(counted[:cut]))         # a split that trains nothing
    parts = {"train": (starts[:cut + 1], sum(counted[:cut])),
             "val": (starts[cut:] - at, sum(counted[cut:]))}
    for split, (split_starts, _) in parts.items():
        split_starts.astype(STARTS).tofile(tmp[SPLIT_FILES[split][2]])
    info = encoder.info({k: (len(s) - 1, int(s[-1]), c) for k, (s, c) in parts.items()})
    files = files_of(tokenizer)
    header = {"format": FORMAT, "version": EXAMPLES_VERSION, "dtype": encoder.dtype.name,
              "vocab_size": int(tokenizer.vocab_size), "eos_id": tokenizer.eos_id,
              "max_id": info["max_id"], "tokenizer": dict(info["tokenizer"],
                                                          files=sorted(files)),
              "val_fraction": val_fraction, "records": info["records"],
              "corpus": info["corpus"], "examples": {}}
    for split, (ids_name, mask_name, starts_name) in SPLIT_FILES.items():
        header[split] = {"file": ids_name, "count": info[split]["tokens"]}
        header["examples"][split] = {"mask": mask_name, "starts": starts_name,
                                     "count": info[split]["examples"],
                                     "counted": info[split]["counted"]}
    publish(out, files, [n for names in SPLIT_FILES.values() for n in names], header)
    return header


def read_examples(directory: str) -> tuple:
    """({"train", "val"} ExampleTokens, header) of a version-2 token directory (module
    docstring); ValueError for a version-1 directory or files that do not match the
    header."""
    header = read_header(directory)
    where = f"dataset tokens:{directory}"
    if header["version"] != EXAMPLES_VERSION:
        raise ValueError(f"{where}: version {header['version']} holds tokens, not examples; "
                         f"`mpishard tokenize --dataset jsonl:FILE ...` writes examples")
    dtype = np.dtype(header["dtype"])
    out = {}
    for split in SPLIT_FILES:
        what = f"{where}: {HEADER} field examples.{split}"
        try:
            entry = header["examples"][split]
            count = whole_number(entry["count"], f"examples.{split}.count")
            names = {k: file_in(directory, entry[k], f"{what}.{k}") for k in ("mask", "starts")}
        except (KeyError, TypeError) as exc:
            raise ValueError(f"{what} lacks or garbles {exc}") from None
        except ValueError as exc:
            raise ValueError(f"{what}: {exc}") from None
        tokens = header[split]["count"]
        _check_size(names["mask"], tokens * MASK.itemsize, f"{what}.mask")
        _check_size(names["starts"], (count + 1) * STARTS.itemsize, f"{what}.starts")
        starts = np.fromfile(names["starts"], STARTS).astype(np.int64)
        if starts[0] != 0 or starts[-1] != tokens or np.any(np.diff(starts) < 0):
            raise ValueError(f"{what}.starts: the starts do not run from 0 to {tokens} "
                             f"without decreasing")
        ids = TokenFile(file_in(directory, header[split]["file"], f"{HEADER} field "
                                f"{split}.file"), dtype, tokens)
        out[split] = ExampleTokens(ids, TokenFile(names["mask"], MASK, tokens), starts)
    return out, header


def _check_size(path: str, size: int, what: str):
    got = os.path.getsize(path) if os.path.isfile(path) else None
    if got != size:
        raise ValueError(f"{what}: {os.path.basename(path)} should have {size} bytes, "
                         + ("it is missing" if got is None else f"it has {got}"))


__all__ = ["SPLIT_FILES", "read_examples", "write_examples"]

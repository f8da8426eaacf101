"""Pre-tokenised corpora: `mpishard tokenize` writes them, `train --dataset tokens:DIR` reads
them a window at a time, and `--text ... --tokenizer` tokenizes a small corpus in memory.

    DIR/train.bin    the training tokens, flat little-endian uint16 (vocab <= 65536) or uint32
    DIR/val.bin      the validation tokens, the same dtype
    DIR/tokens.json  {"format": "mpishard-tokens", "version": 1, "dtype", "vocab_size",
                      "eos_id", "max_id", "tokenizer": {name, sha256, files},
                      "train": {file, count}, "val": {file, count}, "val_fraction",
                      "corpus": {source, files, bytes, sha256}}
    DIR/tokenizer.json, and tokenizer_config.json, special_tokens_map.json and the chat
                     template when the tokenizer has them: the tokenizer that made the ids,
                     named by tokenizer.files (none for bytes)

The nanoGPT/llm.c `.bin` style: raw ids, nothing else in the file, and a small JSON header
beside it. The corpus' documents (one per file, text.documents) are encoded one batch at a
time and streamed to disk (tokenizer.encode_documents: eos after each document), then the last
ceil(n * val_fraction) tokens move to val.bin (text.split_point), so the two files hold exactly
the tokens and the split that the in-memory path (`tokenized_text_dataset`) cuts from the same
corpus and tokenizer: the same windows, batches and losses either way.

Version 2 (example_tokens.py, `tokenize --dataset jsonl:...`) adds one example per record, a
loss mask and the examples' starts beside each split's tokens (EXAMPLE_FILES, named in the
header's "examples"); its train.bin and val.bin are version 1's, so `token_dataset` reads
either version as flat tokens.

The tokenizer travels with its tokens: a run on DIR carries the files DIR holds
(`tokenizer_files`, read as plain names inside DIR like every other name of the header), never
a tokenizer at the path `tokenizer.name` gives (shown, never followed). A header without
tokenizer.files (an older token directory) names its tokenizer's identity only.

Reading: `TokenFile` indexes a file's tokens through a short-lived `np.memmap` (mapped for one
read, copied out, unmapped), so a rank that asks for the windows of its own rows of a batch
reads those pages and keeps nothing mapped: its memory does not grow with the file, and the
file is never read whole. Windows and batches are text.py's, so the batches are the
DistributedBatcher's, the same for every layout with the same global batch and seed.
"""
from __future__ import annotations

import hashlib
import json
import os

import numpy as np

from .text import (DEFAULT_VAL_FRACTION, check_max_bytes, corpus_files, corpus_info, documents,
                   split_point, windows_dataset)
from .tokenizer import (BYTES, TOKENIZER_FILES, TOKENIZER_JSON, encode_corpus,
                        encode_documents, token_dtype)
from .untrusted import file_in, whole_number

TOKENS_PREFIX = "tokens:"
HEADER, TRAIN_FILE, VAL_FILE = "tokens.json", "train.bin", "val.bin"
FORMAT, VERSION = "mpishard-tokens", 1
EXAMPLES_VERSION = 2               # example_tokens.py's: version 1 plus masks and starts
VERSIONS = (VERSION, EXAMPLES_VERSION)
# the example files a version-2 directory adds (example_tokens.py), per split
EXAMPLE_FILES = ("train.mask.bin", "train.starts.bin", "val.mask.bin", "val.starts.bin")
COPY_TOKENS = 1 << 22              # tokens per chunk when moving the tail to val.bin


def is_tokens_name(name) -> bool:
    return isinstance(name, str) and name.startswith(TOKENS_PREFIX)


def tokens_directory(name: str) -> str:
    """DIR of 'tokens:DIR' (ValueError when empty or not a directory)."""
    directory = name[len(TOKENS_PREFIX):]
    if not directory:
        raise ValueError(f"--dataset {name!r}: give a directory, tokens:DIR")
    if not os.path.isdir(directory):
        raise ValueError(f"--dataset {name}: {directory} is not a directory")
    return directory


# -- reading ---------------------------------------------------------------------------------
class TokenFile:
    """The `count` tokens of a flat .bin file of `dtype`; `tokens[idx]` (integer arrays of any
    shape) maps the file, copies those tokens out and unmaps it."""

    def __init__(self, path: str, dtype, count: int):
        self.path, self.dtype, self.count = path, np.dtype(dtype), int(count)

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, idx):
        if not self.count:                           # an empty file cannot be mapped
            return np.zeros(0, self.dtype)[idx]
        mapped = np.memmap(self.path, self.dtype, "r", 0, (self.count,))
        out = np.array(mapped[idx])
        del mapped                                   # unmapped here: only the copy stays
        return out

    def __repr__(self) -> str:
        return f"TokenFile({self.path}, {self.count} x {self.dtype})"


def read_header(directory: str) -> dict:
    """The checked tokens.json of DIR: format and version, dtype, counts that match the files'
    sizes exactly (so no read passes a file's end), ids below vocab_size, and file names that
    are plain names inside DIR (untrusted.file_in); ValueError naming the field and the
    numbers."""
    where = f"dataset tokens:{directory}"
    path = os.path.join(directory, HEADER)
    try:
        with open(path) as f:
            header = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"{where}: {HEADER} not found (write one with `mpishard tokenize`)"
                         ) from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"{where}: {HEADER} is not readable JSON ({exc})") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"{where}: {HEADER} is not an {FORMAT} header")
    if header.get("version") not in VERSIONS:
        raise ValueError(f"{where}: {HEADER} has version {header.get('version')!r}; this "
                         f"mpishard reads versions {', '.join(map(str, VERSIONS))}")
    try:
        dtype = np.dtype(header["dtype"])
        vocab = whole_number(header["vocab_size"], "vocab_size", low=1)
        token_dtype(vocab)                           # ValueError past 2**32 ids
        max_id = whole_number(header["max_id"], "max_id", low=-1)
        splits = {k: (header[k]["file"], whole_number(header[k]["count"], f"{k}.count"))
                  for k in ("train", "val")}
    except (KeyError, TypeError) as exc:
        raise ValueError(f"{where}: {HEADER} lacks or garbles {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{where}: {HEADER} lacks or garbles a field: {exc}") from None
    if dtype not in (np.dtype(np.uint16), np.dtype(np.uint32)) or dtype != token_dtype(vocab):
        raise ValueError(f"{where}: dtype {dtype} does not hold a vocabulary of {vocab} ids "
                         f"(uint16 up to 65536 ids, uint32 above)")
    if not -1 <= max_id < vocab:
        raise ValueError(f"{where}: its largest id {max_id} is outside the vocabulary of "
                         f"{vocab}")
    eos = header.get("eos_id")
    if eos is not None and (type(eos) is not int or not 0 <= eos < vocab):
        raise ValueError(f"{where}: {HEADER} field eos_id={eos!r} is not an id below "
                         f"vocab_size {vocab}")
    _check_tokenizer_files(directory, header.get("tokenizer"), where)
    for name, (file, count) in splits.items():
        full = file_in(directory, file, f"{where}: {HEADER} field {name}.file")
        size = os.path.getsize(full) if os.path.isfile(full) else None
        if size != count * dtype.itemsize:
            raise ValueError(f"{where}: {HEADER} field {name}.count: {file} should hold "
                             f"{count} {dtype} tokens ({count * dtype.itemsize} bytes), "
                             + ("it is missing" if size is None else f"it has {size} bytes"))
    return header


def _check_tokenizer_files(directory, made, where):
    """tokens.json's tokenizer: {name, sha256} and, when present, `files`: a list of
    TOKENIZER_FILES (tokenizer.json among them unless it is empty: bytes, or a tokenizer
    without files) that are plain names of files inside DIR."""
    if not isinstance(made, dict) or "sha256" not in made or "name" not in made:
        raise ValueError(f"{where}: {HEADER} field tokenizer {made!r} is not {{name, sha256}}")
    names = made.get("files")
    if names is None:
        return
    what = f"{where}: {HEADER} field tokenizer.files"
    if not isinstance(names, list) or any(n not in TOKENIZER_FILES for n in names) or \
            (names and TOKENIZER_JSON not in names):
        raise ValueError(f"{what} {names!r} is not a list of some of {list(TOKENIZER_FILES)} "
                         f"with {TOKENIZER_JSON} (or empty)")
    for n in names:
        if not os.path.isfile(file_in(directory, n, what)):
            raise ValueError(f"{what}: {n} is missing from {directory}")


def tokenizer_files(directory: str, made: dict):
    """{file name: bytes} of the tokenizer token directory DIR holds (header field tokenizer,
    checked by read_header: `made`), each read as a plain name inside DIR; None when the
    header names none (bytes, or an older token directory: the identity alone is known)."""
    names = made.get("files")
    if not names:
        return None
    out = {}
    for n in names:
        with open(file_in(directory, n, f"{HEADER} field tokenizer.files"), "rb") as f:
            out[n] = f.read()
    return out


def token_dataset(name: str, seq_len: int, train_stride=None):
    """The TextDataset of 'tokens:DIR' cut into windows of seq_len (train_stride as in
    text.text_dataset): windows of train.bin and val.bin, read on demand (TokenFile); its
    corpus info adds the header's tokenizer, eos_id and dtype. ValueError on a bad directory
    or a split too short for one window."""
    directory = tokens_directory(name)
    header = read_header(directory)
    dtype = np.dtype(header["dtype"])
    files = {k: TokenFile(file_in(directory, header[k]["file"], f"{HEADER} field {k}.file"),
                          dtype, header[k]["count"]) for k in ("train", "val")}
    info = dict(header["corpus"], tokenizer=header["tokenizer"], eos_id=header["eos_id"],
                dtype=dtype.name)
    try:
        return windows_dataset(name, (files["train"], 0, len(files["train"])),
                               (files["val"], 0, len(files["val"])), seq_len,
                               int(header["vocab_size"]), info, train_stride)
    except ValueError as exc:
        raise ValueError(f"dataset {name}: {exc}") from None


def tokenized_text_dataset(seq_len: int, tokenizer, corpus=None, max_bytes=None,
                           val_fraction=DEFAULT_VAL_FRACTION, train_stride=None):
    """The in-memory path: `corpus` (text.corpus_files; None the standard library) encoded
    by `tokenizer` (tokenizer.py) and cut like a token file of the same corpus (max_bytes:
    cap the bytes read; None reads every file whole)."""
    if max_bytes is not None:
        check_max_bytes(max_bytes)
    docs = _Reading(corpus, max_bytes)
    tokens = encode_corpus(tokenizer, docs)
    cut = split_point(len(tokens), val_fraction)
    info = dict(docs.info(), tokenizer=tokenizer.identity(), eos_id=tokenizer.eos_id)
    return windows_dataset("text", (tokens, 0, cut), (tokens, cut, len(tokens) - cut),
                           seq_len, tokenizer.vocab_size, info, train_stride)


class _Reading:
    """The documents of a corpus as they are read, with corpus_info of what was read."""

    def __init__(self, corpus, max_bytes):
        self.corpus, self.files = corpus, corpus_files(corpus)
        self.max_bytes, self.count, self.size = max_bytes, 0, 0
        self.sha = hashlib.sha256()

    def __iter__(self):
        for doc in documents(self.files, self.max_bytes):
            self.count, self.size = self.count + 1, self.size + len(doc)
            self.sha.update(doc)
            yield doc

    def info(self) -> dict:
        return corpus_info(self.corpus, self.count, self.size, self.sha.hexdigest())


# -- writing ---------------------------------------------------------------------------------
def write_tokens(out: str, tokenizer, corpus=None, max_bytes=None,
                 val_fraction=DEFAULT_VAL_FRACTION) -> dict:
    """Tokenize `corpus` with `tokenizer` into DIR `out` (prepare_directory); returns the
    header written (publish: the tokenizer's files beside the tokens, the header last)."""
    split_point(1, val_fraction)                           # ValueError for a bad fraction
    if max_bytes is not None:
        check_max_bytes(max_bytes)
    prepare_directory(out)
    dtype = token_dtype(tokenizer.vocab_size)
    docs = _Reading(corpus, max_bytes)
    train_tmp, val_tmp = (os.path.join(out, f + ".tmp") for f in (TRAIN_FILE, VAL_FILE))
    count, max_id = 0, -1
    with open(train_tmp, "wb") as f:
        for ids in encode_documents(tokenizer, docs):
            if ids.size:
                max_id = max(max_id, int(ids.max()))
            f.write(ids.astype(dtype).tobytes())
            count += ids.size
    cut = split_point(count, val_fraction)
    move_tail(train_tmp, val_tmp, dtype, cut, count)
    files = files_of(tokenizer)
    header = {"format": FORMAT, "version": VERSION, "dtype": dtype.name,
              "vocab_size": int(tokenizer.vocab_size), "eos_id": tokenizer.eos_id,
              "max_id": max_id, "tokenizer": dict(tokenizer.identity(), files=sorted(files)),
              "train": {"file": TRAIN_FILE, "count": cut},
              "val": {"file": VAL_FILE, "count": count - cut}, "val_fraction": val_fraction,
              "corpus": docs.info()}
    publish(out, files, (TRAIN_FILE, VAL_FILE), header)
    return header


def prepare_directory(out: str):
    """Create DIR `out`; a directory that holds anything but a previous token directory's
    files, or the NAME.tmp files a failed or killed write of one left, is refused
    (ValueError). The leftovers are overwritten by the next write (its temporary names)."""
    ours = {HEADER, TRAIN_FILE, VAL_FILE, *EXAMPLE_FILES, *TOKENIZER_FILES}
    if os.path.exists(out) and (not os.path.isdir(out) or set(os.listdir(out)) - ours
                                - {name + ".tmp" for name in ours}):
        raise ValueError(f"--out {out} exists and is not a token directory; refusing to "
                         f"write into it")
    os.makedirs(out, exist_ok=True)


def publish(out: str, files: dict, names, header: dict):
    """Finish a token directory: the tokenizer's `files` ({name: bytes}) written, those of a
    previous tokenizer removed, each of `names` renamed from its NAME.tmp, the header written
    (under a temporary name, renamed last), then a previous version's example files that
    `names` lacks removed."""
    for name in TOKENIZER_FILES:
        if name in files:
            with open(os.path.join(out, name + ".tmp"), "wb") as f:
                f.write(files[name])
            os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
        elif os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))             # a previous tokenizer's
    for name in names:
        os.replace(os.path.join(out, name + ".tmp"), os.path.join(out, name))
    tmp = os.path.join(out, HEADER + ".tmp")
    with open(tmp, "w") as f:
        json.dump(header, f, indent=1)
    os.replace(tmp, os.path.join(out, HEADER))
    for name in EXAMPLE_FILES:
        if name not in names and os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))             # a previous version's


def files_of(tokenizer) -> dict:
    """{file name: bytes} a token directory keeps of `tokenizer`: none for bytes; an
    HFTokenizer's files, or its canonical JSON as tokenizer.json when it was made in memory."""
    if tokenizer.identity().get("name") == BYTES:
        return {}
    files = dict(getattr(tokenizer, "files", None) or {})
    if not files and hasattr(tokenizer, "tokenizer"):
        files = {TOKENIZER_JSON: tokenizer.tokenizer.to_str().encode()}
    return files


def move_tail(train_path, val_path, dtype, cut: int, count: int):
    """Tokens cut..count of train_path to val_path (a chunk at a time), then train_path cut
    to its first `cut` tokens."""
    source = TokenFile(train_path, dtype, count)
    with open(val_path, "wb") as f:
        for start in range(cut, count, COPY_TOKENS):
            f.write(source[np.arange(start, min(count, start + COPY_TOKENS))].tobytes())
    os.truncate(train_path, cut * dtype.itemsize)


__all__ = ["EXAMPLES_VERSION", "EXAMPLE_FILES", "HEADER", "TOKENS_PREFIX", "TRAIN_FILE",
           "TokenFile", "VAL_FILE", "files_of", "is_tokens_name", "move_tail",
           "prepare_directory", "publish", "read_header", "token_dataset",
           "tokenized_text_dataset", "tokenizer_files", "tokens_directory", "write_tokens"]

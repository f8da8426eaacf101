"""Text corpora for a GPT: byte-level tokens (vocab 256), a train/validation split by position,
and windows that are cut only when a rank asks for them.

    data = text_dataset(seq_len=64)                  # the standard library's source, ~2 MB
    data = text_dataset(seq_len=64, corpus="notes/*.md", max_bytes=10**6)

The corpus never comes from the network. The default is the running interpreter's own standard
library: its top-level `*.py` files (`sysconfig.get_paths()["stdlib"]`), sorted by name, read as
bytes and concatenated until `max_bytes` (the last file cut there). A user corpus is a file, a
directory (every regular file below it) or a glob, also sorted and capped. The corpus' sha256,
file count and size are reported with the data set, so a run says what it trained on.

Tokens are the bytes themselves. The last `val_fraction` of the bytes is the validation split,
the rest the training split, so no byte of one split is in the other. Each split is cut into
windows of seq_len + 1 bytes that start every seq_len bytes (consecutive windows share one
byte: window i predicts bytes i*seq_len+1 ... (i+1)*seq_len):

    x[i] = tokens[s + i*S : s + i*S + S]            (inputs,  S = seq_len)
    t[i] = tokens[s + i*S + 1 : s + i*S + S + 1]    (targets, the next byte of each input)

`Windows` stands in for the (N, S) arrays a `Dataset` holds: `len`, `shape` and indexing with
row indices, so `DistributedBatcher` takes this rank's rows of each batch (as
`engine.shard_batch` would cut them) and only those windows are materialised, as int64 ids.
`windows_dataset` builds the data set from two token spans; tokens.py feeds it the tokens of a
real tokenizer (in memory) or of a token file (memory-mapped), with the same split rule
(`split_point`) and windows, so the same tokens give the same batches whichever way they came.
"""
from __future__ import annotations

import glob
import hashlib
import math
import os
import sysconfig
from dataclasses import dataclass, field

import numpy as np

from ..parallel.context_parallel import shard_sequence
from .data import Dataset
from .grammar import synthetic_corpus, synthetic_seed

BYTE_VOCAB = 256
BYTES = "bytes"                  # the byte-level tokenizer's name (tokenizer.py)
DEFAULT_CORPUS_BYTES = 2_000_000
DEFAULT_VAL_FRACTION = 0.05


# -- the corpus ----------------------------------------------------------------------------------
def stdlib_files() -> list:
    """The default corpus' files: the standard library's top-level *.py files, sorted."""
    root = sysconfig.get_paths()["stdlib"]
    return sorted(glob.glob(os.path.join(glob.escape(root), "*.py")))


def corpus_files(corpus=None) -> list:
    """The files of `corpus` in a fixed order: None -> stdlib_files(); a file; a directory
    (every regular file below it); or a glob pattern. ValueError when nothing matches."""
    if corpus is None:
        files = stdlib_files()
    elif os.path.isfile(corpus):
        files = [corpus]
    elif os.path.isdir(corpus):
        files = sorted(os.path.join(d, f) for d, _, names in os.walk(corpus) for f in names)
    else:
        files = sorted(glob.glob(corpus, recursive=True))
    files = [f for f in files if os.path.isfile(f)]
    if not files:
        where = "the standard library" if corpus is None else repr(corpus)
        raise ValueError(f"corpus {where}: no files found")
    return files


def documents(files, max_bytes=None):
    """Yield the bytes of each file of `files` in order (one document each), the last one cut
    so that they total at most max_bytes (None: every file whole); one file in memory at a
    time."""
    total = 0
    for path in files:
        if max_bytes is not None and total >= max_bytes:
            return
        with open(path, "rb") as f:
            chunk = f.read(-1 if max_bytes is None else max_bytes - total)
        total += len(chunk)
        yield chunk


def corpus_info(corpus, files: int, size: int, sha256: str) -> dict:
    """{source, files, bytes, sha256}: what a run says it trained on."""
    return {"source": "python-stdlib" if corpus is None else str(corpus), "files": files,
            "bytes": size, "sha256": sha256}


def check_max_bytes(max_bytes):
    if isinstance(max_bytes, bool) or int(max_bytes) != max_bytes or max_bytes < 1:
        raise ValueError(f"corpus max_bytes must be a positive integer, got {max_bytes!r}")


def read_corpus(corpus=None, max_bytes=DEFAULT_CORPUS_BYTES) -> tuple:
    """(tokens, info): the bytes of corpus_files(corpus) concatenated and cut at max_bytes, as
    a uint8 array, and corpus_info describing them."""
    check_max_bytes(max_bytes)
    chunks = list(documents(corpus_files(corpus), max_bytes))
    data = b"".join(chunks)
    info = corpus_info(corpus, len(chunks), len(data), hashlib.sha256(data).hexdigest())
    return np.frombuffer(data, dtype=np.uint8), info


def read_text(corpus=None, max_bytes=DEFAULT_CORPUS_BYTES) -> tuple:
    """(tokens, info) of read_corpus, or of grammar.synthetic_corpus (max_bytes bytes) for
    'synthetic:SEED' (its info adds best_loss, the grammar's entropy rate)."""
    seed = synthetic_seed(corpus)
    if seed is None:
        return read_corpus(corpus, max_bytes)
    check_max_bytes(max_bytes)
    return synthetic_corpus(seed, max_bytes)


# -- windows -------------------------------------------------------------------------------------
class Windows:
    """Rows of an (N, seq_len) int64 array cut from `tokens` on demand: row i is
    tokens[start + i*stride + shift : ... + seq_len] (shift 0: inputs, 1: targets; stride
    default seq_len: disjoint windows; 1: a window at every byte offset)."""

    def __init__(self, tokens, start: int, count: int, seq_len: int, shift: int = 0,
                 stride=None):
        self.tokens, self.start, self.count = tokens, int(start), int(count)
        self.seq_len, self.shift = int(seq_len), int(shift)
        self.stride = self.seq_len if stride is None else int(stride)
        self.dtype = np.dtype(np.int64)

    @property
    def shape(self) -> tuple:
        return (self.count, self.seq_len)

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, rows):
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(self.count))
        rows = np.asarray(rows)
        if rows.size and (rows.min() < -self.count or rows.max() >= self.count):
            raise IndexError(f"window index out of range for {self!r}")
        rows = rows % max(self.count, 1)                   # negative indices count from the end
        first = self.start + self.shift + self.stride * rows
        return self.tokens[first[..., None] + np.arange(self.seq_len)].astype(np.int64)

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return (f"Windows({self.count} x {self.seq_len} from byte {self.start}"
                f"{f', stride {self.stride}' if self.stride != self.seq_len else ''}"
                f"{', targets' if self.shift else ''})")


def split_point(n_tokens: int, val_fraction=DEFAULT_VAL_FRACTION) -> int:
    """Where the validation split starts: the last ceil(n_tokens * val_fraction) tokens are
    validation (ValueError unless 0 < val_fraction < 1)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"validation fraction must lie in (0, 1), got {val_fraction}")
    return n_tokens - int(math.ceil(n_tokens * val_fraction))


def window_count(length: int, seq_len: int, stride: int, name: str, n_tokens=None) -> int:
    """How many windows of seq_len + 1 tokens, starting every `stride`, fit in `length`
    tokens (ValueError naming split `name` when not one does)."""
    count = (length - 1 - seq_len) // stride + 1 if length > seq_len else 0
    if count < 1:
        of = "" if n_tokens is None else f" of its {n_tokens}"
        raise ValueError(f"seq_len={seq_len} does not fit the {name} split of the corpus: "
                         f"{length}{of} tokens, a window needs seq_len + 1 = {seq_len + 1}")
    return count


def split_windows(n_tokens: int, seq_len: int, val_fraction=DEFAULT_VAL_FRACTION,
                  train_stride=None) -> dict:
    """{'train': (start, count), 'val': (start, count)}: window starts and counts of each split
    of a corpus of n_tokens tokens (validation: the last val_fraction of them, split_point; its
    windows start every seq_len tokens, the training ones every train_stride, default
    seq_len). ValueError when a split cannot hold one window of seq_len + 1 tokens."""
    cut = split_point(n_tokens, val_fraction)
    spans = {"train": (0, cut, train_stride or seq_len), "val": (cut, n_tokens - cut, seq_len)}
    return {name: (start, window_count(length, seq_len, stride, name, n_tokens))
            for name, (start, length, stride) in spans.items()}


@dataclass(repr=False)
class TextDataset(Dataset):
    """A Dataset of token windows (task 'language'): bytes, or a tokenizer's ids (tokens.py);
    `corpus` describes where they came from (with "tokenizer": {name, sha256} for ids)."""

    corpus: dict = field(default_factory=dict)

    @property
    def unit(self) -> str:
        """What one term of the loss predicts: 'byte' (byte-level tokens; the loss is nats per
        byte) or 'token' (a tokenizer's ids: nats per token)."""
        tok = self.corpus.get("tokenizer")
        return "byte" if tok is None or tok.get("name") == BYTES else "token"

    @property
    def default_loss(self) -> str:
        return "cross_entropy"

    @property
    def seq_len(self) -> int:
        return self.x_train.seq_len


def windows_dataset(name: str, train: tuple, val: tuple, seq_len: int, vocab_size: int,
                    info: dict, train_stride=None) -> TextDataset:
    """The TextDataset of two spans (tokens, start, length): training windows every
    train_stride (default seq_len) tokens of `train`, validation windows every seq_len tokens
    of `val`; `info` (the corpus' description) gains the window and token counts. `tokens` is
    anything indexed by integer arrays: an in-memory array, or a tokens.TokenFile."""
    (a, s0, len0), (b, s1, len1) = train, val
    n0 = window_count(len0, seq_len, train_stride or seq_len, "train")
    n1 = window_count(len1, seq_len, seq_len, "val")
    info = dict(info, train_windows=n0, val_windows=n1, train_tokens=len0, val_tokens=len1,
                train_stride=train_stride or seq_len)
    x_train, t_train = (Windows(a, s0, n0, seq_len, shift, train_stride) for shift in (0, 1))
    x_val, t_val = (Windows(b, s1, n1, seq_len, shift) for shift in (0, 1))
    return TextDataset(name, x_train, t_train, x_val, t_val, "language", vocab_size,
                       corpus=info)


def text_dataset(seq_len: int, corpus=None, max_bytes=DEFAULT_CORPUS_BYTES,
                 val_fraction=DEFAULT_VAL_FRACTION, train_stride=None) -> TextDataset:
    """The byte-level data set of `corpus` (see read_corpus, or synthetic_corpus for
    'synthetic:SEED') cut into windows of seq_len. train_stride: the training windows start
    every train_stride bytes (default seq_len; 1: at every offset, so the shuffled batches
    see random offsets, as sampling `randint(len - seq_len)` per row does)."""
    tokens, info = read_text(corpus, max_bytes)
    cut = split_point(len(tokens), val_fraction)
    info.update(train_bytes=cut, val_bytes=len(tokens) - cut)
    return windows_dataset("text", (tokens, 0, cut), (tokens, cut, len(tokens) - cut), seq_len,
                           BYTE_VOCAB, info, train_stride)


# -- evaluation ----------------------------------------------------------------------------------
def sequence_cut(engine, arr):
    """This rank's part of rows already cut over the data axes (what the batcher gives it):
    its two sequence chunks under cp, as engine.shard_batch cuts them; `arr` itself else."""
    return shard_sequence(arr, engine.mesh)


def bits_per(unit: str, loss_nats: float) -> dict:
    """{"val_bits_per_byte" or "val_bits_per_token": the loss in bits} (unit: TextDataset.unit)."""
    return {f"val_bits_per_{unit}": loss_nats / math.log(2.0)}


__all__ = ["BYTES", "BYTE_VOCAB", "DEFAULT_CORPUS_BYTES", "DEFAULT_VAL_FRACTION", "TextDataset",
           "Windows", "bits_per", "check_max_bytes", "corpus_files", "corpus_info", "documents",
           "read_corpus", "read_text", "sequence_cut", "split_point",
           "split_windows", "stdlib_files", "text_dataset", "window_count",
           "windows_dataset"]

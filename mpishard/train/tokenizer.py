"""Tokenizers for training text: the byte-level default and a Hugging Face `tokenizers` one.

    tok = ByteTokenizer()                                   # ids are the bytes, vocab 256
    tok = HFTokenizer(tokenizers.Tokenizer.from_file("gpt2/tokenizer.json"), "gpt2")
    ids = encode_corpus(tok, documents(corpus_files("notes/")))   # one flat id array

Both have the same face: `vocab_size` (every id is below it), `eos_id` (the end-of-text id
put after each document, or None), `identity()` ({name, sha256}: what a token file records and
a run compares) and `encode(docs)` (a list of documents, each the bytes of one file, to one id
array per document).

Documents. A corpus is a sequence of files (text.corpus_files); each file is one document. The
byte tokenizer concatenates their bytes unchanged (eos None), exactly the byte-level corpus of
text.read_corpus. A Hugging Face tokenizer encodes each document on its own (UTF-8, a byte it
cannot decode replaced by U+FFFD; its own special tokens added, e.g. a Llama's BOS) and puts
its end-of-text token after each, as nanoGPT's and llm.c's data preparation do. The eos token
is the one the model directory's tokenizer_config.json names, else the first of EOS_TOKENS
that the tokenizer knows, else none (documents then run into each other).

Identity: the sha256 of the tokenizer's canonical JSON (`Tokenizer.to_str()`), so the same
tokenizer read from two copies of a directory is the same tokenizer, and a token file made by
another one is refused by name. The byte tokenizer's identity is {"name": "bytes"}.

Files: a tokenizer read from a directory keeps the bytes of its tokenizer.json and of the
companions present beside it (TOKENIZER_FILES: tokenizer_config.json, special_tokens_map.json,
the chat template; `with_chat_template` puts a given one in), so a checkpoint carries them
(`carried()`: the record a checkpoint's extra["tokenizer"] keeps, and the files) and
`generate` and `export` use the very tokenizer (and chat template) the model was trained with.
"""
from __future__ import annotations

import copy
import hashlib
import os

import numpy as np

from .text import BYTE_VOCAB, BYTES

EOS_TOKENS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
ENCODE_BATCH = 64                   # documents per call to the Rust encoder
TOKENIZER_JSON = "tokenizer.json"
# what a tokenizer is on disk, beside tokenizer.json (what transformers' save_pretrained writes)
CHAT_TEMPLATE_FILE = "chat_template.jinja"     # read before any other template (transformers)
TOKENIZER_FILES = (TOKENIZER_JSON, "tokenizer_config.json", "special_tokens_map.json",
                   CHAT_TEMPLATE_FILE, "chat_template.json")


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 for vocabularies up to 65536 ids, uint32 above (ValueError past 2**32)."""
    if vocab_size <= 1 << 16:
        return np.dtype(np.uint16)
    if vocab_size <= 1 << 32:
        return np.dtype(np.uint32)
    raise ValueError(f"a vocabulary of {vocab_size} ids does not fit 32-bit token ids")


class ByteTokenizer:
    """The default for our own models: each byte is a token (vocab 256), no end-of-text."""

    name = BYTES
    vocab_size = BYTE_VOCAB
    eos_id = None

    def identity(self) -> dict:
        return {"name": BYTES, "sha256": None}

    def encode(self, docs: list) -> list:
        return [np.frombuffer(d, dtype=np.uint8) for d in docs]

    def with_chat_template(self, template: str):
        """Itself: the byte tokenizer carries no files (it has no Hugging Face form), so a
        chat template it rendered with stays with the run that gave it."""
        return self

    def carried(self) -> tuple:
        """(record, no files): a checkpoint records that its ids are bytes."""
        return dict(self.identity(), eos_id=None, files=[]), {}

    def __repr__(self) -> str:
        return "ByteTokenizer(vocab 256)"


class HFTokenizer:
    """A `tokenizers.Tokenizer` (from a model directory's tokenizer.json) as a corpus encoder.

    name: where it came from (shown, not compared); eos_token: the end-of-text token's text
    (tokenizer_config.json's eos_token) or None to look for EOS_TOKENS; files: {file name:
    bytes} it was read from (read_tokenizer_files), which a checkpoint carries."""

    def __init__(self, tokenizer, name: str, eos_token=None, files=None):
        self.tokenizer, self.name = tokenizer, str(name)
        self.files = dict(files or {})
        vocab = tokenizer.get_vocab(with_added_tokens=True)
        self.vocab_size = max(tokenizer.get_vocab_size(with_added_tokens=True),
                              max(vocab.values(), default=-1) + 1)
        candidates = (eos_token,) if eos_token else EOS_TOKENS
        ids = [tokenizer.token_to_id(t) for t in candidates]
        if eos_token and ids[0] is None:
            raise ValueError(f"tokenizer {self.name}: its eos_token {eos_token!r} is not in "
                             f"its vocabulary")
        self.eos_id = next((int(i) for i in ids if i is not None), None)
        self.sha256 = hashlib.sha256(tokenizer.to_str().encode()).hexdigest()

    def identity(self) -> dict:
        return {"name": self.name, "sha256": self.sha256}

    def carried(self) -> tuple:
        """(record, files): what a checkpoint keeps of this tokenizer, its identity, eos id
        and file names in extra["tokenizer"], and {file name: bytes} to store beside it."""
        record = dict(self.identity(), eos_id=self.eos_id, files=sorted(self.files))
        return record, dict(self.files)

    def with_chat_template(self, template: str) -> "HFTokenizer":
        """A copy whose files hold `template` as chat_template.jinja, the file that
        transformers and chat_template.find_chat_template read before any other: a
        --chat-template override then travels with the tokenizer into the token directory,
        the checkpoints and an export. Its identity (tokenizer.json's sha256) is unchanged."""
        out = copy.copy(self)
        out.files = dict(self.files or {TOKENIZER_JSON: self.tokenizer.to_str().encode()})
        out.files[CHAT_TEMPLATE_FILE] = template.encode("utf-8")
        return out

    def encode(self, docs: list) -> list:
        texts = [d.decode("utf-8", errors="replace") for d in docs]
        return [np.asarray(e.ids, dtype=np.int64) for e in self.tokenizer.encode_batch(texts)]

    def __repr__(self) -> str:
        eos = "none" if self.eos_id is None else self.eos_id
        return f"HFTokenizer({self.name}, vocab {self.vocab_size}, eos {eos})"


class RecordedTokenizer:
    """A tokenizer known by its identity alone (a token file's header naming a tokenizer that
    is not at hand): a checkpoint records it, without files."""

    def __init__(self, identity: dict, eos_id=None):
        self.record = dict(identity, eos_id=eos_id, files=[])

    def carried(self) -> tuple:
        return dict(self.record), {}


def read_tokenizer_files(path) -> dict:
    """{file name: bytes} of a tokenizer on disk: `path` is a directory (its tokenizer.json
    and the TOKENIZER_FILES beside it) or a tokenizer.json file (kept as tokenizer.json, with
    the companions of its directory). OSError when there is no tokenizer.json."""
    path = os.fspath(path)
    directory, main = (path, os.path.join(path, TOKENIZER_JSON)) if os.path.isdir(path) \
        else (os.path.dirname(path) or ".", path)
    with open(main, "rb") as f:
        files = {TOKENIZER_JSON: f.read()}
    for name in TOKENIZER_FILES[1:]:
        full = os.path.join(directory, name)
        if os.path.isfile(full):
            with open(full, "rb") as f:
                files[name] = f.read()
    return files


def same_tokenizer(a: dict, b: dict) -> bool:
    """Whether two identity() records name the same tokenizer (bytes, or equal sha256)."""
    if a.get("name") == BYTES or b.get("name") == BYTES:
        return a.get("name") == b.get("name") == BYTES
    return a.get("sha256") == b.get("sha256")


def encode_documents(tokenizer, docs):
    """Yield one id array per document of the iterable `docs`, eos_id appended to each when
    the tokenizer has one, encoding ENCODE_BATCH documents at a time."""
    tail = None if tokenizer.eos_id is None else np.array([tokenizer.eos_id], np.int64)
    batch = []
    for doc in docs:
        batch.append(doc)
        if len(batch) == ENCODE_BATCH:
            yield from _with_eos(tokenizer.encode(batch), tail)
            batch = []
    if batch:
        yield from _with_eos(tokenizer.encode(batch), tail)


def _with_eos(arrays, tail):
    for ids in arrays:
        yield ids if tail is None else np.concatenate([ids, tail])


def encode_corpus(tokenizer, docs) -> np.ndarray:
    """Every document of `docs` encoded and joined (encode_documents), as one array of
    token_dtype(vocab_size) ids (uint8 for the byte tokenizer)."""
    dtype = np.uint8 if tokenizer.vocab_size == BYTE_VOCAB and tokenizer.eos_id is None \
        else token_dtype(tokenizer.vocab_size)
    parts = [ids.astype(dtype) for ids in encode_documents(tokenizer, docs)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


__all__ = ["BYTES", "ByteTokenizer", "CHAT_TEMPLATE_FILE", "EOS_TOKENS", "HFTokenizer",
           "RecordedTokenizer", "TOKENIZER_FILES", "TOKENIZER_JSON", "encode_corpus",
           "encode_documents", "read_tokenizer_files", "same_tokenizer", "token_dtype"]

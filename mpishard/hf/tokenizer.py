"""The tokenizer of a Hugging Face directory or of a checkpoint: its `tokenizer.json`, read by
`tokenizers`, and the files that make it a tokenizer transformers loads.

    tok = ms.hf.tokenizer("gpt2")            # tokenizers.Tokenizer, or None without the file
    ids = tok.encode("Hello world").ids      # [15496, 995] for GPT-2
    record, files = carried(ckpt)            # what a checkpoint carries (None, {}: nothing)
    tok = from_files(files, record)          # its tokenizer, checked against the record

Only the fast-tokenizer file is read (no vocab.json + merges.txt fallback, no Python code from
the directory); a model directory without one gets None and the caller picks another.

A checkpoint trained with a tokenizer keeps it (train/data.py's `carried`): extra["tokenizer"]
{name, sha256, eos_id, files} and the files themselves beside the blocks, each checked against
the sha256 the index records when read here. `export` writes them into the Hugging Face
directory, with a tokenizer_config.json (`tokenizer_config`) when the tokenizer came without
one, and takes the bos/eos/pad ids of its config from them (`special_ids`).
"""
from __future__ import annotations

import hashlib
import json
import os

from ..checkpoint.format import CheckpointError, read_asset
from ..train.tokenizer import BYTES, TOKENIZER_FILES, TOKENIZER_JSON

TOKENIZER = TOKENIZER_JSON
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL = ("bos", "eos", "pad")


def tokenizer(path):
    """tokenizers.Tokenizer from `path`/tokenizer.json, or None when the directory has none."""
    file = os.path.join(os.fspath(path), TOKENIZER)
    if not os.path.isfile(file):
        return None
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(file)
    except Exception as e:               # tokenizers raises its own Exception type
        raise ValueError(f"cannot read the tokenizer {file}: {e}") from None


def carried(ckpt) -> tuple:
    """(record, {file name: bytes}) of the tokenizer checkpoint `ckpt` (reader.Checkpoint)
    carries: its extra["tokenizer"] and the files it names, each checked against the index's
    sha256. (None, {}) for a checkpoint that records none; CheckpointError for a malformed
    record or a missing or corrupt file."""
    record = (ckpt.extra or {}).get("tokenizer")
    if record is None:
        return None, {}
    names = record.get("files") if isinstance(record, dict) else None
    if not (isinstance(names, list) and isinstance(record.get("name"), str)
            and all(n in TOKENIZER_FILES for n in names)):
        raise CheckpointError(f"checkpoint {ckpt.path}: extra's tokenizer record {record!r} "
                              f"is not {{name, sha256, files: some of {TOKENIZER_FILES}}}")
    return record, {n: read_asset(ckpt, n) for n in names}


def from_files(files: dict, record=None):
    """tokenizers.Tokenizer of files[tokenizer.json]; ValueError when it does not read or its
    sha256 (of the canonical JSON, train/tokenizer.py's identity) is not the record's."""
    from tokenizers import Tokenizer

    try:
        tok = Tokenizer.from_str(files[TOKENIZER].decode("utf-8"))
    except Exception as e:               # KeyError, UnicodeDecodeError, tokenizers' Exception
        raise ValueError(f"the carried {TOKENIZER} does not read as a tokenizer: {e}") from None
    want = (record or {}).get("sha256")
    got = hashlib.sha256(tok.to_str().encode()).hexdigest()
    if want is not None and got != want:
        raise ValueError(f"the carried {TOKENIZER} has sha256 {got[:16]}..., the checkpoint "
                         f"records {str(want)[:16]}... for {record.get('name')}")
    return tok


def is_bytes(record) -> bool:
    """Whether a checkpoint's tokenizer record says its ids are bytes."""
    return isinstance(record, dict) and record.get("name") == BYTES


def _config(files: dict) -> dict:
    try:
        cfg = json.loads(files[TOKENIZER_CONFIG].decode("utf-8"))
    except (KeyError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def _token_text(value):
    """A special token of tokenizer_config.json: a string, or {"content": ...}."""
    return value.get("content") if isinstance(value, dict) else value \
        if isinstance(value, str) else None


def eos_token(files: dict):
    """The text of the eos_token tokenizer_config.json of `files` names, else None."""
    return _token_text(_config(files).get("eos_token"))


def special_ids(files: dict, eos_id=None) -> dict:
    """{bos_token_id, eos_token_id, pad_token_id} of a tokenizer's files: the ids of the
    tokens tokenizer_config.json names; eos_id (the end-of-text id training put between
    documents) where it names no eos_token. Absent ids are left out."""
    cfg, tok = _config(files), from_files(files)
    out = {}
    for kind in SPECIAL:
        text = _token_text(cfg.get(f"{kind}_token"))
        found = tok.token_to_id(text) if text else None
        if found is not None:
            out[f"{kind}_token_id"] = int(found)
    if "eos_token_id" not in out and eos_id is not None:
        out["eos_token_id"] = int(eos_id)
    return out


def tokenizer_config(files: dict, model_max_length: int, eos_id=None) -> bytes:
    """The tokenizer_config.json written beside a tokenizer that came without one: the fast
    tokenizer class (so AutoTokenizer reads tokenizer.json as it is) and its eos token."""
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length,
           "clean_up_tokenization_spaces": False}
    if eos_id is not None:
        text = from_files(files).id_to_token(int(eos_id))
        if text is not None:
            cfg["eos_token"] = text
    return (json.dumps(cfg, indent=2, sort_keys=True) + "\n").encode()

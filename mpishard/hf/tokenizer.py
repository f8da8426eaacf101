"""The tokenizer of a Hugging Face directory: its `tokenizer.json`, read by `tokenizers`.

    tok = ms.hf.tokenizer("gpt2")            # tokenizers.Tokenizer, or None without the file
    ids = tok.encode("Hello world").ids      # [15496, 995] for GPT-2

Only the fast-tokenizer file is read (no vocab.json + merges.txt fallback, no Python code from
the directory); a model directory without one gets None and the caller picks another.
"""
from __future__ import annotations

import os

TOKENIZER = "tokenizer.json"


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

"""Examples: fine-tune records as token ids with a loss mask, one example per record.

    records = open_records("jsonl:chat.jsonl")                      # train/records.py
    splits, info = encode_records(records, tokenizer, records.kind)  # in memory
    ids, mask = splits["train"].example(0)       # the first training example's ids and mask

`ExampleTokens(ids, mask, starts)` is what the trainer reads, from memory (`encode_records`)
or from a version-2 token directory (example_tokens.read_examples, the same values):
- `ids`: every example's token ids, one after another (a numpy array of token_dtype, or a
  tokens.TokenFile; either is indexed by integer arrays);
- `mask`: as long as ids, uint8: 1 where predicting this token counts in the loss;
- `starts`: int64 (n_examples + 1,), the offset of each example's first token, the last one
  len(ids). An example may be empty (an empty text of the byte tokenizer).
The first token of an example has no earlier token of its own example, so it is never a
target inside it, whatever its mask: packing and padding (train/sft_rows.py) drop the target
that would cross into the next example.

Encoding, per kind of record (records.KINDS):
- text: the text's ids followed by eos (as `tokenize --text` encodes a file of that text:
  tokenizer.encode_documents on its UTF-8), every token counted;
- prompt/completion: the ids of prompt + completion, tokenized as one text (the tokenizer's
  own special tokens added, a Llama's BOS), followed by eos. The completion's tokens are found
  by character offsets, as TRL does: a token that holds any character of the completion
  counts (chat_template.span_mask), and so does the eos; the prompt's tokens and the special
  tokens the tokenizer adds (offsets 0..0) do not. The byte tokenizer's offsets are those of
  the UTF-8 bytes (ids are bytes; the byte tokenizer has no eos);
- messages: rendered with the chat template and tokenized as transformers'
  apply_chat_template does (chat_template.encode_chat), nothing appended; the assistant
  turns' tokens count. The template is `chat_template` (its text: a --chat-template FILE) or
  else the tokenizer's own (chat_template.chat_template_for).
A record that does not encode (a template that raises) is a ValueError naming where it is.

Validation: the last ceil(n * val_fraction) examples (text.split_point over examples), so the
split never cuts an example. `info` (and a token directory's header, the same fields) says
what was encoded: the records' source, kind and field names, their count, bytes and sha256
(of each record's fields as canonical JSON, so the same records read from JSONL, Parquet or
a saved dataset have the same sha256), the chat template's sha256 when one was used, and per
split the examples, tokens and counted tokens.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np

from .chat_template import chat_template_for, encode_chat, load_chat_template, span_mask
from .records import MESSAGES, PROMPT_COMPLETION, TEXT, Records, open_records
from .text import BYTES, DEFAULT_VAL_FRACTION, split_point
from .tokenizer import ENCODE_BATCH, encode_documents, token_dtype

COUNT_CHUNK = 1 << 22              # mask values summed at a time (a TokenFile is read in chunks)


@dataclass
class ExampleTokens:
    """Examples as one token sequence: ids, mask and starts (module docstring)."""
    ids: object
    mask: object
    starts: np.ndarray

    def __len__(self) -> int:
        return len(self.starts) - 1

    @property
    def n_tokens(self) -> int:
        return int(self.starts[-1])

    def lengths(self) -> np.ndarray:
        """Each example's number of tokens."""
        return np.diff(self.starts)

    def example(self, i: int) -> tuple:
        """(ids, mask) of example i."""
        idx = np.arange(self.starts[i], self.starts[i + 1])
        return self.ids[idx], self.mask[idx]

    def counted(self) -> int:
        """How many tokens count (the mask's sum), read a chunk at a time."""
        return sum(int(self.mask[np.arange(s, min(self.n_tokens, s + COUNT_CHUNK))].sum())
                   for s in range(0, self.n_tokens, COUNT_CHUNK))


def open_with_template(name: str, text_field=None, chat_template_file=None) -> tuple:
    """(records.open_records(name, text_field=...), the template of a --chat-template FILE or
    None): what `tokenize --dataset` and `train --dataset` encode. ValueError when a template
    is given for records that are not messages."""
    template = None if chat_template_file is None else load_chat_template(chat_template_file)
    records = open_records(name, text_field=text_field)
    if template is not None and records.kind != MESSAGES:
        raise ValueError(f"--chat-template applies to messages records; {name} holds "
                         f"{records.kind} records")
    return records, template


class Encoder:
    """Records to (ids, mask) per example (`examples`), tallying what `info` reports."""

    def __init__(self, records, tokenizer, kind=None, chat_template=None):
        self.records, self.tokenizer = records, tokenizer
        self.kind = kind or records.kind
        self.template = None                  # messages: the given text, else the tokenizer's
        if self.kind == MESSAGES:
            self.template = chat_template if chat_template is not None else \
                chat_template_for(tokenizer)
        self.dtype = token_dtype(tokenizer.vocab_size)
        self.eos = np.zeros(0, np.int64) if tokenizer.eos_id is None else \
            np.array([tokenizer.eos_id], np.int64)

    def examples(self):
        """Yield (ids of self.dtype, mask uint8) per record, ENCODE_BATCH records at a time
        (each pass tallies afresh)."""
        self.count, self.size, self.max_id, self.roles = 0, 0, -1, {}
        self.sha = hashlib.sha256()
        batch = []
        for record in self.records:
            self._tally(record)
            batch.append(record)
            if len(batch) == ENCODE_BATCH:
                yield from self._encode(batch)
                batch = []
        if batch:
            yield from self._encode(batch)

    def _tally(self, record):
        """Count the record and hash its fields as canonical JSON."""
        line = json.dumps(record.fields, ensure_ascii=False, sort_keys=True,
                          separators=(",", ":")).encode("utf-8") + b"\n"
        self.count, self.size = self.count + 1, self.size + len(line)
        self.sha.update(line)

    def _encode(self, batch):
        if self.kind == TEXT:
            docs = [r.fields["text"].encode() for r in batch]
            pairs = [(ids, np.ones(len(ids), np.uint8))
                     for ids in encode_documents(self.tokenizer, docs)]
        elif self.kind == PROMPT_COMPLETION:
            pairs = _prompt_completion(self.tokenizer, batch, self.eos)
        else:
            pairs = [self._chat(r) for r in batch]
        for ids, mask in pairs:
            if len(ids):
                self.max_id = max(self.max_id, int(ids.max()))
            yield ids.astype(self.dtype), mask

    def _chat(self, record):
        self.roles.update((m["role"], None) for m in record.fields["messages"])
        try:
            ids, mask = encode_chat(self.tokenizer, self.template, record.fields["messages"])
        except ValueError as exc:
            raise ValueError(f"{record.where}: {exc}") from None
        return ids, mask

    def check_counted(self, examples: int, counted: int) -> None:
        """ValueError when the training split's `examples` count no target (`counted` 0):
        training on them would learn nothing. Messages count their assistant turns only, so
        the hint names the roles found (ShareGPT's human/gpt count none)."""
        if counted:
            return
        if self.kind == MESSAGES:
            hint = (f"only the assistant turns count, and the messages' roles are "
                    f"{', '.join(map(repr, self.roles))}; the assistant turns must have role "
                    f"'assistant' (or train on every token: train --dataset "
                    f"{getattr(self.records, 'name', 'RECORDS')} --loss-on all)")
        else:
            hint = "every " + ("completion" if self.kind == PROMPT_COMPLETION else "text") + \
                " is empty"
        raise ValueError(f"the {examples} training example(s) count no token in the loss: "
                         f"{hint}")

    def info(self, splits: dict) -> dict:
        """What was encoded (module docstring); splits: {name: (examples, tokens, counted)}."""
        source = self.records.info() if isinstance(self.records, Records) else \
            {"kind": self.kind}
        template = None if self.template is None else \
            {"sha256": hashlib.sha256(self.template.encode()).hexdigest()}
        records = dict(source, count=self.count, bytes=self.size,
                       sha256=self.sha.hexdigest(), chat_template=template)
        out = {"records": records, "tokenizer": self.tokenizer.identity(),
               "eos_id": self.tokenizer.eos_id, "max_id": self.max_id,
               "corpus": {"source": records.get("source", "records"),
                          "files": records.get("files", 0), "bytes": self.size,
                          "sha256": records["sha256"]}}
        for name, (examples, tokens, counted) in splits.items():
            out[name] = {"examples": int(examples), "tokens": int(tokens),
                         "counted": int(counted)}
        return out


def _prompt_completion(tokenizer, batch, eos) -> list:
    """(ids int64, mask uint8) per prompt/completion record (module docstring)."""
    inner = getattr(tokenizer, "tokenizer", None)
    out = []
    if inner is None:
        if getattr(tokenizer, "name", None) != BYTES:
            raise TypeError(f"prompt/completion records need an HFTokenizer or the byte "
                            f"tokenizer, not {tokenizer!r}")
        for r in batch:
            prompt = r.fields["prompt"].encode()
            ids = np.frombuffer(prompt + r.fields["completion"].encode(), np.uint8)
            out.append((ids.astype(np.int64), (np.arange(len(ids)) >= len(prompt))
                        .astype(np.uint8)))
    else:
        texts = [r.fields["prompt"] + r.fields["completion"] for r in batch]
        for r, text, enc in zip(batch, texts, inner.encode_batch(texts)):
            span = [(len(r.fields["prompt"]), len(text))]
            out.append((np.asarray(enc.ids, np.int64), span_mask(enc.offsets, span)))
    return [(np.concatenate([ids, eos]), np.concatenate([mask, np.ones(len(eos), np.uint8)]))
            for ids, mask in out]


def split_examples(ids, mask, starts, val_fraction) -> dict:
    """{"train", "val"} ExampleTokens of in-memory examples: val the last ceil(n *
    val_fraction); ValueError when no example is left for training."""
    n = len(starts) - 1
    cut = split_point(n, val_fraction)
    if cut < 1:
        raise ValueError(f"{n} example(s): too few to keep one for training beside a "
                         f"validation fraction of {val_fraction}")
    at = int(starts[cut])
    return {"train": ExampleTokens(ids[:at], mask[:at], starts[:cut + 1].copy()),
            "val": ExampleTokens(ids[at:], mask[at:], starts[cut:] - starts[cut])}


def encode_records(records, tokenizer, kind=None, chat_template=None,
                   val_fraction=DEFAULT_VAL_FRACTION, require_counted=True) -> tuple:
    """({"train", "val"} ExampleTokens, info) of `records` (a records.Records, or any
    iterable of records.Record with `kind` given) encoded by `tokenizer` in memory; the same
    values example_tokens.write_examples writes and read_examples reads back. ValueError
    (Encoder.check_counted) when the training split counts no token and `require_counted`
    (a loss on every token, train's --loss-on all, does not ask it)."""
    split_point(1, val_fraction)                           # ValueError for a bad fraction
    encoder = Encoder(records, tokenizer, kind, chat_template)
    ids, masks = [], []
    for e_ids, e_mask in encoder.examples():
        ids.append(e_ids)
        masks.append(e_mask)
    starts = np.zeros(len(ids) + 1, np.int64)
    np.cumsum([len(i) for i in ids], out=starts[1:])
    splits = split_examples(np.concatenate(ids) if ids else np.zeros(0, encoder.dtype),
                            np.concatenate(masks) if masks else np.zeros(0, np.uint8),
                            starts, val_fraction)
    if require_counted:
        encoder.check_counted(len(splits["train"]), splits["train"].counted())
    info = encoder.info({k: (len(s), s.n_tokens, s.counted()) for k, s in splits.items()})
    return splits, info


__all__ = ["COUNT_CHUNK", "Encoder", "ExampleTokens", "encode_records", "open_with_template",
           "split_examples"]

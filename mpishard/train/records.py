"""Fine-tune records: JSONL, Parquet and saved Hugging Face datasets, read through `datasets`.

    records = open_records("jsonl:data/chat-*.jsonl")        # the kind found from record 1
    records = open_records("parquet:qa.parquet", kind=PROMPT_COMPLETION)
    records = open_records("hfdisk:saved", text_field="body")  # plain text in column "body"
    for record in records:                                    # every pass reads from the start
        record.fields, record.where     # {"messages": [...]}, "data/chat-1.jsonl line 7"

The `--dataset` names (`is_records_name`): `jsonl:FILE|GLOB` (JSON Lines, one object per
line), `parquet:FILE|GLOB` and `hfdisk:DIR` (a Dataset, or a DatasetDict's only or "train"
split, written by `save_to_disk`). A glob's files are read sorted by name, one after the
other. The `datasets` library does the reading (an optional package: the `sft` extra, `pip
install 'mpishard[sft]'`): JSONL and Parquet files stream (`load_dataset(..., streaming=True)`,
one file at a time), a saved dataset is memory-mapped Arrow (`load_from_disk`); either is
read ROWS_PER_READ rows at a time (`.iter(batch_size=...)`, several times faster than row by
row), so no set is materialised whole. (A streamed dataset imports torch when it is
installed: datasets' IterableDataset shares its epoch counter with torch's workers.)

JSON Lines stream through datasets' `text` builder, one row per line of the file, and each
line is parsed here with `json`; blank (whitespace-only) lines are skipped. Row i is then line
i + 1 exactly, and every valid JSON Lines file reads. The `json` builder would not do: it
gives rows, not lines (it skips blank lines, and a line it cannot parse fails the whole
block), and it fixes the columns from the first block of the file, so a field that first
appears past that block (valid JSON Lines) stops it.

Kinds (`KINDS`), one per data set, found from the first record unless `kind` is given:
- MESSAGES: a `messages` field, the OpenAI chat format: a non-empty list of {"role": str,
  "content": str} (chat_template.check_messages; other keys pass through to the template,
  keys whose value is None are dropped: Arrow adds them when it unifies the rows' structs);
- PROMPT_COMPLETION: string fields `prompt` and `completion`;
- TEXT: the string field `text_field` ("text" unless given; naming one implies TEXT).
The first of these a record has decides (a field that is null counts as absent: Arrow fills
the fields other rows have with null). Every record must then be of the same kind: one that
lacks its fields or holds another type is a ValueError naming where it is, and every rank,
reading the same data, raises the same one. Strings must be Unicode text: JSON can spell a
lone surrogate (which no tokenizer encodes), Arrow cannot. `Record.fields` holds the values
under the kind's canonical names (`FIELDS`: {"text"}, {"prompt", "completion"}, {"messages"}).

Where a record is (`Record.where`): "FILE line N" for JSONL (N counts from 1, as an editor
does), "FILE row N" for Parquet and "DIR row N" for a saved dataset (N counts from 0, the
index `Dataset[N]` and pandas use).
"""
from __future__ import annotations

import glob
import json
import os
import re
from typing import NamedTuple

from .chat_template import INSTALL, check_messages

JSONL, PARQUET, HFDISK = "jsonl", "parquet", "hfdisk"
FORMATS = (JSONL, PARQUET, HFDISK)
TEXT, PROMPT_COMPLETION, MESSAGES = "text", "prompt_completion", "messages"
KINDS = (TEXT, PROMPT_COMPLETION, MESSAGES)
FIELDS = {TEXT: ("text",), PROMPT_COMPLETION: ("prompt", "completion"),
          MESSAGES: ("messages",)}
DEFAULT_TEXT_FIELD = "text"
ROWS_PER_READ = 256
SURROGATE = re.compile(r"\\u[dD][89a-fA-F]")   # a JSON escape of a UTF-16 surrogate


def is_records_name(name) -> bool:
    """Whether a --dataset name is jsonl:, parquet: or hfdisk:."""
    return isinstance(name, str) and name.split(":", 1)[0] in FORMATS and ":" in name


class Record(NamedTuple):
    """One record: its values under the kind's canonical names, and where it is."""
    fields: dict
    where: str


def _datasets():
    """The datasets module (an optional package: the `sft` extra)."""
    try:
        import datasets
    except ImportError:
        raise ValueError(f"reading JSONL, Parquet and saved datasets needs the Hugging Face "
                         f"datasets library: {INSTALL}") from None
    return datasets


def _files(name: str, fmt: str, path: str) -> list:
    """The files of FILE|GLOB, sorted (ValueError when none, or for a directory)."""
    if os.path.isdir(path):
        raise ValueError(f"--dataset {name}: {path} is a directory; give a file or a glob "
                         f"({os.path.join(path, '*.' + fmt)})")
    files = [path] if os.path.isfile(path) else sorted(
        f for f in glob.glob(path, recursive=True) if os.path.isfile(f))
    if not files:
        raise ValueError(f"--dataset {name}: no file matches {path}")
    return files


def _check_object(row, where: str):
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a record is a JSON object, not {type(row).__name__}")


def _check_fields(row, kind: str, text_field: str, where: str) -> dict:
    """The canonical fields of `row` for `kind` (module docstring), or a ValueError."""
    _check_object(row, where)
    names = (text_field,) if kind == TEXT else FIELDS[kind]
    for name in names:
        if row.get(name) is None:
            what = "is null" if name in row else "is missing"
            raise ValueError(f"{where}: the record's field {name!r} {what} (the data set's "
                             f"records are {_describe(kind, text_field)})")
    if kind == MESSAGES:
        try:
            check_messages(row["messages"])
        except ValueError as exc:
            raise ValueError(f"{where}: field 'messages': {exc}") from None
        return {"messages": [{k: v for k, v in m.items() if v is not None}
                             for m in row["messages"]]}
    for name in names:
        if not isinstance(row[name], str):
            raise ValueError(f"{where}: field {name!r} must be a string "
                             f"({type(row[name]).__name__})")
    return dict(zip(FIELDS[kind], (row[n] for n in names)))


def _describe(kind: str, text_field: str) -> str:
    return {TEXT: f"plain text in {text_field!r}", PROMPT_COMPLETION: "prompt/completion pairs",
            MESSAGES: "chat messages"}[kind]


def detect_kind(row, text_field: str, where: str) -> str:
    """The kind a first record shows: messages, else prompt and completion, else text_field
    (fields that are null count as absent); ValueError naming its fields when none fits."""
    _check_object(row, where)
    present = sorted(k for k, v in row.items() if v is not None)
    if "messages" in present:
        return MESSAGES
    if "prompt" in present and "completion" in present:
        return PROMPT_COMPLETION
    if text_field in present:
        return TEXT
    raise ValueError(f"{where}: a record needs the field {text_field!r} (or --text-field "
                     f"NAME), 'prompt' and 'completion', or 'messages'; it has {present}")


class Records:
    """The records of a `--dataset` name (module docstring): iterate for `Record`s, each pass
    from the start. `kind` and `fields` (the data set's own field names) are known once made;
    `info()` is what a token file's header records of the source."""

    def __init__(self, name: str, kind=None, text_field=None):
        if not is_records_name(name):
            raise ValueError(f"--dataset {name!r} is not one of "
                             f"{', '.join(f + ':' for f in FORMATS)}")
        if kind is not None and kind not in KINDS:
            raise ValueError(f"record kind {kind!r} is not one of {', '.join(KINDS)}")
        if text_field is not None and kind not in (None, TEXT):
            raise ValueError(f"a text field applies to plain text records, not {kind}")
        self.name = name
        self.format, self.path = name.split(":", 1)
        if not self.path:
            raise ValueError(f"--dataset {name!r}: give a path, {self.format}:PATH")
        self.text_field = text_field or DEFAULT_TEXT_FIELD
        _datasets()
        if self.format == HFDISK:
            if not os.path.isdir(self.path):
                raise ValueError(f"--dataset {name}: {self.path} is not a directory")
            self.files = [self.path]
        else:
            self.files = _files(name, self.format, self.path)
        self.kind = TEXT if text_field is not None and kind is None else kind
        if self.kind is None:
            first = next(self._rows(), None)
            if first is None:
                raise ValueError(f"--dataset {name}: no records")
            self.kind = detect_kind(first[0], self.text_field, first[1])
        self.fields = [self.text_field] if self.kind == TEXT else list(FIELDS[self.kind])

    def info(self) -> dict:
        return {"source": self.name, "format": self.format, "files": len(self.files),
                "kind": self.kind, "fields": list(self.fields)}

    def __iter__(self):
        count = 0
        for row, where in self._rows():
            count += 1
            yield Record(_check_fields(row, self.kind, self.text_field, where), where)
        if not count:
            raise ValueError(f"--dataset {self.name}: no records")

    def __repr__(self) -> str:
        return f"Records({self.name}, {self.kind}, {len(self.files)} file(s))"

    # -- the formats -------------------------------------------------------------------------
    def _rows(self):
        """(row dict, where) of every record, in order."""
        if self.format == HFDISK:
            yield from self._saved()
            return
        for path in self.files:
            yield from (self._jsonl(path) if self.format == JSONL else self._parquet(path))

    def _jsonl(self, path: str):
        """Each non-blank line of `path` parsed (module docstring)."""
        lines = _stream("text", path)
        number = 0
        while True:
            try:
                batch = next(lines)
            except StopIteration:
                return
            except UnicodeDecodeError:
                raise ValueError(_not_utf8(path)) from None
            for line in batch["text"]:
                number += 1
                if line.strip():
                    yield _parse(line, f"{path} line {number}"), f"{path} line {number}"

    def _parquet(self, path: str):
        try:
            yield from _numbered(_stream("parquet", path), f"{path} row")
        except Exception as exc:             # pyarrow's errors name no file
            raise ValueError(f"{path}: the datasets Parquet loader failed: "
                             f"{type(exc).__name__}: {exc}") from None

    def _saved(self):
        datasets = _datasets()
        try:
            saved = datasets.load_from_disk(self.path)
        except (FileNotFoundError, ValueError) as exc:
            raise ValueError(f"--dataset {self.name}: not a saved dataset ({exc})") from None
        where = self.path
        if isinstance(saved, datasets.DatasetDict):
            split = next(iter(saved)) if len(saved) == 1 else "train"
            if split not in saved:
                raise ValueError(f"--dataset {self.name}: a DatasetDict of splits "
                                 f"{sorted(saved)}, none named 'train'; save the split to "
                                 f"train on")
            saved, where = saved[split], f"{self.path} split {split}"
        yield from _numbered(saved.iter(batch_size=ROWS_PER_READ), f"{where} row")


def _stream(builder: str, path: str):
    """The batches ({column: values}) of one file, streamed by a datasets builder."""
    return iter(_datasets().load_dataset(builder, data_files=[path], split="train",
                                         streaming=True).iter(batch_size=ROWS_PER_READ))


def _numbered(batches, where: str):
    """(row dict, "WHERE N") of each row of columnar batches, N from 0."""
    number = 0
    for batch in batches:
        names = list(batch)
        for values in zip(*batch.values()):
            yield dict(zip(names, values)), f"{where} {number}"
            number += 1


def _parse(line: str, where: str):
    """A JSON line's value; ValueError naming `where` for bad JSON or a lone surrogate."""
    try:
        row = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"{where}: not valid JSON ({exc})") from None
    if SURROGATE.search(line):
        try:
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where}: the record holds a lone surrogate, which is not "
                             f"Unicode text") from None
    return row


def _not_utf8(path: str) -> str:
    """The error for a file the text reader could not decode: its first line that is not
    UTF-8."""
    with open(path, "rb") as f:
        for number, line in enumerate(f, 1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                return f"{path} line {number}: not UTF-8 text ({exc.reason} at byte " \
                       f"{exc.start})"
    return f"{path}: not UTF-8 text"


def open_records(name: str, kind=None, text_field=None) -> Records:
    """The Records of `name` (jsonl:FILE|GLOB, parquet:FILE|GLOB or hfdisk:DIR); kind: one of
    KINDS or None to find it from the first record; text_field: the plain-text field (naming
    it implies TEXT). ValueError for a bad name, no files, or a first record of no kind."""
    return Records(name, kind, text_field)


__all__ = ["FIELDS", "FORMATS", "HFDISK", "JSONL", "KINDS", "MESSAGES", "PARQUET",
           "PROMPT_COMPLETION", "Record", "Records", "TEXT", "detect_kind", "is_records_name",
           "open_records"]

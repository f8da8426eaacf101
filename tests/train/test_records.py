"""Fine-tune records (train/records.py): JSONL, Parquet and saved datasets read through the
`datasets` library, the kind found from the first record, and errors that name the file and
the line (JSONL, counted from 1 past blank lines) or the row (Parquet, a saved dataset).

    pytest -m "not mpi" tests/train/test_records.py
"""
import json
import sys

import pytest

from mpishard.train.records import (MESSAGES, PROMPT_COMPLETION, TEXT, is_records_name,
                                    open_records)

try:
    import datasets
except ImportError:                  # test_tokenize.py imports the helpers below even so
    datasets = None
pytestmark = pytest.mark.skipif(datasets is None, reason="needs datasets (the sft extra)")

CHAT = [{"messages": [{"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello, naïve café"}]},
        {"messages": [{"role": "system", "content": "be brief"},
                      {"role": "user", "content": "2+2?"},
                      {"role": "assistant", "content": "4", "name": "calc"}]}]
PAIRS = [{"prompt": "Q: 東京?\nA:", "completion": " a city"}, {"prompt": "x", "completion": "y"},
         {"prompt": "", "completion": "only"}]
TEXTS = [{"text": "one"}, {"text": "two ✓", "extra": 3}, {"text": ""}]


def write_jsonl(path, rows, blank=()):
    """rows as JSON Lines; a blank (or whitespace-only) line before the rows in `blank`."""
    with open(path, "w") as f:
        for i, row in enumerate(rows):
            if i in blank:
                f.write("\n   \t\n")
            f.write((row if isinstance(row, str) else json.dumps(row)) + "\n")
    return str(path)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def save_to_disk(path, rows):
    datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return str(path)


def read(name, **kwargs):
    return [(r.fields, r.where) for r in open_records(name, **kwargs)]


def test_the_three_formats_and_kinds(tmp_path):
    """JSONL (blank lines skipped but counted; fields that differ from line to line),
    Parquet and a saved dataset give the same canonical fields; the kind comes from the first
    record; a message's null keys (Arrow's struct unification) are dropped."""
    jsonl = write_jsonl(tmp_path / "chat.jsonl", CHAT, blank=(0, 1))
    got = read(f"jsonl:{jsonl}")
    assert [w for _, w in got] == [f"{jsonl} line 3", f"{jsonl} line 6"]
    assert [f for f, _ in got] == CHAT
    parquet = write_parquet(tmp_path / "chat.parquet", CHAT)
    assert read(f"parquet:{parquet}") == [(CHAT[0], f"{parquet} row 0"),
                                          (CHAT[1], f"{parquet} row 1")]
    saved = save_to_disk(tmp_path / "saved", CHAT)
    assert [f for f, _ in read(f"hfdisk:{saved}")] == CHAT
    records = open_records(f"hfdisk:{saved}")
    assert records.kind == MESSAGES and records.fields == ["messages"]
    assert records.info() == {"source": f"hfdisk:{saved}", "format": "hfdisk", "files": 1,
                              "kind": MESSAGES, "fields": ["messages"]}
    pairs = open_records(f"jsonl:{write_jsonl(tmp_path / 'p.jsonl', PAIRS)}")
    assert pairs.kind == PROMPT_COMPLETION and [r.fields for r in pairs] == PAIRS
    texts = open_records(f"parquet:{write_parquet(tmp_path / 't.parquet', TEXTS)}")
    assert texts.kind == TEXT and [r.fields for r in texts] == [{"text": t["text"]}
                                                                for t in TEXTS]


def test_a_glob_reads_its_files_sorted_and_a_text_field(tmp_path):
    b = write_jsonl(tmp_path / "b.jsonl", [{"body": "3"}])
    a = write_jsonl(tmp_path / "a.jsonl", [{"body": "1"}, {"body": "2"}], blank=(1,))
    got = read(f"jsonl:{tmp_path}/*.jsonl", text_field="body")
    assert got == [({"text": "1"}, f"{a} line 1"), ({"text": "2"}, f"{a} line 4"),
                   ({"text": "3"}, f"{b} line 1")]
    assert open_records(f"jsonl:{a}", text_field="body").fields == ["body"]
    dd = datasets.DatasetDict(train=datasets.Dataset.from_list(TEXTS),
                              test=datasets.Dataset.from_list(TEXTS[:1]))
    dd.save_to_disk(str(tmp_path / "dd"))
    assert read(f"hfdisk:{tmp_path}/dd")[1] == ({"text": "two ✓"},
                                                f"{tmp_path}/dd split train row 1")


@pytest.mark.parametrize("rows,blank,message", [
    (PAIRS[:1] + [{"prompt": "p"}], (1,), "line 4: the record's field 'completion' is missing "
     r"\(the data set's records are prompt/completion pairs\)"),
    (PAIRS[:2] + [{"prompt": "p", "completion": 5}], (), "line 3: field 'completion' must be "
     r"a string \(int\)"),
    (TEXTS[:1] + [{"text": ["a"]}], (1,), r"line 4: field 'text' must be a string \(list\)"),
    (TEXTS[:1] + [{"text": None}], (), "line 2: the record's field 'text' is null"),
    (PAIRS[:1] + [{"prompt": "p", "completion": None}], (), "line 2: the record's field "
     "'completion' is null"),
    (CHAT[:1] + [{"messages": [{"role": "user", "content": 3}]}], (1,),
     r"line 4: field 'messages': message 0: 'content' must be a string \(int\)"),
    (CHAT[:1] + [{"messages": []}], (), "line 2: field 'messages': messages must be a "
     "non-empty list"),
    (CHAT[:1] + PAIRS[:1], (), "line 2: the record's field 'messages' is missing"),
    ([{"question": "q"}], (), r"line 1: a record needs the field 'text' \(or --text-field "
     r"NAME\), 'prompt' and 'completion', or 'messages'; it has \['question'\]"),
    (TEXTS[:2] + ['{"text": "cut'], (2,), "line 5: not valid JSON"),
    (TEXTS[:1] + ["[1, 2]"], (), "line 2: a record is a JSON object, not list"),
    (TEXTS[:1] + ['{"text": "b \\ud800"}'], (), "line 2: the record holds a lone surrogate"),
])
def test_a_bad_jsonl_record_names_its_file_and_line(tmp_path, rows, blank, message):
    path = write_jsonl(tmp_path / "bad.jsonl", rows, blank)
    with pytest.raises(ValueError, match=f"^{path} {message}"):
        read(f"jsonl:{path}")


def test_a_bad_row_of_parquet_or_a_saved_dataset_names_it(tmp_path):
    path = write_parquet(tmp_path / "bad.parquet", PAIRS[:2] + [{"prompt": "p"}])
    with pytest.raises(ValueError, match=f"^{path} row 2: the record's field "
                       "'completion' is null"):
        read(f"parquet:{path}")
    saved = save_to_disk(tmp_path / "bad", [{"text": "a"}, {"text": None}])
    with pytest.raises(ValueError, match=f"^{saved} row 1: the record's field 'text' is null"):
        read(f"hfdisk:{saved}")


def test_names_and_sources_that_are_refused(tmp_path, monkeypatch):
    assert is_records_name("jsonl:x") and is_records_name("hfdisk:d")
    assert not is_records_name("tokens:x") and not is_records_name("jsonl")
    array = tmp_path / "array.jsonl"
    array.write_text(json.dumps(PAIRS))
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9 ok"}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    dd = datasets.DatasetDict(a=datasets.Dataset.from_list(TEXTS),
                              b=datasets.Dataset.from_list(TEXTS))
    dd.save_to_disk(str(tmp_path / "dd"))
    cases = [("jsonl:", {}, "give a path"),
             (f"jsonl:{tmp_path}/none*.jsonl", {}, "no file matches"),
             (f"jsonl:{tmp_path}", {}, "is a directory; give a file or a glob"),
             (f"jsonl:{array}", {}, "line 1: a record is a JSON object, not list"),
             (f"jsonl:{latin}", {}, r"line 2: not UTF-8 text \(invalid continuation byte"),
             (f"jsonl:{empty}", {}, "no records"),
             (f"hfdisk:{tmp_path}/nothing", {}, "is not a directory"),
             (f"hfdisk:{tmp_path}/dd", {}, r"splits \['a', 'b'\], none named 'train'"),
             ("csv:x", {}, "is not one of jsonl:, parquet:, hfdisk:"),
             (f"jsonl:{array}", {"kind": "chat"}, "record kind 'chat' is not one of"),
             (f"jsonl:{array}", {"kind": MESSAGES, "text_field": "t"},
              "a text field applies to plain text records")]
    for name, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            read(name, **kwargs)
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(ValueError, match=r"needs the Hugging Face datasets library: pip "
                       r"install 'mpishard\[sft\]'"):
        open_records(f"jsonl:{array}")


def test_a_told_kind_is_required_of_every_record(tmp_path):
    path = write_jsonl(tmp_path / "mixed.jsonl", [{"text": "t", "prompt": "p",
                                                    "completion": "c"}, {"text": "u"}])
    assert open_records(f"jsonl:{path}", kind=TEXT).kind == TEXT
    assert len(read(f"jsonl:{path}", kind=TEXT)) == 2
    with pytest.raises(ValueError, match="line 2: the record's field 'prompt' is missing"):
        read(f"jsonl:{path}")                       # the first record is a prompt/completion

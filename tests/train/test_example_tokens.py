"""Examples (train/examples.py, train/example_tokens.py): records encoded with their loss
masks, the examples' split, and the version-2 token directory that holds exactly what
encode_records makes in memory. The Hugging Face tokenizer is a byte-level BPE trained here
with the `tokenizers` library (no downloads).

    pytest -m "not mpi" tests/train/test_examples.py
"""
import hashlib
import json
import math
import os

import numpy as np
import pytest

from mpishard.train.chat_template import encode_chat
from mpishard.train.example_tokens import read_examples, write_examples
from mpishard.train.examples import ExampleTokens, encode_records
from mpishard.train.records import PROMPT_COMPLETION, Record, open_records
from mpishard.train.text import split_point
from mpishard.train.tokenizer import ByteTokenizer, HFTokenizer, encode_documents
from mpishard.train.tokens import EXAMPLE_FILES, read_header, token_dataset, write_tokens

from test_records import PAIRS, save_to_disk, write_jsonl, write_parquet

tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

EOS = "<|endoftext|>"
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATS = [{"messages": [{"role": "user", "content": f"what is {i} + {i}?"},
                       {"role": "assistant", "content": f"{i} + {i} is {2 * i}, naïvely."},
                       {"role": "user", "content": "thanks"},
                       {"role": "assistant", "content": "you're welcome"}]} for i in range(7)]
QA = [{"prompt": f"Question {i}: where is 東京?\nAnswer:", "completion": f" in Japan, {i}"}
      for i in range(5)] + PAIRS
TEXTS = [{"text": f"document {i}: the café is open ✓ " * (i + 1)} for i in range(6)]


def bpe(bos=False):
    """An HFTokenizer: byte-level BPE (320 ids) trained on the records' text, EOS id 0, the
    ChatML markers as special tokens; with bos, a post-processor that puts <s> first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, show_progress=False,
                                  special_tokens=[EOS, "<s>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = [json.dumps(r, ensure_ascii=False) for r in CHATS + QA + TEXTS] * 3
    tok.train_from_iterator(corpus, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                           special_tokens=[("<s>", 1)])
    return HFTokenizer(tok, "test-bpe", eos_token=EOS)


@pytest.fixture(scope="module")
def hf():
    return bpe()


def records(tmp_path, rows, name="r.jsonl"):
    return open_records(f"jsonl:{write_jsonl(tmp_path / name, rows, blank=(1,))}")


def examples(splits):
    """[(ids, mask)] of every example, train then val, as int64 and uint8 lists."""
    return [tuple(a.tolist() for a in s.example(i)) for s in (splits["train"], splits["val"])
            for i in range(len(s))]


def test_text_is_its_documents_and_every_token_counts(tmp_path, hf):
    """A text record encodes as `tokenize --text` encodes a file of that text: the ids of its
    UTF-8 and eos (none for bytes), every token counted."""
    data = records(tmp_path, TEXTS)
    for tok in (ByteTokenizer(), hf):
        splits, info = encode_records(data, tok, val_fraction=0.3)
        want = [ids.tolist() for ids in encode_documents(tok, [t["text"].encode()
                                                               for t in TEXTS])]
        got = examples(splits)
        assert [ids for ids, _ in got] == want and all(set(m) == {1} for _, m in got)
        assert (want[0][-1] == 0) == (tok is hf)
        assert info["train"] == {"examples": 4, "tokens": sum(map(len, want[:4])),
                                 "counted": sum(map(len, want[:4]))}


def test_prompt_completion_bytes_count_from_the_completions_first_byte(tmp_path):
    splits, info = encode_records(records(tmp_path, QA), ByteTokenizer(), val_fraction=0.2)
    for (ids, mask), row in zip(examples(splits), QA):
        prompt, completion = row["prompt"].encode(), row["completion"].encode()
        assert bytes(ids) == prompt + completion
        assert mask == [0] * len(prompt) + [1] * len(completion)
    assert info["records"]["kind"] == PROMPT_COMPLETION
    assert info["train"]["counted"] + info["val"]["counted"] == sum(
        len(r["completion"].encode()) for r in QA)


@pytest.mark.parametrize("bos", [False, True])
def test_prompt_completion_masks_are_trls(tmp_path, bos):
    """The ids are prompt + completion tokenized as one text, then eos; the mask is TRL's
    (0 on the prompt's ids, 1 on the rest) where the prompt's ids are a prefix, and the
    post-processor's BOS counts nowhere."""
    tok = bpe(bos)
    splits, _ = encode_records(records(tmp_path, QA), tok, val_fraction=0.2)
    for (ids, mask), row in zip(examples(splits), QA):
        whole = tok.tokenizer.encode(row["prompt"] + row["completion"]).ids
        prompt = tok.tokenizer.encode(row["prompt"]).ids
        assert whole[:len(prompt)] == prompt              # the prefix holds for these
        assert ids == whole + [tok.eos_id]
        assert mask == [0] * len(prompt) + [1] * (len(whole) - len(prompt)) + [1]
        assert (ids[0] == 1 and mask[0] == 0) == bos


def test_a_token_that_spans_the_boundary_counts(tmp_path):
    """'ab' + 'c' tokenized as one token 'abc': it holds a completion character, so it
    counts (the character-offset rule; TRL's prompt-length rule would mark it prompt)."""
    from tokenizers import Tokenizer, models

    tok = Tokenizer(models.BPE({"a": 0, "b": 1, "c": 2, "ab": 3, "abc": 4, "d": 5},
                               [("a", "b"), ("ab", "c")]))
    rows = [{"prompt": "ab", "completion": "cd"}, {"prompt": "a", "completion": "bc"}]
    splits, _ = encode_records(records(tmp_path, rows), HFTokenizer(tok, "tiny"),
                               val_fraction=0.5)
    assert examples(splits) == [([4, 5], [1, 1]), ([4], [1])]


def test_messages_render_with_the_template(tmp_path, hf):
    """messages encode as chat_template.encode_chat (transformers' apply_chat_template): the
    assistant turns count; the template's sha256 is recorded; no template, or one that
    raises, is an error naming the record."""
    data = records(tmp_path, CHATS)
    splits, info = encode_records(data, hf, chat_template=CHATML, val_fraction=0.3)
    want = [encode_chat(hf, CHATML, r["messages"]) for r in CHATS]
    assert examples(splits) == [(i.tolist(), m.tolist()) for i, m in want]
    assert 0 < info["train"]["counted"] < info["train"]["tokens"]
    assert info["records"]["chat_template"] == {
        "sha256": hashlib.sha256(CHATML.encode()).hexdigest()}
    with pytest.raises(ValueError, match="has no chat template .*; give --chat-template FILE"):
        encode_records(data, hf)
    strict = "{% if messages[0].content == 'thanks' %}{{ raise_exception('no thanks') }}" \
             "{% endif %}" + CHATML
    rows = CHATS[:2] + [{"messages": CHATS[0]["messages"][2:]}]
    with pytest.raises(ValueError, match=r"bad.jsonl line 5: the chat template failed: no "
                       r"thanks"):
        encode_records(records(tmp_path, rows, "bad.jsonl"), hf, chat_template=strict)


def test_the_split_keeps_the_last_examples_for_validation(tmp_path):
    data = records(tmp_path, TEXTS)
    splits, info = encode_records(data, ByteTokenizer(), val_fraction=0.3)
    n_val = math.ceil(len(TEXTS) * 0.3)
    assert (len(splits["train"]), len(splits["val"])) == (len(TEXTS) - n_val, n_val)
    assert split_point(len(TEXTS), 0.3) == len(TEXTS) - n_val
    lengths = [len(t["text"].encode()) for t in TEXTS]
    assert splits["val"].starts.tolist() == [0, *np.cumsum(lengths[-n_val:]).tolist()]
    assert splits["train"].lengths().tolist() == lengths[:-n_val]
    assert info["val"]["counted"] == splits["val"].counted() == sum(lengths[-n_val:])
    one = [Record({"text": "x"}, "here")]
    with pytest.raises(ValueError, match="1 example.s.: too few to keep one for training"):
        encode_records(one, ByteTokenizer(), "text")


@pytest.mark.parametrize("kind", ["text", "prompt_completion", "messages"])
def test_the_token_directory_holds_what_encode_records_makes(tmp_path, hf, kind):
    """write_examples -> read_examples equals encode_records in memory: ids, masks, starts,
    counts; the header records the source, kind, fields, template and counted tokens."""
    rows = {"text": TEXTS, "prompt_completion": QA, "messages": CHATS}[kind]
    data = records(tmp_path, rows)
    template = CHATML if kind == "messages" else None
    memory, info = encode_records(data, hf, chat_template=template, val_fraction=0.25)
    header = write_examples(str(tmp_path / "tok"), hf, data, chat_template=template,
                            val_fraction=0.25)
    disk, read = read_examples(str(tmp_path / "tok"))
    assert read == header and header["version"] == 2 and header["records"] == info["records"]
    assert header["records"]["fields"] == list(data.fields) and header["records"]["count"] == \
        len(rows)
    for split in ("train", "val"):
        a, b = memory[split], disk[split]
        idx = np.arange(a.n_tokens)
        assert np.array_equal(a.starts, b.starts) and a.ids.dtype == b.ids[idx].dtype
        assert np.array_equal(a.ids, b.ids[idx]) and np.array_equal(a.mask, b.mask[idx])
        assert header["examples"][split]["counted"] == b.counted() == info[split]["counted"]
        assert header[split]["count"] == info[split]["tokens"]
        assert header["examples"][split]["count"] == len(b) == info[split]["examples"]
    assert examples(memory) == examples(disk)


def test_the_same_records_from_any_format_are_the_same_examples(tmp_path, hf):
    """JSONL, Parquet and a saved dataset of the same records: the same ids and masks, and
    the same records sha256."""
    names = [f"jsonl:{write_jsonl(tmp_path / 'q.jsonl', QA)}",
             f"parquet:{write_parquet(tmp_path / 'q.parquet', QA)}",
             f"hfdisk:{save_to_disk(tmp_path / 'q', QA)}"]
    got = [encode_records(open_records(n), hf) for n in names]
    assert all(examples(s) == examples(got[0][0]) for s, _ in got)
    assert len({i["records"]["sha256"] for _, i in got}) == 1


def test_versions_one_and_two_share_a_directory_but_not_a_reader(tmp_path, hf):
    """A version-1 write over a version-2 directory removes the example files; read_examples
    refuses version 1; token_dataset reads version 2's tokens; a short mask or bad starts
    stop read_examples."""
    out = str(tmp_path / "tok")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("plain text " * 50)
    data = records(tmp_path, TEXTS * 3)
    write_examples(out, hf, data)
    assert token_dataset(f"tokens:{out}", 8).x_train.shape[1] == 8
    write_tokens(out, hf, str(corpus))
    assert read_header(out)["version"] == 1 and not set(EXAMPLE_FILES) & set(os.listdir(out))
    with pytest.raises(ValueError, match="version 1 holds tokens, not examples"):
        read_examples(out)
    header = write_examples(out, hf, data)
    with open(os.path.join(out, "val.mask.bin"), "ab") as f:
        f.write(b"\x01")
    with pytest.raises(ValueError, match="examples.val.mask: val.mask.bin should have "
                       f"{header['val']['count']} bytes"):
        read_examples(out)
    write_examples(out, hf, data)
    starts = np.fromfile(os.path.join(out, "train.starts.bin"), np.int64)
    starts[1:3] = starts[2:0:-1]
    starts.tofile(os.path.join(out, "train.starts.bin"))
    with pytest.raises(ValueError, match="starts do not run from 0 to .* without decreasing"):
        read_examples(out)


def test_example_tokens_in_memory():
    ex = ExampleTokens(np.arange(6), np.array([0, 1, 1, 0, 0, 1], np.uint8),
                       np.array([0, 2, 2, 6]))
    assert len(ex) == 3 and ex.n_tokens == 6 and ex.counted() == 3
    assert ex.lengths().tolist() == [2, 0, 4]
    assert [a.tolist() for a in ex.example(2)] == [[2, 3, 4, 5], [1, 0, 0, 1]]
    assert [a.tolist() for a in ex.example(1)] == [[], []]


def test_empty_examples_and_an_empty_split_read_back(tmp_path):
    """An empty text of the byte tokenizer is an example of no tokens; a validation split of
    only such examples is a file of no tokens, which reads back (nothing to map)."""
    rows = [{"text": "abc"}, {"text": ""}, {"text": "de"}, {"text": ""}]
    data = records(tmp_path, rows)
    memory, _ = encode_records(data, ByteTokenizer(), val_fraction=0.25)
    write_examples(str(tmp_path / "tok"), ByteTokenizer(), data, val_fraction=0.25)
    disk, header = read_examples(str(tmp_path / "tok"))
    assert header["val"]["count"] == 0 and disk["val"].starts.tolist() == [0, 0]
    assert examples(disk) == examples(memory) == [([97, 98, 99], [1, 1, 1]), ([], []),
                                                  ([100, 101], [1, 1]), ([], [])]
    assert disk["val"].counted() == 0 and disk["train"].lengths().tolist() == [3, 0, 2]

"""What a new user of the fine-tune path is told: a --chat-template that travels with the
tokenizer (token directory, in-memory run, checkpoint), and the one-line errors and log
counts of tokenize and train (cli/tokenize.py, cli/sft_options.py, cli/token_options.py,
train/examples.py, train/sft_rows.py).

    pytest -m "not mpi" tests/cli/test_sft_usage.py
"""
import logging
import os

import numpy as np
import pytest

import mpishard as ms
from mpishard import cli
from mpishard.cli.sft_options import log_examples
from mpishard.cli.token_options import header_tokenizer
from mpishard.cli.train import parse_train_args, prepare_training, validate_train_args
from mpishard.cli.usage import UsageError
from mpishard.train.tokens import read_header

from test_records import write_jsonl
from test_sft_options import GPT, RUN, TEMPLATE, OneRank
from test_tokens import VOCAB, train_bpe, write_corpus

pytest.importorskip("datasets")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")
JINJA = "chat_template.jinja"


def chats(n, user="user", assistant="assistant"):
    return [{"messages": [{"role": user, "content": f"say {i}"},
                          {"role": assistant, "content": f"{i} said"}]} for i in range(n)]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = tmp_path_factory.mktemp("usage")
    train_bpe(write_corpus(str(root / "corpus"))).save(str(root / "tokenizer.json"))
    (root / "chat.jinja").write_text(TEMPLATE)
    write_jsonl(root / "chat.jsonl", chats(24))
    write_jsonl(root / "sharegpt.jsonl", chats(8, "human", "gpt"))
    write_jsonl(root / "users.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}] * 8)
    return root


def tokenize(root, out, data, *extra, tokenizer=None):
    return cli.main(["tokenize", "--tokenizer", tokenizer or str(root / "tokenizer.json"),
                     "--dataset", f"jsonl:{root / data}", "--out", str(root / out), *extra])


def prepared(argv):
    return prepare_training(parse_train_args(argv), OneRank())


# -- the chat template travels with the tokenizer ---------------------------------------------
def test_a_chat_template_flag_is_carried_as_the_tokenizers_jinja_file(root):
    assert tokenize(root, "chat-tok", "chat.jsonl", "--chat-template",
                    str(root / "chat.jinja")) == 0
    directory = str(root / "chat-tok")
    header = read_header(directory)
    assert JINJA in header["tokenizer"]["files"]
    with open(os.path.join(directory, JINJA)) as f:
        assert f.read() == TEMPLATE
    record, files = header_tokenizer(header["tokenizer"], directory).carried()
    assert JINJA in record["files"] and files[JINJA] == TEMPLATE.encode()
    trained = prepared([*GPT, "--dataset", f"tokens:{directory}"])[-1]
    assert trained.tokenizer.carried()[1][JINJA] == TEMPLATE.encode()
    given = prepared([*GPT, "--dataset", f"tokens:{directory}", "--tokenizer",
                      str(root / "tokenizer.json")])[-1]           # its own has no template
    assert given.tokenizer.carried()[1][JINJA] == TEMPLATE.encode()
    # in memory: the run's tokenizer carries it; its identity is tokenizer.json's alone
    memory = prepared([*GPT, "--dataset", f"jsonl:{root / 'chat.jsonl'}", "--tokenizer",
                       str(root / "tokenizer.json"), "--chat-template",
                       str(root / "chat.jinja")])[-1]
    assert memory.tokenizer.carried()[1][JINJA] == TEMPLATE.encode()
    assert memory.tokenizer.identity() == trained.tokenizer.identity()
    # without the flag no template file appears
    plain = prepared([*GPT, "--dataset", f"jsonl:{root / 'chat.jsonl'}", "--tokenizer",
                      "bytes", "--chat-template", str(root / "chat.jinja")])[-1]
    assert plain.tokenizer.carried()[1] == {}          # bytes carry no files


# -- data sets that count nothing -------------------------------------------------------------
def test_messages_without_assistant_turns_are_refused_with_the_roles_found(root, capsys):
    template = ["--chat-template", str(root / "chat.jinja")]
    assert tokenize(root, "share-tok", "sharegpt.jsonl", *template) == 2
    err = capsys.readouterr().err
    assert "tokenize: the 7 training example(s) count no token in the loss: only the " \
           "assistant turns count, and the messages' roles are 'human', 'gpt'; the assistant " \
           "turns must have role 'assistant'" in err
    assert not os.path.exists(root / "share-tok" / "tokens.json")
    assert tokenize(root, "users-tok", "users.jsonl", *template) == 2
    assert "the messages' roles are 'user';" in capsys.readouterr().err
    records = f"jsonl:{root / 'sharegpt.jsonl'}"
    with pytest.raises(UsageError, match=f"roles are 'human', 'gpt'.*--dataset {records} "
                                         f"--loss-on all"):
        prepared([*GPT, "--dataset", records, *template])
    data = prepared([*GPT, "--dataset", records, *template, "--loss-on", "all"])[-1]
    assert data.x_train.source.counted > 0              # every token counts: no refusal


# -- examples cut at a row ---------------------------------------------------------------------
def test_the_log_counts_the_examples_cut_to_a_row(root, caplog):
    rows = [{"prompt": "p" * (40 if i % 4 == 0 else 5), "completion": "c" * 3}
            for i in range(20)]
    path = write_jsonl(root / "long.jsonl", rows)      # bytes: one token per character
    data = prepared([*GPT, "--dataset", f"jsonl:{path}", "--val-fraction", "0.25"])[-1]
    lengths = np.array([len(r["prompt"]) + len(r["completion"]) for r in rows])
    assert data.corpus["train_truncated"] == int((lengths[:15] > 25).sum()) == 4
    assert data.corpus["val_truncated"] == int((lengths[15:] > 25).sum()) == 1
    with caplog.at_level(logging.INFO):
        log_examples(logging.getLogger("test-sft-usage"), data)
    assert "4 train + 1 validation examples longer than seq_len + 1 tokens cut to it (their " \
           "tokens past the cut count nowhere; a longer --seq-len keeps them)" in caplog.text


def test_targets_all_past_the_cut_hint_at_the_sequence_length(root):
    path = write_jsonl(root / "late.jsonl", [{"prompt": "p" * 30, "completion": "answer"}] * 8)
    with pytest.raises(UsageError, match=r"nothing to train on; 7 example\(s\) are longer than "
                                         r"seq_len \+ 1 = 25 tokens and every counted target "
                                         r"lies past that cut: raise --seq-len \(the longest "
                                         r"example has 36 tokens\)"):
        prepared([*GPT, "--dataset", f"jsonl:{path}"])


# -- flags ---------------------------------------------------------------------------------------
def test_a_sequence_that_cp_cannot_cut_is_a_usage_error_naming_it(root):
    gpt = ["--model", "gpt:d_model=16,n_heads=2,n_layers=1,seq_len=30", *RUN[2:]]
    with pytest.raises(UsageError, match=r"the model's seq_len 30 does not divide by 2\*cp = "
                                         r"4: layout 'cp=2'"):
        validate_train_args(parse_train_args([*gpt, "--layout", "cp=2", "--batch", "4"]), 2)
    model = ms.GPT(vocab_size=VOCAB, seq_len=32, d_model=16, n_heads=2, n_layers=1, tied=True)
    hf = ms.hf.save(str(root / "hf"), model, model.init(seed=0))
    argv = ["--init-from-hf", hf, "--tokenizer", "bytes", "--layout", "cp=2", *RUN]
    with pytest.raises(UsageError, match=r"--seq-len 30 does not divide by 2\*cp = 4"):
        validate_train_args(parse_train_args([*argv, "--seq-len", "30"]), 2)
    validate_train_args(parse_train_args([*argv, "--seq-len", "28"]), 2)


def test_val_fraction_messages(root, capsys):
    assert tokenize(root, "val-tok", "chat.jsonl", "--chat-template",
                    str(root / "chat.jinja")) == 0
    with pytest.raises(UsageError, match=r"--val-fraction applies to --dataset text and "
                                         r"--dataset jsonl:\|parquet:\|hfdisk:; tokens:"):
        validate_train_args(parse_train_args([*GPT, "--dataset", f"tokens:{root / 'val-tok'}",
                                              "--val-fraction", "0.2"]), 1)
    with pytest.raises(UsageError, match="--val-fraction must be > 0, got 0: the validation "
                                         "split needs at least one example"):
        validate_train_args(parse_train_args([*GPT, "--dataset", f"jsonl:{root}/chat.jsonl",
                                              "--val-fraction", "0"]), 1)
    assert tokenize(root, "zero-tok", "chat.jsonl", "--val-fraction", "0") == 2
    data = prepared([*GPT, "--dataset", f"jsonl:{root / 'chat.jsonl'}", "--tokenizer", "bytes",
                     "--chat-template", str(root / "chat.jinja"), "--val-fraction", "0.5"])[-1]
    assert (data.corpus["train_examples"], data.corpus["val_examples"]) == (12, 12)
    capsys.readouterr()
    assert cli.main(["train", "--help"]) == 0
    assert "--dataset text or jsonl:|parquet:|hfdisk: records: the last fraction of the bytes " \
           "(of the examples) that is the validation split, > 0" in \
           " ".join(capsys.readouterr().out.split())


def test_a_batch_larger_than_the_packed_rows_says_what_gives_more(root):
    path = f"jsonl:{root / 'chat.jsonl'}"
    argv = [*GPT, "--dataset", path, "--tokenizer", "bytes", "--chat-template",
            str(root / "chat.jinja"), "--batch", "64"]
    with pytest.raises(UsageError, match=r"--batch 64 is larger than the \d+ training rows of "
                                         r"jsonl:.* \(packed rows of seq_len \+ 1 = 25 tokens, "
                                         r"each holding whole examples: a smaller --batch, a "
                                         r"lower --seq-len or more data gives more rows\)"):
        prepared([*argv, "--pack"])
    with pytest.raises(UsageError, match=r"\(padded rows, one example each: a smaller --batch "
                                         r"or more data gives more rows\)"):
        prepared(argv)

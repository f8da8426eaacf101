"""train's fine-tune flags (cli/sft_options.py): --dataset jsonl:|parquet:|hfdisk: records
encoded in memory, tokens:DIR of version 2, --pack, --loss-on, --text-field, --chat-template;
the flag checks, the same rows either way, a bad record's one-line error, and a 2-rank run.

    pytest -m "not mpi" tests/cli/test_sft_options.py
"""
import json
import os

import numpy as np
import pytest

from mpishard import cli
from mpishard.cli.train import parse_train_args, prepare_training, validate_train_args
from mpishard.cli.usage import UsageError
from mpishard.nn.documents import one_document_rows

from conftest import engine_lines, run_mpi

pytest.importorskip("datasets")
RUN = ["--batch", "4", "--no-progress", "--log-every", "0", "--log-level", "WARNING",
       "--dtype", "float64", "--steps", "2"]
GPT = ["--model", "gpt:d_model=16,n_heads=2,n_layers=1,seq_len=24", *RUN]
TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: "
            "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}\n"
            "{% endgeneration %}{% else %}{{ m['content'] }}\n{% endif %}{% endfor %}")


class OneRank:
    def Get_size(self):
        return 1


def write(path, rows):
    with open(path, "w") as f:
        f.writelines((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("sft")
    rng = np.random.default_rng(0)
    words = "ab cd ef gh ij kl".split()
    pairs, chats = [], []
    for i in range(40):
        w = " ".join(rng.choice(words, rng.integers(1, 4)))
        pairs.append({"prompt": f"say {w}:", "completion": f" {w[::-1]}"})
        chats.append({"messages": [{"role": "user", "content": w},
                                   {"role": "assistant", "content": w.upper()}]})
    (root / "chat.jinja").write_text(TEMPLATE)
    return {"pairs": write(root / "pairs.jsonl", pairs),
            "chat": write(root / "chat.jsonl", chats),
            "bad": write(root / "bad.jsonl", pairs[:3] + ['{"prompt": "x", "completion": 5}']),
            "template": str(root / "chat.jinja"), "root": str(root)}


def prepared(argv):
    args = parse_train_args(argv)
    return prepare_training(args, OneRank())


def rows(data, split="train"):
    x, t = (np.asarray(getattr(data, f"{a}_{split}")) for a in ("x", "t"))
    d = getattr(data, f"d_{split}")
    return x, t, None if d is None else np.asarray(d)


def test_flags_apply_where_they_fit(files):
    jsonl = f"jsonl:{files['pairs']}"
    cases = [(["--dataset", "digits", "--pack"], "--pack applies to fine-tune examples"),
             (["--model", "gpt", "--loss-on", "all"], "--loss-on applies to fine-tune"),
             (["--model", "gpt", "--dataset", jsonl, "--text", "x"],
              "--text applies to --dataset text; jsonl:"),
             (["--model", "gpt", "--dataset", jsonl, "--train-stride", "2"], "--train-stride"),
             (["--model", "gpt", "--text-field", "body"], "--text-field applies to --dataset "
                                                          "jsonl:|parquet:|hfdisk:"),
             (["--dataset", jsonl, "--model", "64,10"], "trains --model gpt or --init-from-hf")]
    for argv, message in cases:
        with pytest.raises(UsageError, match=message):
            validate_train_args(parse_train_args(argv), 1)
    args = parse_train_args(["--dataset", jsonl, "--pack"])       # --model gpt implied
    validate_train_args(args, 1)
    assert args.model == "gpt" and args.pack and args.schedule == "cosine"
    with pytest.raises(UsageError, match="invalid choice: 'parquet:'"):
        parse_train_args(["--dataset", "parquet:"])


def test_config_file_sets_the_flags(files, tmp_path):
    cfg = tmp_path / "c.toml"
    cfg.write_text(f'dataset = "jsonl:{files["pairs"]}"\npack = true\nloss-on = "all"\n')
    args = parse_train_args(["--config", str(cfg)])
    assert args.pack is True and args.loss_on == "all" and args.dataset.startswith("jsonl:")


@pytest.mark.parametrize("extra", [[], ["--pack"], ["--loss-on", "all"]])
def test_records_in_memory_and_their_token_directory_give_the_same_rows(files, extra):
    out = os.path.join(files["root"], "tok-" + "-".join(extra).strip("-"))
    assert cli.main(["tokenize", "--tokenizer", "bytes", "--dataset", f"jsonl:{files['pairs']}",
                     "--out", out, "--val-fraction", "0.1"]) == 0
    _, _, _, model, memory = prepared([*GPT, "--dataset", f"jsonl:{files['pairs']}",
                                       "--val-fraction", "0.1", *extra])
    _, _, _, _, disk = prepared([*GPT, "--dataset", f"tokens:{out}", *extra])
    assert memory.masked and model.vocab_size == 256 == disk.n_classes
    for split in ("train", "test"):
        (x0, t0, d0), (x1, t1, d1) = rows(memory, split), rows(disk, split)
        np.testing.assert_array_equal(x0, x1)
        np.testing.assert_array_equal(t0, t1)
        np.testing.assert_array_equal(d0, d1)        # ids, padded rows' too (-1 on padding)
        assert "--pack" in extra or one_document_rows(d0)
    x, t, _ = rows(memory)
    counted = int((t != -100).sum())
    assert counted == memory.x_train.source.counted
    # completion: the answers' bytes; all: every byte after each example's first (the first
    # 36 records are the training split, none longer than a row)
    train = [json.loads(line) for line in open(files["pairs"])][:36]
    want = [len(r["completion"]) for r in train] if "--loss-on" not in extra else \
        [len(r["prompt"]) + len(r["completion"]) - 1 for r in train]
    assert counted == sum(want)


def test_messages_take_the_chat_template_flag(files):
    _, _, _, _, data = prepared([*GPT, "--dataset", f"jsonl:{files['chat']}",
                                 "--chat-template", files["template"], "--pack"])
    x, t, d = rows(data)
    text = bytes(int(v) for v in t[t != -100]).decode()
    assert text and text == text.upper() and "user" not in text      # assistant turns only
    with pytest.raises(UsageError, match="--chat-template applies to messages records"):
        prepared([*GPT, "--dataset", f"jsonl:{files['pairs']}", "--chat-template",
                  files["template"]])
    with pytest.raises(UsageError, match="chat template"):             # bytes have none
        prepared([*GPT, "--dataset", f"jsonl:{files['chat']}"])


def test_flat_tokens_refuse_pack(files):
    corpus = os.path.join(files["root"], "corpus.txt")
    with open(corpus, "w") as f:
        f.write("plain text " * 200)
    out = os.path.join(files["root"], "flat")
    assert cli.main(["tokenize", "--tokenizer", "bytes", "--text", corpus, "--out", out]) == 0
    with pytest.raises(UsageError, match="--pack applies to examples; tokens:.* flat tokens"):
        prepared([*GPT, "--dataset", f"tokens:{out}", "--pack"])
    assert not prepared([*GPT, "--dataset", f"tokens:{out}"])[-1].masked


def test_a_bad_record_names_its_line(files):
    with pytest.raises(UsageError, match=r"^--dataset: .*bad.jsonl line 4: .*completion"):
        prepared([*GPT, "--dataset", f"jsonl:{files['bad']}"])


def test_two_ranks_train_and_stop_with_one_line(files, tmp_path):
    base = ["-m", "mpishard", "train", *GPT, "--layout", "dp=2", "--pack"]
    r = run_mpi(2, *base, "--dataset", f"jsonl:{files['pairs']}", "--log-level", "INFO",
                "--metrics-json", str(tmp_path / "m.json"), timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 2 and m["corpus"]["pack"] and m["tokens_per_s"] > 0
    assert "% real tokens" in r.stderr and "counted targets" in r.stderr
    r = run_mpi(2, *base, "--dataset", f"jsonl:{files['bad']}", timeout=180)
    lines = [ln for ln in engine_lines(r.stderr) if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "bad.jsonl line 4" in lines[0], r.stderr

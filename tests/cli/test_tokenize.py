"""`mpishard tokenize` and train's --tokenizer, --dataset tokens:DIR and --init-from-hf
(cli/tokenize.py, cli/token_options.py): the command's files, the flag checks, and a
fine-tune whose first loss is transformers' loss of the Hugging Face model on the same batch
(float64).

    pytest -m "not mpi" tests/cli/test_tokenize.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/cli/test_tokenize.py
"""
import json
import math
import os
import shutil

import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard import cli
from mpishard.cli.train import build_training, parse_train_args, validate_train_args
from mpishard.cli.token_options import load_tokenizer
from mpishard.cli.usage import UsageError
from mpishard.train.example_tokens import read_examples
from mpishard.train.examples import encode_records
from mpishard.train.records import open_records
from mpishard.train.tokens import read_header

from conftest import RTOL64, assert_close, engine_lines, run_mpi, world
from test_records import CHAT, PAIRS, write_jsonl
from test_tokens import EOS, VOCAB, shared_dir, train_bpe, write_corpus

pytest.importorskip("tokenizers")
RUN = ["--batch", "8", "--no-progress", "--log-every", "0", "--log-level", "WARNING", "--dtype",
       "float64"]
TINY = ["--gpt", "d_model=32,n_heads=2,n_layers=1,seq_len=16", "--steps", "3", *RUN]


def model_dir(root, vocab=VOCAB, tokenizer=True, arch="gpt2"):
    """A random-init float64 GPT2LMHeadModel (tied, norms moved off 1 and 0), or a
    LlamaForCausalLM (GQA, 2 kv heads for 4), seq_len 32, saved under root/hf with the BPE of
    root/corpus as its tokenizer.json: (directory, torch model)."""
    torch = pytest.importorskip("torch")
    import transformers as tf

    torch.manual_seed(0)
    if arch == "gpt2":
        cfg = tf.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4)
    else:
        cfg = tf.LlamaConfig(vocab_size=vocab, max_position_embeddings=32, hidden_size=32,
                             intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                             num_key_value_heads=2)
    cls = tf.GPT2LMHeadModel if arch == "gpt2" else tf.LlamaForCausalLM
    model = cls(cfg).double().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "ln_" in name or "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
    path = os.path.join(root, "hf")
    model.save_pretrained(path)
    if tokenizer:
        train_bpe(os.path.join(root, "corpus")).save(os.path.join(path, "tokenizer.json"))
        with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": EOS}, f)
    return path, model


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("tok"))
    write_corpus(os.path.join(root, "corpus"))
    train_bpe(os.path.join(root, "corpus")).save(os.path.join(root, "tokenizer.json"))
    return root


def tokenize(root, out, *extra):
    return cli.main(["tokenize", "--tokenizer", os.path.join(root, "tokenizer.json"),
                     "--text", os.path.join(root, "corpus"), "--out", os.path.join(root, out),
                     *extra])


# -- the command -------------------------------------------------------------------------------
def test_tokenize_writes_the_files_and_train_reads_them(root, capsys):
    assert tokenize(root, "tok", "--val-fraction", "0.1") == 0
    out = capsys.readouterr().out
    h = read_header(os.path.join(root, "tok"))
    assert f"wrote {root}/tok: {h['train']['count']} train + {h['val']['count']} validation " \
           f"tokens as uint16" in out and "eos 0" in out and "5 file(s)" in out
    assert h["vocab_size"] == VOCAB and h["val_fraction"] == 0.1
    args = parse_train_args(["--model", "gpt", "--dataset", f"tokens:{root}/tok", *TINY])
    trainer = build_training(args, world().Split(world().Get_rank()))
    assert trainer.data.n_classes == VOCAB and trainer.engine.model.vocab_size == VOCAB
    assert trainer.clip == 1.0 and trainer.data.corpus["tokenizer"] == h["tokenizer"]
    memory = build_training(parse_train_args(["--model", "gpt", "--text", f"{root}/corpus",
                                              "--tokenizer", f"{root}/tokenizer.json",
                                              "--val-fraction", "0.1", *TINY]),
                            world().Split(world().Get_rank()))
    a, b = trainer.fit(), memory.fit()
    assert a["loss_history"] == b["loss_history"] and a["test_loss"] == b["test_loss"]


@pytest.mark.parametrize("extra,message", [
    (["--val-fraction", "1.5"], "--val-fraction must be"),
    (["--corpus-bytes", "0"], "--corpus-bytes must be > 0"),
])
def test_tokenize_errors(root, capsys, extra, message):
    assert tokenize(root, "bad", *extra) == 2
    assert message in capsys.readouterr().err


def test_tokenize_refuses_other_directories_and_tokenizers(root, capsys):
    os.makedirs(os.path.join(root, "mine"), exist_ok=True)
    open(os.path.join(root, "mine", "notes.txt"), "w").close()
    assert tokenize(root, "mine") == 2
    assert "exists and is not a token directory" in capsys.readouterr().err
    assert cli.main(["tokenize", "--tokenizer", f"{root}/corpus", "--out", f"{root}/x"]) == 2
    assert "no tokenizer.json there" in capsys.readouterr().err
    (open(os.path.join(root, "garbage.json"), "w")).write("{")
    assert cli.main(["tokenize", "--tokenizer", f"{root}/garbage.json", "--out", "x"]) == 2
    assert "not a readable tokenizer.json" in capsys.readouterr().err


# -- fine-tune records: tokenize --dataset --------------------------------------------------------
CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
          "{% endfor %}")


def tokenize_records(root, out, dataset, *extra):
    return cli.main(["tokenize", "--tokenizer", os.path.join(root, "tokenizer.json"),
                     "--dataset", dataset, "--out", os.path.join(root, out), *extra])


def test_tokenize_dataset_writes_the_examples_encode_records_makes(root, tmp_path, capsys):
    """`tokenize --dataset jsonl:...` (prompt/completion, --text-field, messages with
    --chat-template FILE): the directory holds what encode_records makes in memory, and the
    report says how many examples and counted tokens it wrote."""
    pytest.importorskip("datasets")
    pairs = write_jsonl(tmp_path / "qa.jsonl", PAIRS * 4, blank=(2,))
    assert tokenize_records(root, "qa", f"jsonl:{pairs}", "--val-fraction", "0.25") == 0
    out = capsys.readouterr().out
    splits, h = read_examples(os.path.join(root, "qa"))
    memory, info = encode_records(open_records(f"jsonl:{pairs}"),
                                  load_tokenizer(os.path.join(root, "tokenizer.json")),
                                  val_fraction=0.25)
    for split in ("train", "val"):
        assert splits[split].starts.tolist() == memory[split].starts.tolist()
        assert splits[split].counted() == memory[split].counted() > 0
    ex = h["examples"]
    assert (ex["train"]["count"], ex["val"]["count"]) == (9, 3)
    assert f"records jsonl:{pairs}: 12 prompt_completion record(s) (fields prompt, " \
           f"completion) from 1 file(s), sha256 {info['records']['sha256'][:16]}" in out
    assert f"wrote {root}/qa: 9 train + 3 validation examples, {h['train']['count']} + " \
           f"{h['val']['count']} tokens as uint16, {ex['train']['counted']} + " \
           f"{ex['val']['counted']} counted in the loss" in out
    body = write_jsonl(tmp_path / "body.jsonl", [{"body": f"text {i}"} for i in range(4)])
    assert tokenize_records(root, "body", f"jsonl:{body}", "--text-field", "body") == 0
    assert read_header(os.path.join(root, "body"))["records"]["fields"] == ["body"]
    template = tmp_path / "chatml.jinja"
    template.write_text(CHATML)
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT * 3)
    assert tokenize_records(root, "chat", f"jsonl:{chat}", "--chat-template",
                            str(template)) == 0
    assert "6 messages record(s)" in capsys.readouterr().out
    r = read_header(os.path.join(root, "chat"))["records"]
    assert r["kind"] == "messages" and len(r["chat_template"]["sha256"]) == 64


def test_tokenize_dataset_errors_are_one_line(root, tmp_path, capsys):
    pytest.importorskip("datasets")
    pairs = write_jsonl(tmp_path / "qa.jsonl", PAIRS)
    bad = write_jsonl(tmp_path / "bad.jsonl", PAIRS[:2] + [{"prompt": "p"}], blank=(1,))
    cases = [
        ([f"jsonl:{bad}"], f"tokenize: {bad} line 5: the record's field 'completion' is missing"),
        ([f"jsonl:{pairs}", "--chat-template", str(tmp_path / "none.jinja")], "none.jinja"),
        ([f"jsonl:{pairs}", "--text", "x"], "--text applies to a text corpus, not --dataset"),
        ([f"jsonl:{pairs}", "--corpus-bytes", "9"], "--corpus-bytes applies to a text corpus"),
        (["csv:x"], "--dataset 'csv:x': give jsonl:FILE|GLOB, parquet:FILE|GLOB or "
         "hfdisk:DIR"),
        ([f"jsonl:{tmp_path}/no*.jsonl"], "no file matches"),
    ]
    template = tmp_path / "t.jinja"
    template.write_text(CHATML)
    cases.append(([f"jsonl:{pairs}", "--chat-template", str(template)],
                  "--chat-template applies to messages records; jsonl:"))
    for extra, message in cases:
        assert tokenize_records(root, "bad", *extra) == 2
        err = capsys.readouterr().err
        assert message in err and len(err.strip().splitlines()) == 1, err
    for flag in ("--text-field", "--chat-template"):
        assert tokenize(root, "bad", flag, "x") == 2
        assert f"{flag} applies to --dataset jsonl:|parquet:|hfdisk:" in capsys.readouterr().err
    # the bad record's run left its temporary files in --out: the fixed data writes there
    assert any(name.endswith(".tmp") for name in os.listdir(os.path.join(root, "bad")))
    assert tokenize_records(root, "bad", f"jsonl:{pairs}") == 0, capsys.readouterr().err
    assert not any(name.endswith(".tmp") for name in os.listdir(os.path.join(root, "bad")))


# -- train's flags -----------------------------------------------------------------------------
def check(argv, world_size=1):
    args = parse_train_args(argv)
    return validate_train_args(args, world_size), args


def test_flag_checks(root, tmp_path):
    assert tokenize(root, "tok2") == 0
    tokens = f"tokens:{root}/tok2"
    cases = [
        (["--model", "64,10", "--dataset", "digits", "--tokenizer", "bytes"],
         "--tokenizer applies to a language model"),
        (["--model", "gpt", "--seq-len", "8"], "--seq-len applies to --init-from-hf"),
        (["--dataset", tokens, "--text", "x"], "--text applies to --dataset text; tokens:"),
        (["--dataset", tokens, "--val-fraction", "0.2"], "--val-fraction applies to"),
        (["--dataset", tokens, "--model", "64,10"], "trains --model gpt or --init-from-hf"),
        (["--dataset", tokens, "--model", "gpt", "--gpt", "n_heads=3"], "divisible|divide"),
        (["--init-from-hf", str(tmp_path), "--model", "gpt", "--gpt", "d_model=8"],
         "takes the model from its config.json; leave out --model and --gpt"),
        (["--init-from-hf", str(tmp_path), "--dataset", "digits"],
         "trains on --dataset text or tokens:DIR, not digits"),
        (["--init-from-hf", str(tmp_path)], "config.json"),
    ]
    for argv, message in cases:
        with pytest.raises(UsageError, match=message):
            check(argv)
    (layout, model, loss), args = check(["--dataset", tokens])   # --model gpt implied
    assert args.model == "gpt" and loss == "cross_entropy" and args.schedule == "cosine"
    with pytest.raises(UsageError, match="invalid choice: 'tokens:'"):
        parse_train_args(["--dataset", "tokens:"])


def test_a_foreign_tokenizer_or_a_small_vocabulary_stops_the_build(root):
    assert tokenize(root, "tok3") == 0
    solo = world().Split(world().Get_rank())
    args = parse_train_args(["--model", "gpt", "--dataset", f"tokens:{root}/tok3",
                             "--tokenizer", "bytes", *TINY])
    with pytest.raises(UsageError, match="was tokenized by .*tokenizer.json .sha256 .*not by "
                       "bytes"):
        build_training(args, solo)
    path, _ = model_dir(root, vocab=300)
    args = parse_train_args(["--init-from-hf", path, "--text", f"{root}/corpus", "--seq-len",
                             "16", *TINY[2:]])
    with pytest.raises(UsageError, match=f"has {VOCAB} ids but the model of --init-from-hf "
                       f".* has a vocabulary of 300"):
        build_training(args, solo)
    shutil.rmtree(path)
    path, _ = model_dir(root, tokenizer=False)
    args = parse_train_args(["--init-from-hf", path, *TINY[2:]])
    with pytest.raises(UsageError, match="has no tokenizer.json; give --tokenizer"):
        build_training(args, solo)
    args = parse_train_args(["--init-from-hf", path, "--seq-len", "64", *TINY[2:]])
    with pytest.raises(UsageError, match="--seq-len 64 exceeds the model's seq_len 32"):
        validate_train_args(args, 1)
    shutil.rmtree(path)


# -- fine-tuning a Hugging Face model (MPI) ----------------------------------------------------
def torch_loss(model, x, t) -> float:
    import torch

    with torch.no_grad():
        logits = model(torch.as_tensor(x)).logits
        return float(torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                       torch.as_tensor(t).reshape(-1)))


def single_loss(path, x, t) -> float:
    """mpishard's single-device float64 loss of the weights in `path` on (x, t)."""
    model, params = ms.hf.load(path)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    return ms.losses.CrossEntropy().value(engine.predict(x), t)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_init_from_hf_starts_at_the_model_loss_on_every_layout(arch):
    """--init-from-hf DIR with DIR's tokenizer (320 ids; the model's vocabulary 323, padded
    under tp): the first step's loss is the loss of DIR's weights on the same global batch
    (float64, rtol 1e-9) at dp=n, tp=n and dp=2,tp=n/2:
    transformers' own for GPT-2, the single-device engine's for Llama (whose float64 equality
    with transformers tests/hf checks); the next 5 steps' losses equal single's."""
    pytest.importorskip("torch")             # on every rank, before rank 0 alone builds the
    pytest.importorskip("transformers")      # model (a skip on one rank would desync the job)
    comm = world()
    n = comm.Get_size()
    root = shared_dir(comm)
    try:
        if comm.Get_rank() == 0:
            write_corpus(os.path.join(root, "corpus"))
            model_dir(root, vocab=VOCAB + 3, arch=arch)     # odd: tp pads it
        comm.Barrier()
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(os.path.join(root, "hf")).double().eval()
        first = None
        layouts = ["single", f"dp={n}"] + ([f"tp={n}"] if n > 1 and 4 % n == 0 else []) + \
            ([f"dp=2,tp={n // 2}"] if n >= 4 and n % 2 == 0 else [])
        for layout in layouts:
            args = parse_train_args(["--init-from-hf", os.path.join(root, "hf"), "--text",
                                     os.path.join(root, "corpus"), "--seq-len", "16",
                                     "--layout", layout, "--steps", "6", "--lr", "0.01",
                                     "--warmup", "0", *RUN])
            trainer = build_training(args, MPI.COMM_SELF if layout == "single" else comm)
            idx = trainer.batcher.global_indices(0, 0)
            data = trainer.data
            x, t = data.x_train[idx], data.t_train[idx]
            want = torch_loss(hf, x, t) if arch == "gpt2" else single_loss(
                os.path.join(root, "hf"), x, t)
            got = trainer.train_step()
            assert_close(got, want, RTOL64, what=f"{arch} {layout} first loss")
            print(f"{arch} {layout}: first loss {got:.12f}, reference {want:.12f}, relative "
                  f"{abs(got - want) / want:.1e}")
            curve = [got] + [trainer.train_step() for _ in range(5)]
            first = first or curve
            assert_close(curve, first, RTOL64, what=f"{arch} {layout} losses")
            assert curve[-1] < curve[0]
            trainer.engine.close()
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


def test_tokens_train_on_two_ranks_and_one_error_line(root, tmp_path):
    """`train --dataset tokens:DIR` under mpiexec -n 2 (dp=2), its loss labelled per token (the
    eval line, the table, the metrics' keys), and a mismatched --tokenizer stopping both ranks
    with one line."""
    assert tokenize(root, "tok4") == 0
    base = ["-m", "mpishard", "train", "--model", "gpt", "--dataset", f"tokens:{root}/tok4",
            "--layout", "dp=2", *TINY, "--metrics-json", str(tmp_path / "m.json")]
    r = run_mpi(2, *base, "--log-level", "INFO", "--metrics-jsonl", str(tmp_path / "m.jsonl"),
                timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    m = json.loads((tmp_path / "m.json").read_text())
    assert m["steps"] == 3 and m["corpus"]["tokenizer"]["sha256"] and m["dataset"].startswith(
        "tokens:")
    assert m["val_bits_per_token"] == pytest.approx(m["val_loss"] / math.log(2), rel=1e-12)
    assert "val_bits_per_byte" not in m and "val bits/token" in r.stdout
    assert f"nats/token, {m['val_bits_per_token']:.4f} bits/token" in r.stderr
    assert "/byte" not in r.stdout + r.stderr
    evals = [json.loads(line) for line in open(tmp_path / "m.jsonl") if '"eval"' in line]
    assert evals[-1]["val_bits_per_token"] == m["val_bits_per_token"]
    r = run_mpi(2, *base, "--tokenizer", "bytes", timeout=180)
    lines = [ln for ln in engine_lines(r.stderr) if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1 and "was tokenized by" in lines[0], r.stderr

"""A GPT from the command line: the byte corpus (train/text.py), `train --model gpt` and
`generate` (cli/generate.py), one-line errors on every rank.

    pytest -m "not mpi" tests/cli/test_gpt_cli.py

Serial tests; the subprocess ones launch `mpiexec -n {1,2} python -m mpi4py -m mpishard ...`.
"""
import inspect
import json

import numpy as np
import pytest

import mpishard as ms
from mpishard import cli
from mpishard.cli.gpt_options import parse_gpt_spec
from mpishard.cli.train import parse_train_args, validate_train_args
from mpishard.models.gpt.spec import GPT
from mpishard.train.data import DistributedBatcher
from mpishard.train.text import (BYTE_VOCAB, Windows, read_corpus, split_windows,
                                 text_dataset)

from conftest import assert_close, engine_lines, run_mpi

TINY = ["--model", "gpt", "--gpt", "d_model=32,n_heads=2,n_layers=1,seq_len=16",
        "--corpus-bytes", "60000", "--batch", "16", "--lr", "0.01", "--no-progress",
        "--log-every", "0"]


def launch(n, *args, timeout=180):
    r = run_mpi(n, "-m", "mpishard", *args, timeout=timeout)
    print(f"rc {r.returncode}\nstdout: {r.stdout[-1500:]}\nstderr: {r.stderr[-3000:]}")
    return r


# -- the corpus and its windows ------------------------------------------------------------------
def test_corpus_windows_are_deterministic_shifted_and_disjoint(tmp_path):
    text = bytes(range(256)) * 40 + b"def f(x):\n    return x\n" * 100
    for i in range(3):                                     # three files, read in sorted order
        (tmp_path / f"part{i}.txt").write_bytes(text[i * 4000:(i + 1) * 4000])
    a = text_dataset(16, corpus=str(tmp_path / "part*.txt"), val_fraction=0.1)
    b = text_dataset(16, str(tmp_path), val_fraction=0.1)       # the directory: the same
    tokens = np.frombuffer(text[:12000], np.uint8)
    assert a.corpus["files"] == 3 and a.corpus["bytes"] == 12000 and a.n_classes == BYTE_VOCAB
    assert a.corpus["sha256"] == b.corpus["sha256"]
    n_train, n_val = len(a.x_train), len(a.x_test)
    assert (n_train, n_val) == ((10800 - 1) // 16, (1200 - 1) // 16)
    x, t = a.x_train[np.arange(n_train)], a.t_train[:]
    assert x.dtype == np.int64 and x.shape == (n_train, 16)
    np.testing.assert_array_equal(x[5], tokens[80:96])
    np.testing.assert_array_equal(t[5], tokens[81:97])              # the next byte of each
    np.testing.assert_array_equal(np.asarray(b.x_train), x)
    # every training target lies before the first validation input: no byte in both splits
    last_train_byte = a.x_train.start + (n_train - 1) * 16 + 16
    assert last_train_byte < a.x_test.start == 10800
    np.testing.assert_array_equal(a.x_test[0], tokens[10800:10816])


def test_stdlib_corpus_and_split_errors():
    t1, info1 = read_corpus(max_bytes=30000)
    t2, info2 = read_corpus(max_bytes=30000)
    assert info1 == info2 and info1["source"] == "python-stdlib" and len(t1) == 30000
    np.testing.assert_array_equal(t1, t2)
    assert split_windows(1000, 10, 0.05) == {"train": (0, 94), "val": (950, 4)}
    with pytest.raises(ValueError, match="seq_len=64 does not fit the val split"):
        split_windows(1000, 64, 0.05)
    with pytest.raises(ValueError, match="no files found"):
        read_corpus("/no/such/*.txt")


def test_batcher_feeds_each_rank_only_its_windows():
    tokens = np.arange(2000) % 251
    x, t = Windows(tokens, 0, 100, 8), Windows(tokens, 0, 100, 8, shift=1)
    whole = DistributedBatcher(x, t, batch=8, seed=3)
    parts = [DistributedBatcher(x, t, batch=8, dp_size=2, dp_rank=r, seed=3) for r in (0, 1)]
    for step in (0, 7, 13):
        (xg, tg), = whole.micro_batches(step)
        got = [p.micro_batches(step)[0] for p in parts]
        np.testing.assert_array_equal(np.concatenate([g[0] for g in got]), xg)   # shard_batch's
        np.testing.assert_array_equal(np.concatenate([g[1] for g in got]), tg)   # row blocks
        assert got[0][0].shape == (4, 8)


# -- flags ---------------------------------------------------------------------------------------
def test_gpt_flags_and_config_table(tmp_path):
    assert parse_gpt_spec("d_model=64,seq_len=32,tied=1") == {
        "d_model": 64, "n_heads": 4, "n_layers": 4, "seq_len": 32, "d_ff": None, "tied": 1}
    a = parse_train_args(["--model", "gpt", "--gpt", "d_model=64,n_heads=2"])
    assert a.dataset == "text"
    layout, gpt, loss = validate_train_args(a, world_size=2)
    assert isinstance(gpt, GPT) and gpt.d_model == 64 and loss == "cross_entropy"
    cfg = tmp_path / "gpt.toml"
    cfg.write_text('model = "gpt"\nsteps = 5\n[gpt]\nd_model = 32\nn_heads = 2\ntied = true\n')
    b = parse_train_args(["--config", str(cfg)])
    _, gpt, _ = validate_train_args(b, world_size=1)
    assert (gpt.d_model, gpt.n_heads, gpt.tied, b.dataset) == (32, 2, True, "text")


@pytest.mark.parametrize("argv,world,message", [
    (["--gpt", "colour=1"], 1, "--gpt: unknown key 'colour'; known keys: d_model"),
    (["--gpt", "d_model=abc"], 1, "--gpt: d_model='abc' is not an integer"),
    (["--gpt", "d_model"], 1, "expected KEY=VALUE pairs"),
    (["--gpt", "n_layers=0"], 1, "n_layers must be a positive integer, got 0"),
    (["--gpt", "d_model=30,n_heads=4"], 1, "d_model=30 does not divide into n_heads=4"),
    (["--layout", "pp=8"], 8, "pp=8"),
    (["--dataset", "digits"], 1, "--dataset text trains --model gpt"),
    (["--loss", "mse"], 1, "--loss mse does not fit --model gpt"),
    (["--val-fraction", "1.5"], 1, "--val-fraction must be"),
])
def test_bad_gpt_flags(argv, world, message):
    with pytest.raises(cli.UsageError, match=message.replace("(", r"\(")):
        validate_train_args(parse_train_args(["--model", "gpt", *argv]), world)


@pytest.mark.parametrize("argv,message", [
    (["plan", "--model", "qwen2:vocab=256,seq=32,d_model=64", "--world-size", "2"],
     "plan: --model: unknown key 'seq'"),
    (["plan", "--model", "gpt", "--gpt", "seq=32", "--world-size", "2"],
     "plan: --gpt: unknown key 'seq'"),
    (["plan", "--model", "qwen:d_model=64", "--world-size", "2"],
     "'qwen' is not a model kind; KIND:KEY=VALUE,... takes KIND gpt, llama, qwen2"),
    (["inspect", "--layout", "dp=2", "--model", "Qwen2:d_model=64"],
     "'Qwen2' is not a model kind; KIND:KEY=VALUE,... takes KIND gpt, llama, qwen2"),
    (["train", "--model", "qwen2:vocab=256,d_model=64,n_heads=2"],
     "--model: train takes the vocabulary from the data set"),
    (["train", "--model", "qwen:d_model=64"], "'qwen' is not a model kind"),
])
def test_keyed_model_errors_name_the_flag_and_the_kinds(capsys, argv, message):
    """A --model KIND:... text's errors say --model (--gpt's say --gpt), and a KIND the
    registry does not key lists the kinds that are."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_text_flags_need_a_gpt():
    with pytest.raises(cli.UsageError, match="--corpus applies to --model gpt"):
        validate_train_args(parse_train_args(["--corpus", "x.txt"]), 1)


# -- real runs -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny GPT trained under single (1 rank) and dp=2 (2 ranks); {layout: (metrics, ckpt)}."""
    tmp = tmp_path_factory.mktemp("gpt")
    runs = {}
    for n, layout in ((1, "single"), (2, "dp=2")):
        ckpt, path = tmp / f"ckpt-{n}", tmp / f"m-{n}.json"
        r = launch(n, "train", *TINY, "--layout", layout, "--steps", "30", "--dtype",
                   "float64", "--eval-every", "15", "--checkpoint-dir", str(ckpt),
                   "--metrics-json", str(path))
        assert r.returncode == 0 and "Traceback" not in r.stderr
        assert "val bits/byte" in r.stdout and "corpus python-stdlib" in r.stderr
        runs[layout] = json.loads(path.read_text()), ckpt
    return runs


def test_train_gpt_loss_falls_and_matches_across_layouts(trained):
    m, _ = trained["single"]
    for key in ("val_loss", "val_bits_per_byte", "tokens_per_s", "corpus", "loss_history"):
        assert key in m, key
    losses = m["loss_history"]
    assert len(losses) == 30 and np.mean(losses[-5:]) < np.mean(losses[:3]) - 0.5, losses
    assert m["val_loss"] < np.log(BYTE_VOCAB)                 # better than uniform bytes
    assert m["val_bits_per_byte"] == pytest.approx(m["val_loss"] / np.log(2))
    assert [e["step"] for e in m["eval_history"]] == [15, 30]
    assert m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 16)
    dp, _ = trained["dp=2"]
    assert_close(dp["loss_history"], losses, what="dp=2 loss history")
    assert_close(dp["val_loss"], m["val_loss"], what="dp=2 val loss")


def test_generate_is_seeded_and_the_same_on_one_and_two_ranks(trained):
    _, ckpt = trained["single"]
    args = ["generate", "--checkpoint", str(ckpt), "--prompt", "def ", "--max-new-tokens",
            "24", "--top-k", "20", "--temperature", "0.9"]
    one = [launch(1, *args, "--seed", s) for s in ("3", "3", "4")]
    two = launch(2, *args, "--seed", "3", "--layout", "dp=2")
    for r in one + [two]:
        assert r.returncode == 0 and r.stdout.startswith("def ")
    assert one[0].stdout == one[1].stdout == two.stdout
    assert one[0].stdout != one[2].stdout
    assert len(one[0].stdout.encode()) >= len("def ") + 1


@pytest.mark.parametrize("argv,message", [
    (["train", *TINY, "--gpt", "d_model=abc"], "--gpt: d_model='abc' is not an integer"),
    (["train", *TINY, "--gpt", "seq_len=5000"], "seq_len=5000 does not fit the val split"),
    (["train", *TINY, "--layout", "pp=2"], "pp=2"),          # one block, two stages
    (["generate", "--checkpoint", "/no/such/ckpt"], "--checkpoint"),
])
def test_bad_gpt_input_gives_one_line_on_two_ranks(argv, message):
    r = launch(2, *argv, timeout=90)
    lines = engine_lines(r.stderr)             # Open MPI adds its own box on exit 2
    assert r.returncode == 2
    assert len(lines) == 1 and lines[0].startswith("mpishard: error: ") and message in lines[0]
    assert "Traceback" not in r.stderr + r.stdout


def test_resume_under_another_layout_continues_the_same_run(tmp_path):
    """12 steps straight (single) == 6 steps (single), then --resume to 12 under dp=2."""
    args = ["train", *TINY, "--dtype", "float64"]
    whole, part = tmp_path / "whole.json", tmp_path / "part.json"
    ckpt = tmp_path / "ckpt"
    assert launch(1, *args, "--steps", "12", "--metrics-json", str(whole)).returncode == 0
    assert launch(1, *args, "--steps", "6", "--checkpoint-dir", str(ckpt)).returncode == 0
    r = launch(2, *args, "--steps", "12", "--layout", "dp=2", "--checkpoint-dir", str(ckpt),
               "--resume", "--metrics-json", str(part))
    assert r.returncode == 0 and "resumed from" in r.stderr
    a, b = json.loads(whole.read_text()), json.loads(part.read_text())
    assert_close(b["loss_history"], a["loss_history"], what="resumed loss history")
    assert_close(b["val_loss"], a["val_loss"], what="resumed val loss")


def test_train_takes_both_gpt_spellings_and_documents_its_dtype(tmp_path):
    """--model gpt:KEY=VALUE,... is --model gpt --gpt KEY=VALUE,... in train too, on the command
    line and in a --config file; train defaults to float32, make_engine to float64 (defect 12)."""
    a = parse_train_args(["--model", "gpt:d_model=64,n_heads=2", "--gpt", "n_layers=3"])
    assert (a.model, a.gpt, a.dataset, a.schedule) == ("gpt", "d_model=64,n_heads=2,n_layers=3",
                                                       "text", "cosine")
    _, gpt, _ = validate_train_args(a, world_size=1)
    assert (gpt.d_model, gpt.n_heads, gpt.n_layers) == (64, 2, 3)
    cfg = tmp_path / "gpt.toml"
    cfg.write_text('model = "gpt:d_model=32,n_heads=2"\nsteps = 5\n')
    _, gpt, _ = validate_train_args(parse_train_args(["--config", str(cfg)]), world_size=1)
    assert (gpt.d_model, gpt.n_heads) == (32, 2)
    with pytest.raises(cli.UsageError, match="train takes the vocabulary from the data set"):
        validate_train_args(parse_train_args(["--model", "gpt:vocab=50"]), 1)
    assert parse_train_args([]).dtype == "float32"
    assert inspect.signature(ms.make_engine).parameters["dtype"].default == np.float64
    help_text = " ".join(cli.build_parser().commands["train"].format_help().split())
    assert "default float32" in help_text and "make_engine defaults to float64" in help_text


def test_train_runs_a_mixtral_under_dp_and_ep(tmp_path):
    """`train --model llama --gpt ...,n_experts=4` on dp=2,ep=2: the CLI's layout check is the
    engine's own (compose.plan_params), so ep is accepted for a mixture of experts, and the
    log line carries the expert load."""
    out = tmp_path / "m.json"
    proc = run_mpi(4, "-m", "mpishard", "train", "--model", "llama", "--gpt",
                   "d_model=16,n_heads=2,n_layers=1,seq_len=16,n_kv_heads=1,n_experts=4,top_k=2",
                   "--layout", "dp=2,ep=2", "--steps", "2", "--batch", "8", "--log-every", "1",
                   "--corpus-bytes", "20000", "--no-progress", "--metrics-json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "experts min/max" in proc.stdout + proc.stderr
    assert json.loads(out.read_text())["layout"] == "dp=2,ep=2"

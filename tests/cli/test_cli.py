"""`python -m mpishard`: argument and config parsing, one-line errors on every rank, real runs.

    pytest -m "not mpi" tests/cli/test_cli.py

Serial tests; the subprocess ones launch `mpiexec -n 2 python -m mpi4py -m mpishard ...`.
"""
import json
import time
from pathlib import Path

import pytest

from mpishard import cli
from mpishard.cli.train import parse_train_args, validate_train_args

from conftest import assert_close, engine_lines, run_mpi

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = sorted((ROOT / "configs").glob("*.toml"))


def launch(n, *args, timeout=120):
    """Run `mpiexec -n n python -m mpi4py -m mpishard args...`; (rc, stdout, stderr, seconds)."""
    t0 = time.perf_counter()
    r = run_mpi(n, "-m", "mpishard", *args, timeout=timeout)
    return r.returncode, r.stdout, r.stderr, time.perf_counter() - t0


def train_args(*argv):
    return parse_train_args(list(argv))


# -- parsing and validation in-process -----------------------------------------------------------
def test_defaults_and_flags():
    a = train_args("--layout", "dp=2", "--lr", "0.01", "--no-progress")
    assert a.layout == "dp=2" and a.lr == 0.01 and a.no_progress is True
    assert a.dataset == "digits" and a.optimizer == "adamw" and a.batch == 64
    layout, dims, loss = validate_train_args(a, world_size=2)
    assert dims == [64, 128, 128, 10] and loss == "cross_entropy" and a.epochs == 10
    assert a.weight_decay == 0.01
    b = train_args("--optimizer", "sgd", "--dataset", "synthetic-classification", "--model",
                   "16,8,1", "--steps", "5")
    _, dims, loss = validate_train_args(b, world_size=1)
    assert loss == "bce" and b.weight_decay == 0.0 and b.epochs is None


def test_config_file_and_command_line_precedence(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('layout = "dp=2,tp=2"\nmodel = [64, 32, 10]\nlr = 0.02\nepochs = 3\n'
                   'no_progress = true\nmetrics-json = "m.json"\nweight_decay = 0.0\n')
    a = train_args("--config", str(cfg), "--lr", "0.5", "--steps", "7")
    assert a.layout == "dp=2,tp=2" and a.model == "64,32,10" and a.no_progress is True
    assert a.lr == 0.5 and a.steps == 7 and a.epochs is None          # the flags win
    assert a.metrics_json == "m.json" and a.weight_decay == 0.0
    validate_train_args(a, world_size=4)


@pytest.mark.parametrize("text,message", [
    ('colour = "red"\n', "unknown key 'colour'"),
    ('lr = "fast"\n', "argument --lr: invalid float value: 'fast'"),
    ('dataset = "nope"\n', "argument --dataset: invalid choice: 'nope'"),
    ('no-progress = 1\n', "no-progress must be true or false"),
    ('lr = = 1\n', "invalid TOML"),
])
def test_bad_config_files(tmp_path, text, message):
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    with pytest.raises(cli.UsageError, match=message) as info:
        train_args("--config", str(cfg))
    assert str(cfg) in str(info.value)


@pytest.mark.parametrize("argv,world,message", [
    (["--dataset", "nope"], 1, "invalid choice: 'nope'"),
    (["--layout", "dp=2,xx=1"], 2, "unknown axis or option 'xx'"),
    (["--layout", "dp=4"], 2, "needs dp=4 = 4 ranks, but the world size is 2"),
    (["--model", "10,10"], 1, "digits dataset has 64 features and 10 classes"),
    (["--model", "64,a,10"], 1, "expected comma-separated integers"),
    (["--lr", "-1"], 1, "--lr must be >= 0, got -1"),
    (["--lr", "abc"], 1, "invalid float value: 'abc'"),
    (["--batch", "63", "--layout", "dp=2"], 2, "--batch 63 must divide by --accumulate 1 x 2"),
    (["--steps", "5", "--epochs", "2"], 1, "not both"),
    (["--momentum", "0.9"], 1, "applies to --optimizer sgd only"),
    (["--loss", "mse"], 1, "--loss mse does not fit dataset digits"),
    (["--clip", "0"], 1, "--clip must be > 0"),
    (["--metrics-json", "/no/such/dir/m.json"], 1, "directory /no/such/dir does not exist"),
    (["--frobnicate"], 1, "unrecognized arguments: --frobnicate"),
])
def test_bad_input_is_a_usage_error(argv, world, message):
    with pytest.raises(cli.UsageError, match=message.replace("(", r"\(").replace("+", r"\+")):
        validate_train_args(train_args(*argv), world)


def test_main_prints_one_line_and_returns_2(capsys):
    assert cli.main(["train", "--dataset", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mpishard: error: argument --dataset")
    assert cli.main([]) == 2
    assert "choose a command: train, schedule" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "train" in out and "schedule" in out


def test_schedule_subcommand(capsys):
    assert cli.main(["schedule", "--pp", "2", "--microbatches", "4"]) == 0
    assert "bubble fraction" in capsys.readouterr().out


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
    a = train_args("--config", str(path))
    from mpishard.comm.mesh import parse_layout

    validate_train_args(a, world_size=parse_layout(a.layout).world_size)


# -- real processes: mpiexec -n 2 ------------------------------------------------------------------
@pytest.mark.parametrize("argv,message", [
    (["--dataset", "nope"], "argument --dataset: invalid choice: 'nope'"),
    (["--layout", "dp=2,xx=1"], "unknown axis or option 'xx'"),
    (["--layout", "tp=4"], "but the world size is 2"),
    (["--model", "10,10"], "digits dataset has 64 features"),
    (["--layout", "tp=2", "--model", "64,7,10"], "tp=2 does not divide the hidden size 7"),
    (["--layout", "pp=2,microbatches=3", "--batch", "8"], "microbatches=3 does not divide"),
    (["--clip", "inf"], "clip must be a finite number > 0"),
])
def test_bad_input_exits_nonzero_with_one_line_on_two_ranks(argv, message):
    rc, out, err, seconds = launch(2, "train", *argv, timeout=60)
    print(f"rc {rc}, {seconds:.1f} s\nstdout: {out!r}\nstderr: {err!r}")
    lines = engine_lines(err)                  # Open MPI adds its own box on exit 2
    assert rc != 0
    assert len(lines) == 1 and lines[0].startswith("mpishard: error: ") and message in lines[0]
    assert "Traceback" not in err + out and "Abort" not in err
    assert seconds < 30


def test_cli_runs_match_across_layouts(tmp_path):
    """The same config under single (1 rank) and dp=2 / tp=2 (2 ranks): same loss curve."""
    cfg = tmp_path / "tiny.toml"
    cfg.write_text('dataset = "synthetic-classification"\nmodel = "8,16,4"\nbatch = 16\n'
                   'steps = 12\naccumulate = 2\nclip = 0.5\ndtype = "float64"\nn-train = 128\n'
                   'n-test = 32\nschedule = "cosine"\nwarmup = 2\nno-progress = true\n'
                   'log-every = 4\n')
    runs = {}
    for n, layout in ((1, "single"), (2, "dp=2"), (2, "tp=2")):
        path = tmp_path / f"{layout}.json"
        rc, out, err, seconds = launch(n, "train", "--config", str(cfg), "--layout", layout,
                                       "--metrics-json", str(path))
        print(f"{layout}: rc {rc}, {seconds:.1f} s\n{out}\n{err[-2000:]}")
        assert rc == 0 and "Traceback" not in err
        assert out.count("| layout") == 1 and f"| {layout}" in out      # rank 0's table only
        assert "[rank 0] INFO mpishard: step 4/12" in err and "[rank 1]" not in err
        runs[layout] = json.loads(path.read_text())
    for layout in ("dp=2", "tp=2"):
        assert runs[layout]["world_size"] == 2 and runs[layout]["steps"] == 12
        assert_close(runs[layout]["loss_history"], runs["single"]["loss_history"],
                     what=f"{layout} loss history")
        assert runs[layout]["test_accuracy"] == runs["single"]["test_accuracy"]


def test_diverging_training_stops_every_rank_with_one_line():
    """A non-finite loss (the global mean: the same on every rank) ends every rank with exit
    code 1 and one error line, no traceback, no abort."""
    rc, out, err, secs = launch(2, "train", "--dataset", "synthetic-regression", "--layout",
                                "dp=2", "--optimizer", "sgd", "--lr", "1e6", "--steps", "50",
                                "--no-progress")
    lines = [ln for ln in err.splitlines() if ln.startswith("mpishard: error:")]
    assert rc == 1, err
    assert len(lines) == 1 and "loss is nan" in lines[0], err
    assert "Traceback" not in err and secs < 60


@pytest.mark.parametrize("flag, logged", [((), None),
                                          (("--log-level", "DEBUG"), "stay in the heap"),
                                          (("--host-heap", "keep"), "stay in the heap"),
                                          (("--host-heap", "none"), "malloc left as it was")])
def test_train_keeps_the_host_heap_unless_told_not_to(flag, logged):
    """The library leaves malloc alone (make_engine(host_heap=None)); the train command, an
    application, chooses glibc's kept heap for its steps, says so at DEBUG (at INFO when
    --host-heap asked for it); --host-heap none opts out."""
    assert train_args().host_heap == "keep" and train_args(*flag).host_heap == (
        flag[1] if flag[:1] == ("--host-heap",) else "keep")
    rc, out, err, _ = launch(1, "train", "--steps", "2", "--batch", "8", "--no-progress", *flag)
    assert rc == 0, err
    if logged is None:
        assert "host heap" not in out + err, err
    else:
        assert (out + err).count("host heap: ") == 1 and logged in out + err

"""--compute-dtype, --tf32 and --gpu-comm (cli/device_options.py): on every command that builds
an engine, passed to make_engine, contradictions refused with one line, recorded in train's
metrics; a run's setting, not a checkpoint's, so --resume may change it.

    pytest -m "not mpi" tests/cli/test_device_flags.py

Serial tests; the subprocess ones launch `mpiexec -n N python -m mpi4py -m mpishard ...`.
"""
import json
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

from mpishard import MLP, cli, make_engine
from mpishard.cli.bench import add_bench_arguments, build_bench
from mpishard.cli.device_options import engine_options, gpu_comm_choice
from mpishard.cli.infer import add_compute_arguments, checkpoint_engine
from mpishard.cli.train import parse_train_args, validate_train_args
from mpishard.cli.usage import Parser

from conftest import engine_lines, run_mpi

ENGINE_COMMANDS = ("train", "bench", "infer", "generate", "serve")
FLAGS = ("--compute-dtype", "--tf32", "--gpu-comm", "--cuda-aware", "--device")
TINY = ("--steps", "2", "--batch", "8", "--n-train", "64", "--n-test", "16", "--no-progress",
        "--log-every", "1")


def train(n, *argv, tmp_path, name="m"):
    """`mpiexec -n n ... mpishard train TINY argv`: (returncode, stderr, metrics or None)."""
    path = Path(tmp_path) / f"{name}.json"
    r = run_mpi(n, "-m", "mpishard", "train", *TINY, *argv, "--metrics-json", str(path),
                timeout=120)
    return r.returncode, r.stderr, json.loads(path.read_text()) if path.exists() else None


# -- parsing in-process ------------------------------------------------------------------------
@pytest.mark.parametrize("command", ENGINE_COMMANDS)
def test_help_lists_the_flags(command, capsys):
    assert cli.main([command, "--help"]) == 0
    out = capsys.readouterr().out
    assert all(flag in out for flag in FLAGS), out


def test_defaults_config_and_command_line():
    a = parse_train_args([])
    assert (a.compute_dtype, a.tf32, a.gpu_comm, a.cuda_aware) == (None, False, "auto", "auto")
    assert engine_options(a, "float32")["compute_dtype"] is None


def test_config_keys_and_the_command_line_wins(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('compute-dtype = "bfloat16"\ntf32 = false\ngpu_comm = "staged"\n')
    a = parse_train_args(["--config", str(cfg), "--gpu-comm", "nccl"])
    assert (a.compute_dtype, a.tf32, a.gpu_comm) == ("bfloat16", False, "nccl")
    cfg.write_text('tf32 = true\n')
    assert parse_train_args(["--config", str(cfg)]).tf32 is True


@pytest.mark.parametrize("gpu_comm, cuda_aware, expected", [
    ("auto", "auto", ("auto", None)), ("auto", "yes", ("mpi", True)),
    ("auto", "no", ("staged", False)), ("mpi", "auto", ("mpi", None)),
    ("mpi", "yes", ("mpi", True)), ("staged", "auto", ("staged", False)),
    ("staged", "no", ("staged", False)), ("nccl", "auto", ("nccl", None)),
    ("nccl", "yes", ("nccl", True)), ("nccl", "no", ("nccl", False)),
    ("mpi", "no", None), ("staged", "yes", None),
])
def test_gpu_comm_and_cuda_aware(gpu_comm, cuda_aware, expected):
    """--cuda-aware is the MPI path's detail: yes is --gpu-comm mpi, no is staged; under nccl
    it says how the arrays NCCL does not carry reach MPI."""
    if expected is None:
        with pytest.raises(cli.UsageError, match=f"--gpu-comm {gpu_comm} contradicts "
                           f"--cuda-aware {cuda_aware}"):
            gpu_comm_choice(gpu_comm, cuda_aware)
    else:
        assert gpu_comm_choice(gpu_comm, cuda_aware) == expected


@pytest.mark.parametrize("argv, message", [
    (["--compute-dtype", "bfloat16", "--dtype", "float64"],
     "--compute-dtype bfloat16 needs --dtype float32"),
    (["--compute-dtype", "float32", "--dtype", "float64"],
     "--compute-dtype float32 needs --dtype float32"),
    (["--tf32", "--compute-dtype", "float16"], "--tf32 applies to float32 matmuls"),
    (["--tf32", "--dtype", "float64"], "--tf32 applies to float32 matmuls"),
    (["--gpu-comm", "mpi", "--cuda-aware", "no"], "--gpu-comm mpi contradicts --cuda-aware no"),
    (["--compute-dtype", "int8"], "argument --compute-dtype: invalid choice"),
    (["--gpu-comm", "gloo"], "argument --gpu-comm: invalid choice"),
])
def test_bad_combinations_are_usage_errors(argv, message):
    with pytest.raises(cli.UsageError, match=message):
        validate_train_args(parse_train_args(argv), 1)


@pytest.mark.parametrize("argv", [["--compute-dtype", "float32", "--dtype", "float64"],
                                  ["--tf32", "--dtype", "float64"]])
def test_the_engine_refuses_what_the_cli_refuses(argv):
    """The CLI's rule is the engine's (parallel/precision.py): make_engine's own TypeError."""
    args = parse_train_args(argv)
    options = {k: v for k, v in vars(args).items() if k in ("compute_dtype", "tf32")}
    with pytest.raises(TypeError):
        make_engine(MLP([2, 2]), "single", dtype=np.dtype(args.dtype), comm=MPI.COMM_SELF,
                    **options)


@pytest.mark.parametrize("argv, matmul, tf32, gpu_comm", [
    ([], None, False, "auto"),
    (["--compute-dtype", "float32"], None, False, "auto"),
    (["--compute-dtype", "bfloat16", "--cuda-aware", "no"], "bfloat16", False, "staged"),
    (["--compute-dtype", "float16", "--gpu-comm", "nccl"], "float16", False, "nccl"),
    (["--tf32", "--gpu-comm", "mpi"], None, True, "mpi"),
])
def test_bench_flags_reach_make_engine(argv, matmul, tf32, gpu_comm):
    args = add_bench_arguments(Parser()).parse_args(["--model", "8,8,2", "--device", "cpu",
                                                      *argv])
    engine = build_bench(args, MPI.COMM_SELF)[0]
    precision = engine.precision
    assert (None if precision.matmul is None else precision.matmul.name) == matmul
    assert precision.tf32 is tf32 and engine.backend.gpu_comm == gpu_comm


@pytest.mark.parametrize("argv, matmul, error", [
    (["--compute-dtype", "bfloat16"], None, "the run's dtype is float64"),
    (["--compute-dtype", "bfloat16", "--dtype", "float32"], "bfloat16", None),
    (["--gpu-comm", "staged", "--cuda-aware", "yes"], None, "contradicts --cuda-aware yes"),
])
def test_infer_generate_serve_flags_meet_the_checkpoints_dtype(argv, matmul, error):
    """infer, generate and serve build their engine through checkpoint_engine (or hf_engine):
    --dtype defaults to the checkpoint's, here float64, which 16-bit compute refuses."""
    args = Parser()
    add_compute_arguments(args)
    args = args.parse_args(["--device", "cpu", *argv])
    model = MLP([4, 4, 2])
    ckpt = model.init(seed=0)                         # float64 arrays
    if error is not None:
        with pytest.raises(cli.UsageError, match=error):
            checkpoint_engine(ckpt, model, "single", args, MPI.COMM_SELF)
    else:
        engine = checkpoint_engine(ckpt, model, "single", args, MPI.COMM_SELF)
        assert engine.precision.matmul.name == matmul


# -- real processes ----------------------------------------------------------------------------
def test_compute_float32_is_the_plain_run(tmp_path):
    """--compute-dtype float32 with --dtype float32 is the run without it, bit for bit."""
    rc, err, plain = train(1, tmp_path=tmp_path, name="plain")
    assert rc == 0, err
    rc, err, same = train(1, "--compute-dtype", "float32", tmp_path=tmp_path, name="same")
    assert rc == 0, err
    assert same["loss_history"] == plain["loss_history"] and same["steps"] == 2
    assert (same["compute_dtype"], same["tf32"]) == ("float32", False)
    assert "compute dtype" not in err


def test_bfloat16_compute_trains_logs_and_resumes_without_it(tmp_path):
    """Two steps of the digits MLP with bfloat16 matmuls: logged, recorded in the metrics;
    the checkpoint holds no compute dtype (a run setting), so a resume in float32 goes on."""
    ckpt = str(tmp_path / "ckpt")
    rc, err, m = train(1, "--compute-dtype", "bfloat16", "--dtype", "float32",
                       "--checkpoint-dir", ckpt, tmp_path=tmp_path, name="bf16")
    assert rc == 0, err
    assert err.count("compute dtype bfloat16: matmul inputs and outputs") == 1, err
    assert (m["dtype"], m["compute_dtype"], m["param_dtype"]) == ("float32", "bfloat16",
                                                                   "float32")
    assert m["steps"] == 2 and all(np.isfinite(m["loss_history"]))
    rc, err, m = train(1, "--checkpoint-dir", ckpt, "--resume", "--steps", "3",
                       tmp_path=tmp_path, name="resumed")
    assert rc == 0, err
    assert m["steps"] == 3 and m["compute_dtype"] == "float32" and "compute dtype" not in err


@pytest.mark.parametrize("command, argv, message", [
    ("train", ("--compute-dtype", "bfloat16", "--dtype", "float64"),
     "--compute-dtype bfloat16 needs --dtype float32"),
    ("bench", ("--model", "8,8,2", "--tf32", "--compute-dtype", "bfloat16"),
     "--tf32 applies to float32 matmuls"),
    ("train", ("--gpu-comm", "staged", "--cuda-aware", "yes"),
     "--gpu-comm staged contradicts --cuda-aware yes"),
    ("bench", ("--model", "8,8,2", "--dtype", "float64", "--param-dtype", "bfloat16"),
     "--param-dtype bfloat16 needs --dtype float32"),
])
def test_bad_combination_exits_2_with_one_line_on_two_ranks(command, argv, message):
    r = run_mpi(2, "-m", "mpishard", command, *argv, timeout=60)
    lines = engine_lines(r.stderr)            # Open MPI adds its own box on exit 2
    assert r.returncode == 2, r.stderr
    assert len(lines) == 1 and lines[0].startswith("mpishard: error: ") and message in lines[0]
    assert "Traceback" not in r.stderr + r.stdout

"""Preemption of a real 2-rank job (train/preemption.py): a signal mid-run -> exit 75 after a
checkpoint at one agreed step, and `--resume auto` then ends exactly where an uninterrupted
run ends (float64: every step's loss equal, bit for bit).

Serial tests: each launches its own `mpiexec -n 2 python -m mpi4py -m mpishard train` jobs and
signals the rank processes directly (no Slurm: tests/hpc/slurm_stage.sh has the batch cycle).
"""
import json
import signal
import sys

import pytest

from conftest import mpiexec_cmd, run_mpi
from running_job import RunningJob, train_steps

STEPS = 600
ARGS = ["--dataset", "synthetic-regression", "--model", "16,64,64,1", "--n-train", "2048",
        "--batch", "64", "--steps", str(STEPS), "--dtype", "float64", "--log-every", "1",
        "--no-progress", "--log-level", "WARNING"]


def train_argv(ckpt, metrics, *extra):
    return [*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", "-m", "mpishard", "train", *ARGS,
            "--checkpoint-dir", ckpt, "--resume", "auto", "--metrics-json", metrics, *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "metrics.json"
    proc = run_mpi(2, "-m", "mpishard", "train", *ARGS, "--metrics-json", path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text())


def preempt_and_resume(tmp_path, reference, send):
    """Run, `send(job)` once step 100 is recorded, expect exit 75, then rerun the same command
    line to the end; returns (the stopped step, the first run's output)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    jsonl = tmp_path / "ckpt.metrics.jsonl"             # the default beside --checkpoint-dir
    job = RunningJob(train_argv(ckpt, metrics), marker=str(ckpt))
    seen = job.wait_for_step(jsonl, 100)
    send(job)
    rc, out = job.finish(timeout=120)
    print(f"signalled at step {seen}; rc {rc}\n{out[-1500:]}")
    assert rc == 75, out[-3000:]
    stops = [s for s in out.splitlines() if "stopped by" in s]
    assert len(stops) == 1 and "checkpoint saved at step" in stops[0], out[-3000:]
    step = int(stops[0].split("checkpoint saved at step ")[1].split(";")[0])
    assert seen <= step < STEPS
    index = json.loads((ckpt / "index.json").read_text())
    assert index["step"] == step
    assert not metrics.exists()                          # no end-of-run summary: not the end
    assert train_steps(jsonl)[-1] == step

    rc, out = RunningJob(train_argv(ckpt, metrics), marker=str(ckpt)).finish(timeout=300)
    assert rc == 0, out[-3000:]
    got = json.loads(metrics.read_text())
    assert got["steps"] == STEPS
    assert got["loss_history"] == reference["loss_history"]         # bit for bit
    assert got["final_loss"] == reference["final_loss"]
    assert got["test_loss"] == reference["test_loss"]
    assert train_steps(jsonl) == list(range(1, STEPS + 1))      # no duplicate step, no gap
    last = json.loads(jsonl.read_text().splitlines()[-2])          # the last train record
    assert last["step"] == STEPS and len(last["rss_mib"]) == 2      # both ranks' memory
    return step, out


def test_sigusr1_to_one_rank_stops_the_whole_job(tmp_path, uninterrupted):
    """Only rank 1 receives SIGUSR1: the ranks agree at the next step boundary all the same."""
    preempt_and_resume(tmp_path, uninterrupted,
                       lambda job: job.signal(signal.SIGUSR1, ranks=[1]))


def test_sigterm_to_all_ranks_then_a_second_signal(tmp_path, uninterrupted):
    """SIGTERM to every rank, then SIGUSR1 while they stop and save: one stop, one intact
    checkpoint named after the first signal."""
    def send(job):
        job.signal(signal.SIGTERM)
        job.signal(signal.SIGUSR1)
    preempt_and_resume(tmp_path, uninterrupted, send)


def test_resume_auto_starts_fresh_and_bare_resume_still_needs_a_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    base = ["-m", "mpishard", "train", *ARGS, "--steps", "3", "--log-level", "INFO",
            "--checkpoint-dir", ckpt]
    proc = run_mpi(2, *base, "--resume", timeout=120)
    assert proc.returncode == 2 and "holds no checkpoint" in proc.stderr
    proc = run_mpi(2, *base, "--resume", "auto", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "training" in proc.stderr and "resumed from" not in proc.stderr
    proc = run_mpi(2, *base, "--resume", "auto", "--steps", "5", timeout=120)
    assert proc.returncode == 0 and f"resumed from {ckpt} at step 3" in proc.stderr
    assert train_steps(tmp_path / "ckpt.metrics.jsonl") == [1, 2, 3, 4, 5]
    other = tmp_path / "other"                 # --resume PATH: from there, saving to other
    proc = run_mpi(2, *base[:-1], other, "--resume", ckpt, "--steps", "7", timeout=120)
    assert proc.returncode == 0 and f"resumed from {ckpt} at step 5" in proc.stderr
    assert train_steps(tmp_path / "other.metrics.jsonl") == [6, 7]     # its own history
    assert json.loads((other / "index.json").read_text())["step"] == 7


def test_resume_in_a_config_file(tmp_path):
    from mpishard.cli.train import parse_train_args
    for text, value in (("resume = true", True), ('resume = "auto"', "auto"),
                        ("resume = false", None)):
        (tmp_path / "c.toml").write_text(text + "\n")
        assert parse_train_args(["--config", str(tmp_path / "c.toml")]).resume == value


def test_a_run_without_resume_over_a_checkpoint_is_warned(tmp_path, capsys):
    from mpishard.cli import main

    argv = ["train", "--dataset", "synthetic-regression", "--model", "16,8,1", "--steps", "2",
            "--no-progress", "--checkpoint-dir", str(tmp_path / "ckpt")]
    assert main(argv) == 0
    assert "holds a checkpoint" not in capsys.readouterr().err
    assert main(argv) == 0
    assert "holds a checkpoint; without --resume this run starts at step 0" in \
        capsys.readouterr().err
    assert main(argv + ["--resume", "auto"]) == 0
    assert "holds a checkpoint" not in capsys.readouterr().err

"""Preemption of a real 2-rank job (train/preemption.py): a signal mid-run -> exit 75 after a
checkpoint at one agreed step, and `--resume auto` then ends exactly where an uninterrupted
run ends (float64: every step's loss equal, bit for bit). A signal before the first step (the
engine build, a resume) -> exit 75 with no step trained; more signals during the save or after
it change no rank's exit code.

Serial tests: each launches its own `mpiexec -n 2 python -m mpi4py -m mpishard train` jobs and
signals the rank processes directly (no Slurm: tests/hpc/slurm_stage.sh has the batch cycle).
The jobs that are stopped run through held_train.py, which records every rank's exit code and
holds the ranks (inside the build, or after step HOLD_AT) while the test signals them: the test,
not the machine's speed, decides where in the run a signal lands.
"""
import json
import os
import signal
import sys
import time
from pathlib import Path

import pytest

from conftest import mpiexec_cmd, run_mpi
from running_job import RunningJob, last_step, train_steps

STEPS, HOLD_AT = 600, 100
ARGS = ["--dataset", "synthetic-regression", "--model", "16,64,64,1", "--n-train", "2048",
        "--batch", "64", "--steps", str(STEPS), "--dtype", "float64", "--log-every", "1",
        "--no-progress", "--log-level", "WARNING"]


HELD = Path(__file__).with_name("held_train.py")


def train_argv(ckpt, metrics, *extra, where=None, hold="-"):
    """The job's command line; with `where` (a directory) through held_train.py."""
    runner = ["-m", "mpishard"] if where is None else [HELD, where, hold]
    return [*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", *runner, "train", *ARGS,
            "--checkpoint-dir", ckpt, "--resume", "auto", "--metrics-json", metrics, *extra]


def rank_exits(where, n=2) -> list:
    """Each rank's exit code as held_train.py wrote it (None: the rank wrote none, killed)."""
    return [int((where / f"exit.{r}").read_text()) if (where / f"exit.{r}").exists() else None
            for r in range(n)]


def held_job(tmp_path, hold, *extra):
    """A job held in `hold` (a name in mpishard.cli.train, or `step:N`) on every rank; returns
    (job, where); `(where / "go").touch()` lets it go on."""
    where = tmp_path / "ranks"
    where.mkdir()
    job = RunningJob(train_argv(tmp_path / "ckpt", tmp_path / "metrics.json", *extra,
                                where=where, hold=hold), marker=str(tmp_path / "ckpt"))
    job.wait_for_files(where, "ready", range(2), "the ranks never reached " + hold)
    return job, where


def keep_signalling(job, signums=(signal.SIGTERM, signal.SIGUSR1)):
    """Send `signums` to every rank still running until the job ends."""
    while job.proc.poll() is None:
        for pid in job.ranks().values():
            for signum in signums:
                try:
                    os.kill(pid, signum)
                except ProcessLookupError:
                    pass
        time.sleep(0.005)


def the_stop_line(out) -> str:
    stops = [s for s in out.splitlines() if "stopped by" in s]
    assert len(stops) == 1, out[-3000:]
    return stops[0]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    path = tmp_path_factory.mktemp("reference") / "metrics.json"
    proc = run_mpi(2, "-m", "mpishard", "train", *ARGS, "--metrics-json", path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(path.read_text())


def preempt_and_resume(tmp_path, reference, send, ranks=(0, 1), then=None):
    """Run to step HOLD_AT and hold there, `send(job)`, let the job go on once the signal has
    reached `ranks` (then `then(job)`), expect exit 75, then rerun the same command line to the
    end; returns (the stopped step, the first run's output)."""
    ckpt, metrics = tmp_path / "ckpt", tmp_path / "metrics.json"
    jsonl = tmp_path / "ckpt.metrics.jsonl"             # the default beside --checkpoint-dir
    job, where = held_job(tmp_path, f"step:{HOLD_AT}")
    seen = job.wait_for_step(jsonl, HOLD_AT)
    assert seen == HOLD_AT                               # held there: provably mid-run
    send(job)
    job.wait_for_files(where, "signalled", ranks, "the signal never reached the ranks")
    (where / "go").touch()
    if then is not None:
        then(job)
    rc, out = job.finish(timeout=120)
    print(f"signalled at step {seen}; rc {rc}\n{out[-1500:]}")
    assert rc == 75 and rank_exits(where) == [75, 75], out[-3000:]
    stop = the_stop_line(out)
    assert "checkpoint saved at step" in stop, out[-3000:]
    step = int(stop.split("checkpoint saved at step ")[1].split(";")[0])
    assert step == seen + 1                  # the first step boundary after the signal
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
                       lambda job: job.signal(signal.SIGUSR1, ranks=[1]), ranks=[1])


def test_sigterm_to_all_ranks_then_more_signals(tmp_path, uninterrupted):
    """SIGTERM to every rank, then SIGTERM and SIGUSR1 again and again while they stop, save
    and exit: one stop, one intact checkpoint named after the first signal, 75 on every rank."""
    preempt_and_resume(tmp_path, uninterrupted, lambda job: job.signal(signal.SIGTERM),
                       then=keep_signalling)


def test_a_signal_during_the_engine_build_stops_before_the_first_step(tmp_path):
    """SIGUSR1 to rank 1 alone while every rank is inside make_engine: the ranks agree before
    the first step, train none, write no checkpoint (nothing to save) and exit 75."""
    job, where = held_job(tmp_path, "make_engine")
    job.signal(signal.SIGUSR1, ranks=[1])
    (where / "go").touch()
    rc, out = job.finish(timeout=120)
    assert rc == 75 and rank_exits(where) == [75, 75], out[-3000:]
    assert "stopped by SIGUSR1 at step 0: no checkpoint at step 0" in the_stop_line(out)
    assert not (tmp_path / "ckpt" / "index.json").exists()
    assert last_step(tmp_path / "ckpt.metrics.jsonl") is None        # no step trained
    assert not (tmp_path / "metrics.json").exists()


def test_signals_while_resuming_stop_at_the_resumed_step(tmp_path):
    """SIGTERM to every rank inside the resume of a step-3 checkpoint, then signals until the
    job ends: exit 75 everywhere, the step-3 checkpoint is the one to requeue from."""
    proc = run_mpi(2, "-m", "mpishard", "train", *ARGS, "--steps", "3",
                   "--checkpoint-dir", tmp_path / "ckpt", timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    job, where = held_job(tmp_path, "resume")
    job.signal(signal.SIGTERM)
    (where / "go").touch()
    keep_signalling(job)
    rc, out = job.finish(timeout=120)
    assert rc == 75 and rank_exits(where) == [75, 75], out[-3000:]
    assert "stopped by SIGTERM at step 3: checkpoint saved at step 3" in the_stop_line(out)
    assert json.loads((tmp_path / "ckpt" / "index.json").read_text())["step"] == 3
    assert train_steps(tmp_path / "ckpt.metrics.jsonl") == [1, 2, 3]


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


def test_in_process_a_signal_before_training_returns_75_and_gives_the_handlers_back(
        tmp_path, monkeypatch, capsys):
    """cli.main in this process: SIGUSR1 raised inside make_engine -> 75, no step, no
    checkpoint, and this process's own handlers back when main returns."""
    import mpishard.cli.train as train
    from mpishard.cli import main

    def build_signalled(*args, **kwargs):
        signal.raise_signal(signal.SIGUSR1)          # recorded by the command's flag
        return make_engine(*args, **kwargs)
    make_engine = train.make_engine
    monkeypatch.setattr(train, "make_engine", build_signalled)
    mine = lambda signum, frame: None                # noqa: E731
    before = {s: signal.signal(s, mine) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        assert main(["train", "--dataset", "synthetic-regression", "--model", "16,8,1",
                     "--steps", "2", "--no-progress", "--checkpoint-dir",
                     str(tmp_path / "ckpt")]) == 75
        assert [signal.getsignal(s) for s in before] == [mine, mine]
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)
    assert "stopped by SIGUSR1 at step 0: no checkpoint at step 0" in capsys.readouterr().err
    assert not (tmp_path / "ckpt").exists()

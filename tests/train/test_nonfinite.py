"""Non-finite losses and gradients: `train --on-nonfinite stop|skip --max-nonfinite K`.

    pytest -m "not mpi" tests/train/test_nonfinite.py

Serial tests; the CLI ones launch `mpiexec -n 2 python -m mpi4py -m mpishard train ...`. The
skip test feeds an npy data set with a few rows of inf: exactly the steps whose batch holds one
are dropped, every other step trains.
"""
import json

import numpy as np
import pytest

from mpishard.cli.train import parse_train_args, validate_train_args
from mpishard.cli.usage import UsageError
from mpishard.train.data import DistributedBatcher
from mpishard.train.nonfinite import NonFiniteGuard

from conftest import engine_lines, run_mpi

DIVERGE = ("train", "--dataset", "synthetic-regression", "--lr", "1e6", "--steps", "40",
           "--no-progress", "--log-every", "0")


def launch(*args):
    r = run_mpi(2, "-m", "mpishard", *args, timeout=120)
    print(f"rc {r.returncode}\nstdout: {r.stdout[-2000:]!r}\nstderr: {r.stderr[-4000:]!r}")
    return r


def ours(stderr: str) -> list:
    """stderr lines that are not log lines (`[rank N]`), the launcher's exit report (Open
    MPI's box) or the MPI library's own teardown chatter (UCX)."""
    return [ln for ln in engine_lines(stderr) if "[rank " not in ln and "UCX" not in ln]


def assert_quiet(stderr: str):
    for word in ("Warning", "Traceback", "overflow", "invalid value"):
        assert word not in stderr, f"{word!r} in stderr"


def test_stop_is_one_line_and_no_warnings():
    r = launch(*DIVERGE)
    assert r.returncode == 1
    assert_quiet(r.stderr)
    lines = ours(r.stderr)
    assert len(lines) == 1 and lines[0].startswith("mpishard: error: loss is "), lines
    assert "lower --lr or enable --clip" in lines[0]


def test_skip_stops_after_k_in_a_row():
    r = launch(*DIVERGE, "--on-nonfinite", "skip", "--max-nonfinite", "3")
    assert r.returncode == 1
    assert_quiet(r.stderr)
    lines = ours(r.stderr)
    assert len(lines) == 1 and "3 non-finite steps in a row" in lines[0], lines


def test_skip_drops_the_bad_steps_and_goes_on(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    bad = [5, 200, 301]
    x[bad, 0] = np.inf
    y = (x[:, 1] > 0).astype(np.int64)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    np.save(tmp_path / "x_test.npy", x[:64][np.isfinite(x[:64]).all(axis=1)])
    np.save(tmp_path / "y_test.npy", y[:64][np.isfinite(x[:64]).all(axis=1)])
    steps, batch = 24, 64
    metrics = tmp_path / "m.json"
    r = launch("train", "--dataset", f"npy:{tmp_path}", "--model", "8,16,2", "--steps", steps,
               "--batch", batch, "--lr", "0.01", "--on-nonfinite", "skip", "--no-progress",
               "--log-every", "0", "--metrics-json", metrics)
    assert r.returncode == 0
    assert_quiet(r.stderr)
    m = json.loads(metrics.read_text())
    batcher = DistributedBatcher(x, y, batch, seed=0)
    expected = sum(bool(np.isin(batcher.global_indices(*batcher.position(s)), bad).any())
                   for s in range(steps))
    print(f"skipped {m['nonfinite_skipped_steps']} of {steps}, expected {expected}")
    assert 0 < expected < steps
    assert m["nonfinite_skipped_steps"] == m["skipped_steps"] == expected
    assert m["steps"] == steps and np.isfinite(m["test_loss"])
    assert sum(not np.isfinite(v) for v in m["loss_history"]) == expected


def test_guard_options():
    with pytest.raises(ValueError, match="on_nonfinite must be one of"):
        NonFiniteGuard(None, "ignore")
    with pytest.raises(ValueError, match="max_nonfinite"):
        NonFiniteGuard(None, "skip", 0)
    a = parse_train_args(["--on-nonfinite", "skip", "--max-nonfinite", "4"])
    assert (a.on_nonfinite, a.max_nonfinite) == ("skip", 4)
    assert parse_train_args([]).on_nonfinite == "stop"
    with pytest.raises(UsageError, match="--max-nonfinite must be > 0"):
        validate_train_args(parse_train_args(["--max-nonfinite", "0"]), world_size=1)
    with pytest.raises(UsageError, match="invalid choice"):
        parse_train_args(["--on-nonfinite", "ignore"])

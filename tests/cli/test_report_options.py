"""train's --eval-every, --eval-batch, --eval-batches and --metrics-json (cli/report_options.py).

    pytest -q tests/cli/test_report_options.py
"""
import json

import pytest

from mpishard.cli import main
from mpishard.cli.train import build_training, parse_train_args, validate_train_args
from mpishard.cli.usage import UsageError

RUN = ["train", "--dataset", "synthetic-regression", "--model", "16,8,1", "--steps", "4",
       "--batch", "16", "--n-test", "40", "--no-progress", "--dtype", "float64"]


@pytest.mark.parametrize("argv, message", [
    (["--layout", "dp=4", "--eval-batch", "6"],
     "--eval-batch 6 must divide by the 4 data-parallel ranks of layout 'dp=4'"),
    (["--eval-batch", "0"], "--eval-batch must be"),
    (["--eval-batches", "-1"], "--eval-batches must be"),
    (["--eval-every", "5", "--eval-batches", "0"],
     "--eval-every 5 asks for evaluations that --eval-batches 0 turns off")])
def test_bad_evaluation_flags_are_one_usage_error(argv, message):
    with pytest.raises(UsageError, match=message):
        validate_train_args(parse_train_args(argv), world_size=4)


def test_the_flags_and_their_config_keys_reach_the_trainer(tmp_path):
    config = tmp_path / "run.toml"
    config.write_text("eval-batch = 8\neval_batches = 2\n")
    args = parse_train_args([*RUN[1:], "--config", str(config)])
    trainer = build_training(args)
    assert (trainer.eval_batch, trainer.eval_batches) == (8, 2)
    default = build_training(parse_train_args(["--accumulate", "2", *RUN[1:]]))
    assert (default.eval_batch, default.eval_batches) == (8, None)   # 16 / accumulate 2


def test_eval_batches_0_runs_no_evaluation(tmp_path, capsys):
    path = tmp_path / "m.json"
    assert main([*RUN, "--eval-batches", "0", "--metrics-json", str(path)]) == 0
    m = json.loads(path.read_text())
    assert m["test_loss"] is None and m["eval_history"] == []
    assert list(m["peak_rss_bytes"]) == ["train"]
    out = capsys.readouterr()
    assert "eval step" not in out.err and "| test loss     | -" in out.out


def test_eval_batches_bounds_what_is_scored(tmp_path):
    """One batch of 8 of the 40 test rows scores differently from the whole split, and the
    metrics file has each rank's peak memory per phase."""
    losses = {}
    for extra in ([], ["--eval-batch", "8", "--eval-batches", "1"]):
        path = tmp_path / f"m{len(extra)}.json"
        assert main([*RUN, *extra, "--metrics-json", str(path), "--log-level", "WARNING"]) == 0
        m = json.loads(path.read_text())
        losses[len(extra)] = m["test_loss"]
        assert set(m["peak_rss_bytes"]) == {"train", "eval"}
        assert len(m["peak_rss_bytes"]["eval"]) == 1 == len(m["rss_baseline_bytes"])
    assert losses[0] != losses[4]

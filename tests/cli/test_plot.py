"""`python -m mpishard plot` (cli/plot.py): the curves of real `train --metrics-jsonl` runs,
checked in the figure (one train, one validation and one throughput line per run, holding the
records' values) and in the PNG written."""
import json

import pytest

from mpishard.cli import main
from mpishard.cli.plot import draw, read_run

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two short single-rank runs of different learning rates, evaluated every 5 steps."""
    d = tmp_path_factory.mktemp("runs")
    paths = []
    for lr in ("0.01", "0.001"):
        path = d / f"lr{lr}.jsonl"
        assert main(["train", "--dataset", "synthetic-regression", "--model", "16,8,1",
                     "--steps", "20", "--batch", "16", "--lr", lr, "--log-every", "2",
                     "--eval-every", "5", "--no-progress", "--log-level", "WARNING",
                     "--metrics-jsonl", str(path)]) == 0
        paths.append(path)
    return paths


def test_figure_has_a_train_validation_and_throughput_line_per_run(two_runs):
    runs = {p.stem: read_run(p) for p in two_runs}
    fig = draw(runs)
    loss_ax, rate_ax = fig.axes
    assert [line.get_label() for line in loss_ax.get_lines()] == [
        "lr0.01 train", "lr0.01 validation", "lr0.001 train", "lr0.001 validation"]
    assert [line.get_label() for line in rate_ax.get_lines()] == [
        "lr0.01 samples/s", "lr0.001 samples/s"]
    records = [json.loads(s) for s in two_runs[1].read_text().splitlines()]
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert [r["step"] for r in train] == list(range(2, 21, 2))
    assert [r["step"] for r in evals] == [5, 10, 15, 20]
    line = loss_ax.get_lines()[2]
    assert list(line.get_xdata()) == [r["step"] for r in train]
    assert list(line.get_ydata()) == [r["loss"] for r in train]
    assert list(loss_ax.get_lines()[3].get_ydata()) == [r["test_loss"] for r in evals]
    assert loss_ax.get_yscale() == "log"


def test_plot_command_writes_a_png(two_runs, tmp_path, capsys):
    out = tmp_path / "curves.png"
    assert main(["plot", *map(str, two_runs), "--out", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1320, 495)                 # 12 x 4.5 inches at 110 dpi
    assert "wrote" in capsys.readouterr().out


@pytest.mark.parametrize("text, message", [("", "no metrics records"),
                                           ("{\"step\": 1}\n", "not a metrics record")])
def test_plot_refuses_what_is_not_a_metrics_file(tmp_path, text, message, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(text)
    assert main(["plot", str(bad), "--out", str(tmp_path / "x.png")]) == 2
    assert message in capsys.readouterr().err

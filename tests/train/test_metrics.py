"""The metrics stream (train/metrics.py): records of a real run equal the run's own histories,
a resumed run drops what came after its checkpoint (JSON lines, CSV, TensorBoard), a record cut
by a crash is dropped, and the --metrics-* flags' checks."""
import csv
import json
import struct
import sys

import pytest

from mpishard.cli import main
from mpishard.train.metrics import CSV_COLUMNS, CsvSink, JsonlSink, TensorBoardSink

RUN = ["train", "--dataset", "synthetic-regression", "--model", "16,8,1", "--steps", "12",
       "--batch", "16", "--log-every", "3", "--clip", "0.5", "--eval-every", "6",
       "--no-progress", "--log-level", "WARNING", "--dtype", "float64"]


def records(path):
    return [json.loads(s) for s in path.read_text().splitlines()]


def test_records_equal_the_runs_histories(tmp_path):
    jsonl, summary, table = tmp_path / "m.jsonl", tmp_path / "m.json", tmp_path / "m.csv"
    assert main([*RUN, "--metrics-jsonl", str(jsonl), "--metrics-json", str(summary),
                 "--metrics-csv", str(table)]) == 0
    m = json.loads(summary.read_text())
    got = records(jsonl)
    train = [r for r in got if r["kind"] == "train"]
    assert [r["step"] for r in train] == [3, 6, 9, 12]
    assert [r["loss"] for r in train] == [m["loss_history"][s - 1] for s in (3, 6, 9, 12)]
    assert [r["grad_norm"] for r in train] == [m["grad_norm_history"][s - 1]
                                               for s in (3, 6, 9, 12)]
    assert [r["lr"] for r in train] == [m["lr_history"][s - 1] for s in (3, 6, 9, 12)]
    assert all(len(r["rss_mib"]) == 1 and r["rss_mib"][0] > 10 for r in train)
    assert all(r["samples_per_s"] > 0 and r["step_time_s"] > 0 for r in train)
    evals = [r for r in got if r["kind"] == "eval"]
    assert [(r["step"], r["test_loss"]) for r in evals] == [
        (e["step"], e["test_loss"]) for e in m["eval_history"]]
    rows = list(csv.DictReader(table.open()))
    assert tuple(rows[0]) == CSV_COLUMNS
    assert [(r["kind"], int(r["step"]), r["loss"]) for r in rows if r["kind"] == "train"] == \
        [("train", r["step"], repr(r["loss"])) for r in train]


def lines_of(steps, cut=False):
    text = "".join(json.dumps({"kind": "train", "step": s, "loss": 1.0 / s}) + "\n"
                   for s in steps)
    return text + ('{"kind": "train", "st' if cut else "")


def test_resume_drops_records_past_its_step_and_a_cut_record(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(lines_of(range(1, 11), cut=True))        # a crash mid-write after step 10
    sink = JsonlSink(path)
    sink.open(6)                                             # resumed from the step-6 checkpoint
    sink.write({"kind": "train", "step": 7, "loss": 0.5})
    sink.close()
    assert [r["step"] for r in records(path)] == [1, 2, 3, 4, 5, 6, 7]
    sink = JsonlSink(path)
    sink.open(0)                                             # a fresh run starts the file anew
    sink.close()
    assert path.read_text() == ""


def test_csv_resume_keeps_the_header_and_earlier_rows(tmp_path):
    path = tmp_path / "m.csv"
    sink = CsvSink(path)
    sink.open(0)
    for s in (2, 4, 6):
        sink.write({"kind": "train", "step": s, "loss": 0.1 * s, "rss_mib": [5.0, 7.5]})
    sink.close()
    sink = CsvSink(path)
    sink.open(4)
    sink.write({"kind": "eval", "step": 4, "test_loss": 0.25})
    sink.close()
    rows = list(csv.DictReader(path.open()))
    assert [(r["kind"], r["step"], r["loss"], r["rss_mib_max"], r["test_loss"]) for r in rows] \
        == [("train", "2", "0.2", "7.5", ""), ("train", "4", "0.4", "7.5", ""),
            ("eval", "4", "", "", "0.25")]


def event_scalars(logdir):
    """[(tag, step, value)] of every event file in `logdir` (TFRecord frames of Event protos:
    length u64, its crc u32, the bytes, their crc u32); a purge (session START) is
    ("purge", step, 0.0)."""
    from tensorboardX.proto import event_pb2
    found = []
    for path in sorted(logdir.iterdir()):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + n])
            at += 12 + n + 4
            found += [(v.tag, event.step, v.simple_value) for v in event.summary.value]
            log = event.session_log
            if event.HasField("session_log") and log.status == log.START:
                found.append(("purge", event.step, 0.0))
    return found


def test_tensorboard_scalars_and_purge_on_resume(tmp_path):
    pytest.importorskip("tensorboardX")
    sink = TensorBoardSink(tmp_path)
    sink.open(0)
    sink.write({"kind": "train", "step": 3, "loss": 0.5, "lr": 0.25, "grad_norm": None,
                "rss_mib": [100.0, 120.0], "time": 1.0})
    sink.write({"kind": "eval", "step": 3, "test_loss": 0.75, "time": 1.0})
    sink.close()
    first = [("eval/test_loss", 3, 0.75), ("train/loss", 3, 0.5), ("train/lr", 3, 0.25),
             ("train/rss_mib_max", 3, 120.0)]
    assert sorted(event_scalars(tmp_path)) == first
    sink = TensorBoardSink(tmp_path)
    sink.open(2)                      # resumed at step 2: TensorBoard drops steps >= 3 seen so far
    sink.write({"kind": "train", "step": 3, "loss": 0.125, "time": 2.0})
    sink.close()
    assert sorted(event_scalars(tmp_path)) == sorted(first + [("purge", 3, 0.0),
                                                              ("train/loss", 3, 0.125)])


def test_tensorboard_without_tensorboardx_is_a_usage_error(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "tensorboardX", None)         # import raises ImportError
    assert main([*RUN, "--tensorboard", str(tmp_path / "tb")]) == 2
    assert "--tensorboard needs tensorboardX: pip install 'mpishard[tensorboard]'" in \
        capsys.readouterr().err


def test_metrics_flag_checks(tmp_path, capsys):
    assert main([*RUN, "--metrics-jsonl", str(tmp_path / "no" / "m.jsonl")]) == 2
    assert "directory" in capsys.readouterr().err
    assert main([*RUN, "--resume", "auto"]) == 2
    assert "--resume auto needs --checkpoint-dir DIR" in capsys.readouterr().err
    assert main([*RUN, "--resume", str(tmp_path)]) == 2
    assert "no checkpoint there" in capsys.readouterr().err


def test_a_preempted_run_syncs_and_closes_its_sinks(tmp_path):
    """A stop raises Preempted out of on_step_end, so fit's on_train_end never runs: the CLI's
    fit_or_preempted still syncs and closes the sinks (a TensorBoard writer buffers its events
    until then)."""
    import signal
    from types import SimpleNamespace

    import numpy as np

    import mpishard as ms
    from mpishard.cli.cluster_options import fit_or_preempted
    from mpishard.train.data import synthetic_regression
    from mpishard.train.metrics import MetricsStream
    from mpishard.train.optim import SGD
    from mpishard.train.preemption import Preemption, StopFlag
    from mpishard.train.trainer import Callback, Trainer

    class Sink:
        calls: list = []

        def open(self, step):
            self.calls.append("open")

        def write(self, record):
            self.calls.append(record["step"])

        def sync(self):
            self.calls.append("sync")

        def close(self):
            self.calls.append("close")

    class SignalAt3(Callback):
        def on_step_end(self, trainer):
            if trainer.state.step == 3:
                signal.raise_signal(signal.SIGUSR1)

    model = ms.MLP([4, 8, 1])
    e = ms.SingleDevice(model, dtype=np.float64)
    e.load_checkpoint(model.init(seed=0))
    t = Trainer(e, SGD(e, 0.05), synthetic_regression(128, 32, d_in=4, seed=1), batch=16,
                steps=20, progress=False, log_every=1,
                callbacks=[SignalAt3(), MetricsStream([Sink()]), Preemption(StopFlag())])
    assert fit_or_preempted(t, SimpleNamespace(metrics_json=None)) is None
    assert Sink.calls == ["open", 1, 2, 3, "sync", "close"]

"""Metrics while the run runs: one record every `log_every` steps to JSON lines, CSV, TensorBoard.

    trainer.callbacks.append(MetricsStream([JsonlSink("m.jsonl"), CsvSink("m.csv")]))

A train record (rank 0 writes it; every rank takes part in the memory gather):

    {"kind": "train", "step": 200, "loss": 1.93, "lr": 0.003, "grad_norm": 0.41 | null,
     "samples_per_s": 812.0, "tokens_per_s": 52000.0 (language models; fine-tune rows: the
     counted targets), "step_time_s": 0.079,
     "rss_mib": [412.1, 408.9], "time": 1764170000.1}

plus, for a mixture-of-experts model (expert_load.py: the step's tokens per expert),
{"expert_tokens": [52, 30, 41, 45], "expert_tokens_min": 30, "expert_tokens_max": 52,
 "expert_imbalance": 1.31, "moe_dropped": 0} (the CSV has all but the list).

`step_time_s` and the rates are over the steps since the previous record (the Trainer's own
train-step time, callbacks excluded); `grad_norm` is the clipped-to norm, known with --clip only;
`rss_mib` is every rank's resident set, gathered with one bounded gather (comm/objects.py). An
evaluation adds {"kind": "eval", "step", "test_loss", "test_accuracy" / "val_bits_per_byte"
(byte-level text) / "val_bits_per_token" (a tokenizer's ids)}.

Crash safety and resume: each record is flushed as it is written (a crashed run keeps its
history up to its last record) and fsynced after a step whose checkpoint was saved and at the
end. On a resumed run (`trainer.state.step` = s > 0 at the start) the sinks first DROP the
records of steps > s, written after the checkpoint the run resumes from, so the file reads as
one run without duplicate steps; a fresh run (s = 0) starts the file empty.
"""
from __future__ import annotations

import csv
import json
import os
import time

from ..comm.objects import gather_json
from .trainer import Callback

CSV_COLUMNS = ("kind", "step", "loss", "lr", "grad_norm", "samples_per_s", "tokens_per_s",
               "step_time_s", "rss_mib_max", "test_loss", "test_accuracy", "val_bits_per_byte",
               "val_bits_per_token", "expert_tokens_min", "expert_tokens_max",
               "expert_imbalance", "moe_dropped")


def rss_mib() -> float:
    """This process's resident set in MiB (/proc/self/statm; 0.0 without /proc)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return 0.0
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def _kept_lines(path, step: int, parse) -> list:
    """The lines of `path` whose record (`parse(line)` -> step or None) is at most `step`;
    unparsable lines (a record cut by a crash) are dropped too."""
    try:
        with open(path) as f:
            lines = f.read().splitlines(keepends=True)
    except FileNotFoundError:
        return []
    kept = []
    for line in lines:
        s = parse(line)
        if s is not None and s <= step and line.endswith("\n"):
            kept.append(line)
    return kept


def _rewrite(path, lines) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.writelines(lines)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


class JsonlSink:
    """Records as JSON lines, appended to `path`."""

    def __init__(self, path):
        self.path, self.file = os.fspath(path), None

    def open(self, step: int) -> None:
        def parse(line):
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                return None
        _rewrite(self.path, _kept_lines(self.path, step, parse) if step else [])
        self.file = open(self.path, "a")

    def write(self, record: dict) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()

    def sync(self) -> None:
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


class CsvSink(JsonlSink):
    """Records as CSV rows (CSV_COLUMNS; an empty cell where a record lacks the value)."""

    def open(self, step: int) -> None:
        def parse(line):
            cells = line.split(",")
            return int(cells[1]) if len(cells) > 1 and cells[1].isdigit() else None
        header = ",".join(CSV_COLUMNS) + "\n"
        _rewrite(self.path, [header, *(_kept_lines(self.path, step, parse) if step else [])])
        self.file = open(self.path, "a", newline="")
        self.writer = csv.DictWriter(self.file, CSV_COLUMNS, extrasaction="ignore",
                                     lineterminator="\n")

    def write(self, record: dict) -> None:
        row = dict(record, rss_mib_max=max(record["rss_mib"]) if "rss_mib" in record else None)
        self.writer.writerow(row)
        self.file.flush()


class TensorBoardSink:
    """Scalars through tensorboardX (`train/loss`, `eval/test_loss`, ...) into `logdir`;
    a resumed run purges the events after its step (SummaryWriter's purge_step)."""

    def __init__(self, logdir):
        from tensorboardX import SummaryWriter        # the `tensorboard` extra
        self.logdir, self.writer, self._cls = os.fspath(logdir), None, SummaryWriter

    def open(self, step: int) -> None:
        self.writer = self._cls(self.logdir, purge_step=step + 1 if step else None,
                                filename_suffix=f".{os.getpid()}.{time.time_ns()}")

    def write(self, record: dict) -> None:
        kind = record["kind"]
        for key, value in record.items():
            if key not in ("kind", "step", "time") and isinstance(value, (int, float)):
                self.writer.add_scalar(f"{kind}/{key}", value, record["step"])
        if "rss_mib" in record:
            self.writer.add_scalar("train/rss_mib_max", max(record["rss_mib"]), record["step"])

    def sync(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class MetricsStream(Callback):
    """Trainer callback: a train record every `trainer.log_every` steps and an eval record per
    evaluation, written by rank 0 to each sink (module docstring). `saver` (the Checkpointer,
    or None): its `last_saved` step triggers an fsync."""

    def __init__(self, sinks, saver=None):
        self.sinks, self.saver = list(sinks), saver
        self._mark = None            # (step, train_time, run_tokens) at the previous record

    def on_train_begin(self, trainer) -> None:
        self._mark = (trainer.state.step, trainer.train_time, trainer.run_tokens)
        if trainer.rank == 0:
            for sink in self.sinks:
                sink.open(trainer.state.step)

    def on_step_end(self, trainer) -> None:
        st = trainer.state
        if not trainer.log_every or st.step % trainer.log_every:
            return
        rss = gather_json(trainer.engine.comm, round(rss_mib(), 1), "metrics memory")
        if trainer.rank != 0:
            return
        steps, seconds = st.step - self._mark[0], trainer.train_time - self._mark[1]
        tokens = trainer.run_tokens - self._mark[2]
        self._mark = (st.step, trainer.train_time, trainer.run_tokens)
        record = {"kind": "train", "step": st.step, "loss": st.loss_history[-1],
                  "lr": st.lr_history[-1],
                  "grad_norm": st.grad_norm_history[-1] if trainer.clip else None,
                  "samples_per_s": steps * trainer.batch / seconds if seconds > 0 else 0.0}
        if trainer.data.masked:              # fine-tune rows: the counted targets
            record["tokens_per_s"] = tokens / seconds if seconds > 0 else 0.0
        elif trainer.data.task == "language":
            record["tokens_per_s"] = record["samples_per_s"] * trainer.data.x_train.shape[1]
        record.update(getattr(trainer, "expert_load", {}))   # a mixture of experts' load
        record.update(step_time_s=seconds / steps if steps else 0.0, rss_mib=rss,
                      time=time.time())
        self._write(record, synced=self.saver is not None and self.saver.last_saved == st.step)

    def on_evaluate(self, trainer, result: dict) -> None:
        if trainer.rank == 0:
            self._write({"kind": "eval", **result, "time": time.time()}, synced=False)

    def on_train_end(self, trainer, metrics) -> None:
        if trainer.rank == 0:
            for sink in self.sinks:
                sink.sync()
                sink.close()

    def _write(self, record, synced: bool) -> None:
        for sink in self.sinks:
            sink.write(record)
            if synced:
                sink.sync()


__all__ = ["CSV_COLUMNS", "CsvSink", "JsonlSink", "MetricsStream", "TensorBoardSink", "rss_mib"]

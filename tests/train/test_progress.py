"""Progress without a terminal is plain lines; a slow evaluation says so (train/progress.py).

    pytest -q tests/train/test_progress.py
"""
import logging
import sys
import time

import numpy as np

import mpishard as ms
from mpishard.train.data import synthetic_regression
from mpishard.train.optim import SGD
from mpishard.train.progress import Lines, progress_bar
from mpishard.train.trainer import Trainer


def tiny_trainer(steps, **kw):
    e = ms.SingleDevice(ms.MLP([4, 8, 1]))
    e.load_checkpoint(ms.MLP([4, 8, 1]).init(0))
    data = synthetic_regression(64, 16, d_in=4, d_out=1, seed=0)
    return Trainer(e, SGD(e, 0.01), data, batch=8, steps=steps, **kw)


def test_progress_into_a_file_is_plain_lines(tmp_path, monkeypatch):
    path = tmp_path / "job.log"
    with open(path, "w") as f:
        monkeypatch.setattr(sys, "stderr", f)            # a batch job's log, not a terminal
        tiny_trainer(40, progress=True, log_every=0).fit()
    text = path.read_text()
    print(text)
    assert "\r" not in text
    lines = [ln for ln in text.splitlines() if ": step " in ln]
    assert [ln.split(": step ")[1].split()[0] for ln in lines] == \
        [f"{s}/40" for s in range(2, 41, 2)]                     # every 40 // 20 steps
    assert all(ln.startswith("train single: step ") and " loss " in ln for ln in lines)


def test_a_terminal_gets_the_bar_and_log_every_replaces_the_lines(tmp_path):
    class Tty:
        def isatty(self):
            return True

        def write(self, s):
            pass

        def flush(self):
            pass

    bar = progress_bar(10, 0, "train", 0, stream=Tty())
    assert type(bar).__name__ == "tqdm"
    bar.close()
    with open(tmp_path / "log", "w") as f:
        assert isinstance(progress_bar(10, 0, "train", 0, stream=f), Lines)
        assert progress_bar(10, 0, "train", 5, stream=f) is None     # --log-every lines suffice


def test_a_slow_evaluation_says_it_is_still_running_at_growing_intervals():
    """A 1.6 s evaluation with a 0.1 s notice: lines after 0.1, 0.3, 0.7 and 1.5 s (each wait
    twice the last), not one every 0.1 s; a quick evaluation says nothing."""
    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())
            times.append(record.created)

    times = []
    log = logging.getLogger("test-progress-slow-eval")
    log.setLevel(logging.INFO)
    log.propagate = False
    log.addHandler(Keep())
    t = tiny_trainer(2, progress=False, log_every=0, logger=log)
    t.eval_notice_s = 0.1
    evaluate = t.evaluate

    def slow():
        time.sleep(1.6)
        return evaluate()

    t.evaluate = slow
    t.fit()
    notes = [(at, r) for at, r in zip(times, records) if "still running" in r]
    waits = np.diff([at for at, _ in notes])
    print(notes, waits)
    assert 2 <= len(notes) <= 4 and notes[0][1].startswith("evaluation at step 2: still running")
    assert all(later > 1.5 * earlier for earlier, later in zip(waits, waits[1:])), waits
    records.clear()
    t.evaluate = evaluate                  # a quick one says nothing
    t.eval_notice_s = 5.0
    t._evaluate_and_log()
    assert not [r for r in records if "still running" in r]

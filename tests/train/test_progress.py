"""Progress without a terminal is plain lines; a slow evaluation says so (train/progress.py).

    pytest -q tests/train/test_progress.py
"""
import logging
import sys
import threading
import time

import mpishard as ms
from mpishard.train.data import synthetic_regression
from mpishard.train.optim import SGD
from mpishard.train.progress import Lines, progress_bar, slow_notice
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


class Keep(logging.Handler):
    """Collects the messages of a private logger."""

    def __init__(self, name):
        super().__init__()
        self.messages = []
        self.log = logging.getLogger(name)
        self.log.setLevel(logging.INFO)
        self.log.propagate = False
        self.log.addHandler(self)

    def emit(self, record):
        self.messages.append(record.getMessage())


class Timer:
    """A stand-in for slow_notice's Event: each wait(timeout) is recorded and moves a fake
    clock by `timeout` without sleeping; after `times` waits the next blocks until set()."""

    def __init__(self, times):
        self.timeouts, self.now, self.times = [], 100.0, times
        self.passed, self.real = threading.Event(), threading.Event()

    def clock(self):
        return self.now

    def wait(self, timeout):
        self.timeouts.append(timeout)
        if len(self.timeouts) > self.times:
            self.passed.set()
            return self.real.wait()
        self.now += timeout
        return False

    def set(self):
        self.real.set()


def test_a_slow_evaluation_says_it_is_still_running_at_doubling_intervals():
    """The notice waits 5 s, then twice the last wait each time (lines after 5, 15, 35, 75 s),
    so a long evaluation adds a line only now and then; the line gives the time since start."""
    keep, timer = Keep("test-progress-schedule"), Timer(times=4)
    with slow_notice(keep.log, "evaluation at step 7", 5.0, done=timer, clock=timer.clock):
        assert timer.passed.wait(30)
    assert timer.timeouts == [5.0, 10.0, 20.0, 40.0, 80.0]
    assert keep.messages == [f"evaluation at step 7: still running after {s} s"
                             for s in (5, 15, 35, 75)]


def test_a_quick_block_says_nothing():
    keep, timer = Keep("test-progress-quick"), Timer(times=0)
    with slow_notice(keep.log, "evaluation at step 1", 5.0, done=timer, clock=timer.clock):
        assert timer.passed.wait(30)
    assert timer.timeouts == [5.0] and keep.messages == []


def test_the_trainer_notices_a_slow_evaluation():
    """fit() runs each evaluation inside slow_notice with the trainer's eval_notice_s; a quick
    evaluation with the default 5 s says nothing."""
    keep = Keep("test-progress-slow-eval")
    t = tiny_trainer(2, progress=False, log_every=0, logger=keep.log)
    t.eval_notice_s = 0.05
    evaluate = t.evaluate

    def slow():
        time.sleep(1.0)
        return evaluate()

    t.evaluate = slow
    t.fit()
    notes = [m for m in keep.messages if "still running" in m]
    assert notes and notes[0].startswith("evaluation at step 2: still running after "), notes
    keep.messages.clear()
    t.evaluate = evaluate
    t.eval_notice_s = 5.0
    t._evaluate_and_log()
    assert not [m for m in keep.messages if "still running" in m]

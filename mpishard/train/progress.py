"""Progress on rank 0: a tqdm bar on a terminal, plain periodic lines in a log file, and a
notice while a slow evaluation runs.

A bar redraws its line with carriage returns; written to a file (a batch job's log) that is one
huge line of overwritten text. So `progress_bar` draws the tqdm bar only when its stream is a
terminal. Otherwise the --log-every lines are the progress (it returns None), and with
--log-every 0 it returns `Lines`, which writes one plain line ('\\n'-terminated, no '\\r') every
twentieth of the run and at the last step.

`slow_notice(log, what, after)` is a context manager: a daemon timer thread that, while the
block still runs, logs "<what>: still running after N s" once `after` seconds have passed, then
after each wait twice the one before (5, 15, 35, 75 s, ...), so a long evaluation is not
mistaken for a hang and a very long one adds a line only now and then. It never touches the
engine or MPI (a log line from a thread only).
"""
from __future__ import annotations

import sys
import threading
import time
from contextlib import contextmanager

EVAL_NOTICE_S = 5.0


class Lines:
    """The non-terminal progress: `update(1)` per step, a plain line every `every` steps."""

    def __init__(self, total, initial, desc, every, stream):
        self.n, self.total, self.desc, self.every, self.stream = initial, total, desc, every, stream
        self.postfix, self.t0, self.n0 = {}, time.perf_counter(), initial

    def set_postfix(self, refresh=False, **kw):
        self.postfix = kw

    def update(self, k=1):
        self.n += k
        if self.n % self.every == 0 or self.n == self.total:
            dt = time.perf_counter() - self.t0
            rate = (self.n - self.n0) / dt if dt > 0 else 0.0
            extra = "".join(f" {k} {v}" for k, v in self.postfix.items())
            self.stream.write(f"{self.desc}: step {self.n}/{self.total} "
                              f"({100 * self.n / self.total:.0f}%) {rate:.2f} steps/s{extra}\n")
            self.stream.flush()

    def close(self):
        pass


def progress_bar(total, initial, desc, log_every, stream=None):
    """A tqdm bar on a terminal; `Lines` otherwise, or None when --log-every lines exist."""
    stream = sys.stderr if stream is None else stream
    if not _isatty(stream):
        return None if log_every else Lines(total, initial, desc, max(1, total // 20), stream)
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, unit="step", desc=desc, file=stream,
                dynamic_ncols=True, mininterval=0.2)


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


@contextmanager
def slow_notice(log, what: str, after: float = EVAL_NOTICE_S, *, done=None,
                clock=time.perf_counter):
    """Log '<what>: still running after N s' after `after` seconds while the block runs,
    then after waits that double each time. `done` (a threading.Event by default: its
    wait(timeout) is the timer, set() ends it) and `clock` let a test drive the schedule."""
    done = threading.Event() if done is None else done
    t0 = clock()

    def watch():
        wait = after
        while not done.wait(wait):
            log.info("%s: still running after %.0f s", what, clock() - t0)
            wait *= 2

    thread = threading.Thread(target=watch, name="mpishard-slow-notice", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
        thread.join()


__all__ = ["EVAL_NOTICE_S", "Lines", "progress_bar", "slow_notice"]

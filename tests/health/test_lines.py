"""A line is one write (mpishard/health/lines.py): the logging handler mpishard installs, the
guard's and the uncaught-exception report's error lines and the signal handler's line reach
the file descriptor in one os.write each, newline included, so the lines of several ranks
sharing a launcher's stream never run together."""
import io
import logging
import os

import pytest

from mpishard.health import lines, uncaught
from mpishard.train.trainer import configure_logging


class Spy(io.TextIOWrapper):
    """stderr as Python sets it up when redirected (write-through onto a raw FileIO), recording
    every write that reaches the file descriptor: its own and os.write's on its fd."""

    def __init__(self, fd, writes):
        super().__init__(io.FileIO(fd, "w", closefd=False), write_through=True)
        self.writes = writes

    def write(self, text):
        self.writes.append(text.encode())
        return super().write(text)


@pytest.fixture
def pipe(monkeypatch):
    r, w = os.pipe()
    writes = []
    real = os.write

    def spy_write(fd, data):
        if fd == w:
            writes.append(bytes(data))
        return real(fd, data)

    monkeypatch.setattr(lines.os, "write", spy_write)
    yield Spy(w, writes), writes, r
    os.close(r)
    os.close(w)


def test_write_line_is_one_write_with_its_newline(pipe):
    stream, writes, r = pipe
    lines.write_line("mpishard: error: ValueError: bad (rank 1)", stream)
    lines.write_line("two\nlines\n", stream)
    assert writes == [b"mpishard: error: ValueError: bad (rank 1)\n", b"two\nlines\n"]
    assert os.read(r, 1024) == b"mpishard: error: ValueError: bad (rank 1)\ntwo\nlines\n"


def test_write_line_to_a_descriptor_and_to_a_stream_without_one(pipe):
    _, writes, r = pipe
    lines.write_line("mpishard: rank 1 received SIGTERM", pipe[0].fileno())
    assert writes == [b"mpishard: rank 1 received SIGTERM\n"]
    captured = io.StringIO()
    lines.write_line("no descriptor", captured)
    assert captured.getvalue() == "no descriptor\n"


def test_the_log_handler_writes_each_line_once(pipe):
    """tqdm.write (the handler's former path) wrote a message and its newline separately."""
    stream, writes, _ = pipe
    log = configure_logging(0, name="mpishard.test_lines")
    handler = next(h for h in log.handlers if getattr(h, "_mpishard", False))
    handler.setStream(stream)
    try:
        log.info("step 20/100 loss 0.5")
        log.warning("rank 1 arrived last")
    finally:
        log.removeHandler(handler)
    assert len(writes) == 2 and all(w.endswith(b"\n") and w.count(b"\n") == 1 for w in writes)
    assert writes[0].endswith(b"INFO mpishard.test_lines: step 20/100 loss 0.5\n"), writes
    assert logging.getLogger("mpishard.test_lines").handlers == []


def test_the_uncaught_report_writes_each_traceback_and_each_error_line_whole(pipe, monkeypatch):
    stream, writes, _ = pipe
    monkeypatch.setattr("sys.stderr", stream)
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\nValueError: bad\n"
    uncaught._write_report([(1, "ValueError", "bad", tb), (0, "ValueError", "bad", tb),
                            (2, "KeyError", "'k'", tb)])
    text = b"".join(writes).decode()
    assert text == uncaught.format_report([(1, "ValueError", "bad", tb),
                                           (0, "ValueError", "bad", tb),
                                           (2, "KeyError", "'k'", tb)])
    assert writes[-2:] == [b"mpishard: error: ValueError: bad (ranks 0-1)\n",
                           b"mpishard: error: KeyError: 'k' (rank 2)\n"]
    assert len(writes) == 4 and writes[0].startswith(b"mpishard: ValueError on ranks 0-1; ")

"""Whole lines in one write, so the lines of several ranks never run together.

Under a launcher every rank's stderr is a pipe that the launcher copies into one stream as it
reads it. Python's sys.stderr writes through to the file descriptor on every `write`, and
`print(msg)` and tqdm's `write` write the message and its newline separately: a line of one rank
can then land between another rank's message and its newline. `write_line` makes a line (or a
block of lines) one `os.write` of its encoded bytes, newline included: the pipe delivers a write
of up to PIPE_BUF (4096) bytes whole. Plain `os` calls, so a signal handler may use it.
"""
from __future__ import annotations

import os
import sys

__all__ = ["write_line"]


def write_line(text: str, stream=None) -> None:
    """Write `text` (a newline added when it has none) to `stream` (default sys.stderr; an
    int: that file descriptor, touching no Python stream, as a signal handler must) as one
    `os.write` of the whole (a longer text: the rest follows at once); a stream without a file
    descriptor (a test's capture) gets one `write`. Never raises: a report must not fail."""
    stream = sys.stderr if stream is None else stream
    if stream is None:
        return
    if not text.endswith("\n"):
        text += "\n"
    if isinstance(stream, int):
        fd = stream
    else:
        try:
            fd = stream.fileno()
        except (AttributeError, OSError, ValueError):     # io.UnsupportedOperation is both
            fd = None
    try:
        if fd is None:
            stream.write(text)
            stream.flush()
            return
        if not isinstance(stream, int):
            stream.flush()              # what the stream holds goes out before this line
        data = text.encode(getattr(stream, "encoding", None) or "utf-8", errors="replace")
        while data:
            data = data[os.write(fd, data):]
    except (OSError, ValueError):       # a closed stream or pipe: nothing left to tell
        pass

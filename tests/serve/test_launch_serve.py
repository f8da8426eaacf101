"""`launch -- serve`: a server needs no --checkpoint-dir; a rank killed under it is relaunched
with the same command (no --resume) and serves again; the SIGTERM the supervisor gets reaches
the ranks as SIGUSR1, which drains the server (a running request still completes), and the
job and the supervisor exit 0.

Serial: the test starts its own `launch` (which starts `mpiexec -n 2`).
"""
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import pytest

from serve_job import (LISTENING, ROOT, leftovers, mpiexec_cmd, references, serving_pids,
                       write_model)

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")


class Supervised:
    """`python -m mpishard launch -n 2 --max-restarts 1 -- serve ...`, its output read."""

    def __init__(self, directory):
        self.before = leftovers.mpi_files()
        launcher = shlex.join(mpiexec_cmd(2)[:-2])
        argv = [sys.executable, "-m", "mpishard", "launch", "-n", "2", "--max-restarts", "1",
                "--launcher", launcher, "--", "serve", "--hf", directory, "--tokenizer",
                "bytes", "--dtype", "float64", "--layout", "tp=2", "--port", "0",
                "--drain-timeout", "60"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=ROOT, start_new_session=True)
        self.lines = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def url(self, nth: int, timeout: float = 120.0) -> str:
        """The URL of the nth listening line (1: the first job's, 2: its restart's)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [m.group(1) for m in map(LISTENING.match, list(self.lines)) if m]
            if len(found) >= nth:
                return found[nth - 1]
            assert self.proc.poll() is None, "\n".join(self.lines)
            time.sleep(0.05)
        raise AssertionError("no listening line:\n" + "\n".join(self.lines))

    def finish(self, directory, timeout: float = 120.0):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.lines.append(f"(still running after {timeout} s: killed)")
        finally:
            for pid in {self.proc.pid, *serving_pids(directory, ranks_only=False)}:
                try:                     # mpiexec and its ranks left by a failed test too
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for path in leftovers.left_since(self.before):
                try:
                    os.unlink(path)
                except FileNotFoundError:    # its owner (another job on the node) removed it
                    pass
        return self.proc.returncode, "\n".join(self.lines)


def complete(url, prompt: bytes, max_tokens: int) -> dict:
    body = json.dumps({"model": "gpt", "prompt": prompt.decode(), "max_tokens": max_tokens,
                       "temperature": 0}).encode()
    req = urllib.request.Request(url + "/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_launch_restarts_a_killed_server_and_drains_it_on_sigterm(tmp_path):
    directory = write_model(tmp_path / "gpt", "gpt")
    job = Supervised(directory)
    try:
        first = job.url(1)
        want = references(directory, [b"launch"], 50)[0]
        assert complete(first, b"launch", 20)["usage"]["completion_tokens"] == 20
        ranks = serving_pids(directory)
        assert len(ranks) == 2, job.lines
        os.kill(ranks[-1], signal.SIGKILL)
        second = job.url(2)
        body = json.dumps({"model": "gpt", "prompt": "launch", "max_tokens": 50,
                           "temperature": 0, "stream": True}).encode()
        req = urllib.request.Request(second + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        chunks = []
        with urllib.request.urlopen(req, timeout=120) as stream:
            for raw in stream:                   # the request is running when the drain
                line = raw.decode().strip()      # starts: it still ends, whole
                if line.startswith("data: {"):
                    chunks.append(json.loads(line[6:])["choices"][0])
                    if len(chunks) == 1:
                        job.proc.send_signal(signal.SIGTERM)
    finally:
        rc, out = job.finish(directory)
    assert rc == 0, out[-3000:]
    lines = [s for s in out.splitlines() if s.startswith("mpishard launch:")]
    starts = [s for s in lines if "starting:" in s]
    assert len(starts) == 2 and all("--resume" not in s for s in starts), lines
    assert any(re.search(r"job ended \(.*\); restart 1 of 1$", s) for s in lines), lines
    assert chunks, out[-3000:]
    assert "".join(c["text"] for c in chunks) == bytes(want).decode("utf-8", errors="replace")
    assert chunks[-1]["finish_reason"] == "length"


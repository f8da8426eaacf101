"""A stalled rank ends a server with the watchdog's named-rank error, not a hung server.

`serve --timeout 3` on tp=2; rank 1 is stopped (SIGSTOP) while the server is idle, then a
request comes: rank 0's first collective of the step waits for rank 1 at most 3 s, and the
job ends non-zero with `mpishard: error: CollectiveTimeout: ... late ranks: [1]`.

Serial: the test starts its own `mpiexec -n 2`.
"""
import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from serve_job import ServeJob, serving_pids, write_model

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
TIMEOUT = 3


def test_a_stalled_rank_ends_the_server_with_a_named_error(tmp_path):
    directory = write_model(tmp_path / "gpt", "gpt")
    job = ServeJob(2, ["--hf", directory, "--tokenizer", "bytes", "--layout", "tp=2",
                       "--timeout", TIMEOUT, "--heartbeat", 0.5],
                   env={"MPISHARD_FLIGHT_DIR": str(tmp_path)})
    stopped = serving_pids(directory)[1]
    try:
        os.kill(stopped, signal.SIGSTOP)
        body = json.dumps({"model": "gpt", "prompt": "stall", "max_tokens": 8}).encode()
        request = urllib.request.Request(job.url + "/v1/completions", body,
                                         {"Content-Type": "application/json"})
        answered = []

        def ask():                       # the connection closes with the job, unanswered
            try:
                answered.append(urllib.request.urlopen(request, timeout=60).status)
            except OSError as exc:
                answered.append(type(exc).__name__)
        client = threading.Thread(target=ask, daemon=True)
        client.start()
        t0 = time.monotonic()
        job.proc.wait(TIMEOUT + 60)
        elapsed = time.monotonic() - t0
    finally:
        try:
            os.kill(stopped, signal.SIGCONT)
        except ProcessLookupError:
            pass
        rc, out = job.stop(None)
    client.join(30)
    assert answered and answered[0] != 200, answered
    assert rc != 0, out[-3000:]
    assert elapsed < TIMEOUT + 30, (elapsed, out[-3000:])
    assert re.search(r"^mpishard: error: CollectiveTimeout: .* timed out after 3 s on rank 0"
                     r".*: late ranks: \[1\]", out, re.M), out[-3000:]

"""`serve --layout auto`: the layouts a server runs ranked by the generation rule (fits in
--max-memory, fewest bytes per decode step): on 2 ranks a tiny model fits everywhere and
two replicas send nothing, so dp=2 serves; a limit nothing fits refuses with one line naming
the smallest need, exit 2, before anything listens.

Serial: the tests start their own `mpiexec -n 2`.
"""
import json
import re
import urllib.request

import pytest

from serve_job import ServeJob, references, write_model
from conftest import run_mpi

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")


def test_auto_serves_replicas_when_the_model_fits_and_answers_exactly(tmp_path):
    directory = write_model(tmp_path / "llama", "llama")
    job = ServeJob(2, ["--hf", directory, "--tokenizer", "bytes", "--dtype", "float64",
                       "--layout", "auto", "--max-memory", "1G"])
    try:
        body = json.dumps({"model": "llama", "prompt": "auto", "max_tokens": 9,
                           "temperature": 0, "return_token_ids": True}).encode()
        req = urllib.request.Request(job.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            got = json.loads(r.read())["choices"][0]["token_ids"]
    finally:
        rc, out = job.stop()
    assert rc == 0, out[-3000:]
    assert re.search(r"^mpishard: layout auto: dp=2 \(KV cache, 0 B sent per decode step.*"
                     r"fit in 1\.0 GiB per rank \(--max-memory\)", out, re.M), out[-3000:]
    assert got == references(directory, [b"auto"], 9)[0]


def test_auto_refuses_a_limit_nothing_fits(tmp_path):
    directory = write_model(tmp_path / "gpt", "gpt")
    proc = run_mpi(2, "-m", "mpishard", "serve", "--hf", directory, "--tokenizer", "bytes",
                   "--layout", "auto", "--max-memory", "10K", "--port", "0", timeout=120)
    lines = [s for s in proc.stderr.splitlines() if s.startswith("mpishard")]
    assert proc.returncode == 2 and "listening" not in proc.stdout, proc.stderr[-2000:]
    assert len(lines) == 1 and re.match(
        r"mpishard: error: --layout auto: no layout serve runs on 2 rank\(s\) fits in "
        r"10\.0 KiB per rank \(--max-memory\): the smallest, \S+, needs .* with --max-batch 8 "
        r"--max-model-len 64$", lines[0]), lines

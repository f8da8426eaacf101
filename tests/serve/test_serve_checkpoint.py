"""`serve --checkpoint DIR`: a Mixtral checkpoint of ours, trained with an expert capacity,
carrying the bytes tokenizer. The server lifts the capacity (None, as Hugging Face serves
Mixtral: a capacity is counted per forward call, and the server's calls are decode steps and
prefill chunks, not whole prompts), says so in one line,
and answers greedy requests running together on pp=2 with engine.generate's ids of each
prompt alone under capacity_factor=None.

Serial: the test starts its own `mpiexec -n 2`.
"""
import json
import threading
import urllib.request

import numpy as np
import pytest

import mpishard as ms
from mpishard.train.tokenizer import ByteTokenizer
from serve_job import SIZES, ServeJob

pytest.importorskip("uvicorn")
pytest.importorskip("starlette")
PROMPTS = [b"experts", b"capacity matters", b"x", b"0123456789abcdef"]


def mixtral(capacity):
    return ms.Llama(**SIZES, n_kv_heads=2, d_ff=24, n_experts=4, top_k=2,
                    capacity_factor=capacity)


def test_a_capacity_checkpoint_is_served_without_capacity_exactly(tmp_path):
    params = mixtral(1.0).init(seed=4)
    engine = ms.make_engine(mixtral(1.0), "single", dtype=np.float64, report_errors=False)
    engine.load_checkpoint(params)
    ms.checkpoint.save(str(tmp_path / "ck"), engine,
                       extra={"tokenizer": ByteTokenizer().carried()[0]})
    free = ms.make_engine(mixtral(None), "single", dtype=np.float64, report_errors=False)
    free.load_checkpoint(params)
    want = [free.generate([list(p)], 12, temperature=0.0)[0] for p in PROMPTS]

    job = ServeJob(2, ["--checkpoint", tmp_path / "ck", "--layout", "pp=2", "--max-batch", "4"])
    got = [None] * len(PROMPTS)

    def ask(i):
        body = json.dumps({"model": "ck", "prompt": PROMPTS[i].decode(), "max_tokens": 12,
                           "temperature": 0, "return_token_ids": True}).encode()
        req = urllib.request.Request(job.url + "/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            got[i] = json.loads(r.read())["choices"][0]["token_ids"]
    try:
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(PROMPTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    finally:
        rc, out = job.stop()
    assert rc == 0, out[-3000:]
    assert "mpishard serve: the model's capacity_factor=1 is lifted (None" in out, out[-3000:]
    assert got == want

"""`mpishard serve` end to end: greedy answers under every layout equal engine.generate of each
prompt alone, whatever else is in the batch and whenever it arrived, id for id (the request's
`return_token_ids`; the bytes tokenizer's text hides which byte >= 128 was drawn); a seeded
sampled answer too; SIGTERM drains and every rank exits 0; the server listens on the loopback only.

Serial tests: each starts its own `mpiexec -n N ... mpishard serve` job (serve_job.py) on
tiny float64 GPT-2, Llama and Mixtral (capacity_factor=None) directories of vocabulary 256.
"""
import json
import signal
import threading
import time

import pytest

import mpishard as ms
from serve_job import ServeJob, references, text_of, write_model

httpx = pytest.importorskip("httpx")

# layout -> (ranks, extra serve arguments)
LAYOUTS = {
    "single": (1, []),
    "tp=2": (2, []),
    "pp=2": (2, ["--microbatches", "2"]),
    "tp=2,pp=2": (4, ["--microbatches", "2"]),
    "dp=2": (2, []),
}
# (prompt, max_tokens, delay before sending in s): different lengths and finishing times, more
# requests than --max-batch, so rows join a running batch and take the slots others free
REQUESTS = [(b"The capital of France is", 20, 0.0), (b"x", 6, 0.0), (b"Hello, world", 14, 0.05),
            (b"0123456789" * 4, 10, 0.05), (b"a b c", 24, 0.1), (b"MPI", 3, 0.15),
            (b"The quick brown fox jumps", 12, 0.2), (b"\xc3\xa9t\xc3\xa9", 16, 0.3),
            (b"zz", 30, 0.35)]
SEEDED = (b"sampled", 12, 0.8, 7)               # prompt, max_tokens, temperature, seed


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-models")
    return {kind: write_model(root / kind, kind) for kind in ("gpt", "llama", "mixtral")}


def complete(base, model_name, prompt: bytes, max_tokens: int, **params) -> dict:
    body = {"model": model_name, "prompt": prompt.decode(), "max_tokens": max_tokens,
            "temperature": 0.0, "return_token_ids": True, **params}
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def send_all(base, model_name) -> list:
    """Every REQUESTS entry and the seeded one, each from its own thread after its delay."""
    jobs = [(p, n, {}, d) for p, n, d in REQUESTS]
    prompt, n, temperature, seed = SEEDED
    jobs.append((prompt, n, {"temperature": temperature, "seed": seed}, 0.1))
    out = [None] * len(jobs)

    def one(i, prompt, n, params, delay):
        time.sleep(delay)
        out[i] = complete(base, model_name, prompt, n, **params)

    threads = [threading.Thread(target=one, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["gpt", "llama", "mixtral"])
def test_greedy_answers_equal_generate_alone(models, kind, layout):
    ranks, extra = LAYOUTS[layout]
    directory = models[kind]
    job = ServeJob(ranks, ["--hf", directory, "--layout", layout, "--max-batch", "4",
                           "--dtype", "float64", "--tokenizer", "bytes", *extra])
    try:
        answers = send_all(job.url, kind)
    finally:
        rc, out = job.stop()
    print(out[-3000:])
    assert rc == 0 and not job.left, (rc, job.left)
    want = references(directory, [p for p, _, _ in REQUESTS], max(n for _, n, _ in REQUESTS))
    for (prompt, n, _), ids, got in zip(REQUESTS, want, answers):
        choice = got["choices"][0]
        print(prompt, n, repr(choice["text"]), got["usage"])
        assert choice["token_ids"] == ids[:n], (prompt, choice["token_ids"], ids[:n])
        assert choice["prompt_token_ids"] == list(prompt)
        assert choice["text"] == text_of(ids[:n]), (prompt, choice["text"], ids[:n])
        assert got["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": n,
                                "total_tokens": len(prompt) + n}, got["usage"]
        assert choice["finish_reason"] == "length"
    prompt, n, temperature, seed = SEEDED
    [engine_ids] = references(directory, [prompt], n, temperature=temperature, seed=seed)
    assert answers[-1]["choices"][0]["token_ids"] == engine_ids
    assert answers[-1]["choices"][0]["text"] == text_of(engine_ids)


def _listening_addresses(port: int) -> set:
    """(address, family) of every listening TCP socket on `port` (/proc/net/tcp, tcp6)."""
    found = set()
    for family in ("tcp", "tcp6"):
        with open(f"/proc/net/{family}") as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                address, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:
                    found.add((address, family))
    return found


@pytest.fixture(scope="module")
def long_model(tmp_path_factory):
    """A GPT of 4096 positions: a row of thousands of tokens lasts seconds."""
    model = ms.GPT(vocab_size=256, seq_len=4096, d_model=16, n_heads=4, n_layers=2)
    return ms.hf.save(tmp_path_factory.mktemp("long") / "long", model, model.init(seed=2),
                      dtype="float64")


def test_sigterm_drains_finishes_in_flight_rows_and_exits_0(long_model):
    """The loopback default too: the one listening socket is 127.0.0.1's."""
    job = ServeJob(2, ["--hf", long_model, "--tokenizer", "bytes", "--drain-timeout", "3"])
    events, lines = [], []
    signalled = False
    try:
        assert job.host == "127.0.0.1"
        assert _listening_addresses(int(job.port)) == {("0100007F", "tcp")}
        body = {"model": "long", "prompt": "drain me", "max_tokens": 4000, "temperature": 0,
                "stream": True}

        def stream():
            with httpx.stream("POST", f"{job.url}/v1/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    lines.append(line)
                    if line.startswith("data: {") and not events:
                        events.append(time.monotonic())

        reader = threading.Thread(target=stream)
        reader.start()
        while not events and reader.is_alive():
            time.sleep(0.01)
        assert events, lines
        job.proc.send_signal(signal.SIGTERM)
        signalled = True
        deadline = time.monotonic() + 30        # until rank 0's loop has begun the drain
        while _healthy(job.url):
            assert time.monotonic() < deadline, "no drain 30 s after SIGTERM"
            time.sleep(0.02)
        try:
            refused = httpx.post(f"{job.url}/v1/completions", timeout=10,
                                 json={"model": "long", "prompt": "late", "max_tokens": 2})
            assert refused.status_code == 503 and "retry-after" in refused.headers, refused
            assert set(refused.json()["error"]) >= {"message", "type", "param", "code"}
        except httpx.ConnectError:
            pass                        # already closed: refused all the same
        reader.join(60)
        t_end = time.monotonic()
    finally:
        rc, out = job.stop(None if signalled else signal.SIGTERM, timeout=60)
    print(out[-3000:])
    chunks = [json.loads(s[6:]) for s in lines if s.startswith("data: {")]
    assert lines[-1] == "data: [DONE]" or lines[-2:] == ["data: [DONE]", ""], lines[-3:]
    print(f"{len(chunks)} chunks, the last: {chunks[-1]}")
    assert chunks[-1]["choices"][0]["finish_reason"] in ("length", "abort"), chunks[-1]
    assert t_end - events[0] < 30
    assert rc == 0 and not job.left, (rc, job.left)


def _healthy(url) -> bool:
    """GET /health answers 200 (not 503 draining, nor a closed socket)."""
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.TransportError:        # refused, or cut while the server shuts down
        return False


def test_a_layout_serve_cannot_run_is_refused_before_listening(models):
    """fsdp shards the weights a decode step needs whole: the job ends with one error."""
    with pytest.raises(AssertionError, match="before listening") as err:
        ServeJob(2, ["--hf", models["gpt"], "--layout", "fsdp=2", "--tokenizer", "bytes"])
    assert "fsdp" in str(err.value)

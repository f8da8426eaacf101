"""`mpishard serve` and real clients: the official openai package (completions and chat,
streamed and not: the streamed text is the whole text), curl, OpenAI-style errors after which
the server keeps serving, --api-key, a disconnecting streaming client, a full queue.

Serial tests: two servers, each shared by the tests of a module-scoped fixture (serve_job.py):
a tiny float64 Llama on tp=2 behind an API key, and a GPT of 4096 positions on one rank
with --max-batch 1 --max-queue 1, whose long rows keep the one slot busy for seconds.
"""
import json
import subprocess
import threading
import time

import pytest

import mpishard as ms
from serve_job import ServeJob, chat_prompt, references, text_of, write_model

httpx = pytest.importorskip("httpx")
openai = pytest.importorskip("openai")

KEY = "sk-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """(job, directory): the Llama on tp=2, served until the module's tests are done."""
    directory = write_model(tmp_path_factory.mktemp("clients") / "llama", "llama")
    job = ServeJob(2, ["--hf", directory, "--layout", "tp=2", "--tokenizer", "bytes",
                       "--dtype", "float64", "--api-key", KEY, "--max-batch", "4"])
    yield job, directory
    rc, out = job.stop()
    print(out[-3000:])
    assert rc == 0 and not job.left, (rc, job.left)


@pytest.fixture
def client(llama):
    return openai.OpenAI(base_url=f"{llama[0].url}/v1", api_key=KEY, max_retries=0, timeout=60)


def test_models_lists_the_directory_name(client):
    assert [m.id for m in client.models.list().data] == ["llama"]


@pytest.mark.parametrize("prompt,n", [("Once upon a time", 16), ("x", 1), ("\u00e9\u00e8", 30)])
def test_openai_completions_streamed_equal_whole_and_generate(llama, client, prompt, n):
    [ids] = references(llama[1], [prompt.encode()], n)
    whole = client.completions.create(model="llama", prompt=prompt, max_tokens=n, temperature=0)
    chunks = list(client.completions.create(model="llama", prompt=prompt, max_tokens=n,
                                            temperature=0, stream=True))
    streamed = "".join(c.choices[0].text for c in chunks)
    print(repr(whole.choices[0].text), whole.usage)
    assert whole.choices[0].text == streamed == text_of(ids)
    assert whole.usage.completion_tokens == n and whole.usage.prompt_tokens == len(prompt.encode())
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "length"


def test_openai_chat_renders_the_template_streamed_and_not(llama, client):
    messages = [{"role": "user", "content": "Hi"}]        # 52 bytes rendered, of 64
    [ids] = references(llama[1], [chat_prompt(messages)], 10)
    whole = client.chat.completions.create(model="llama", messages=messages, max_tokens=10,
                                           temperature=0)
    chunks = list(client.chat.completions.create(model="llama", messages=messages,
                                                 max_completion_tokens=10, temperature=0,
                                                 stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == streamed == text_of(ids)
    assert whole.usage.prompt_tokens == len(chat_prompt(messages))


def test_curl_completion_and_stream(llama):
    job, directory = llama
    [ids] = references(directory, [b"curl me"], 10)
    body = json.dumps({"model": "llama", "prompt": "curl me", "max_tokens": 10,
                       "temperature": 0})
    curl = ["curl", "-sS", "--max-time", "60", "-H", "Content-Type: application/json",
            "-H", f"Authorization: Bearer {KEY}", f"{job.url}/v1/completions", "-d"]
    out = subprocess.run([*curl, body], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["choices"][0]["text"] == text_of(ids)
    stream = json.dumps({**json.loads(body), "stream": True})
    out = subprocess.run([*curl[:1], "-N", *curl[1:], stream], capture_output=True, text=True,
                         timeout=90)
    events = [s[6:] for s in out.stdout.splitlines() if s.startswith("data: ")]
    assert events[-1] == "[DONE]", out.stdout[-500:]
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == text_of(ids)


BAD = {
    "malformed JSON": b'{"model": "llama", "prompt": ',
    "unknown model": {"model": "gpt-17", "prompt": "hi", "max_tokens": 2},
    "prompt too long": {"model": "llama", "prompt": "p" * 100, "max_tokens": 2},
    "max_tokens past the limit": {"model": "llama", "prompt": "hi", "max_tokens": 1000},
    "bad type": {"model": "llama", "prompt": "hi", "max_tokens": "ten"},
    "bad temperature": {"model": "llama", "prompt": "hi", "temperature": "hot"},
    "n=2": {"model": "llama", "prompt": "hi", "max_tokens": 2, "n": 2},
    "non-neutral penalty": {"model": "llama", "prompt": "hi", "presence_penalty": 1.0},
}


@pytest.mark.parametrize("case", BAD)
def test_bad_requests_get_an_openai_error_and_the_server_keeps_serving(llama, case):
    job, directory = llama
    bad = BAD[case]
    kw = {"content": bad} if isinstance(bad, bytes) else {"json": bad}
    r = httpx.post(f"{job.url}/v1/completions", headers={**AUTH, "Content-Type":
                                                         "application/json"}, timeout=30, **kw)
    print(case, r.status_code, r.text)
    assert r.status_code == (404 if case == "unknown model" else 400), r.text
    assert set(r.json()["error"]) == ERROR_KEYS and r.json()["error"]["message"]
    ok = httpx.post(f"{job.url}/v1/completions", headers=AUTH, timeout=30,
                    json={"model": "llama", "prompt": "still here", "max_tokens": 3,
                          "temperature": 0, "presence_penalty": 0, "logprobs": None,
                          "user": "u"})
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["text"] == text_of(references(directory, [b"still here"],
                                                                 3)[0])


def test_api_key_is_required(llama):
    job = llama[0]
    body = {"model": "llama", "prompt": "hi", "max_tokens": 2}
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        r = httpx.post(f"{job.url}/v1/completions", json=body, headers=headers, timeout=30)
        assert r.status_code == 401 and set(r.json()["error"]) == ERROR_KEYS, r.text
    bad = openai.OpenAI(base_url=f"{job.url}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    assert httpx.get(f"{job.url}/health", timeout=30).status_code == 200


def test_metrics_count_requests_and_tokens(llama, client):
    client.completions.create(model="llama", prompt="count", max_tokens=4, temperature=0)
    text = httpx.get(f"{llama[0].url}/metrics", headers=AUTH, timeout=30).text
    names = {line.split("{")[0].split(" ")[0] for line in text.splitlines()
             if line and not line.startswith("#")}
    print(sorted(names))
    for word in ("request", "prompt", "generation", "queue", "batch", "first_token",
                 "inter_token"):
        assert any(word in n for n in names), word


@pytest.fixture(scope="module")
def one_slot(tmp_path_factory):
    """A GPT of 4096 positions on one rank, --max-batch 1 --max-queue 1."""
    model = ms.GPT(vocab_size=256, seq_len=4096, d_model=16, n_heads=4, n_layers=2)
    directory = ms.hf.save(tmp_path_factory.mktemp("one-slot") / "long", model,
                           model.init(seed=2), dtype="float64")
    job = ServeJob(1, ["--hf", directory, "--tokenizer", "bytes", "--max-batch", "1",
                       "--max-queue", "1"])
    yield job
    rc, out = job.stop()
    print(out[-3000:])
    assert rc == 0 and not job.left, (rc, job.left)


class LongStream:
    """A streamed request of 4000 tokens read in a thread until `close()` (a disconnect)."""

    def __init__(self, url):
        self.started, self.closed, self.events = threading.Event(), threading.Event(), 0
        self.ended = threading.Event()          # the row ran to its end: the slot is free
        body = {"model": "long", "prompt": "go", "max_tokens": 4000, "stream": True}
        self.thread = threading.Thread(target=self._run, args=(url, body), daemon=True)
        self.thread.start()
        assert self.started.wait(60), "no first chunk"

    def _run(self, url, body):
        with httpx.Client(timeout=60) as c, c.stream("POST", f"{url}/v1/completions",
                                                     json=body) as r:
            for line in r.iter_lines():
                self.events += line.startswith("data: {")
                self.started.set()
                if self.closed.is_set():
                    return              # leaving the block closes the connection
        self.ended.set()

    def close(self):
        self.closed.set()
        self.thread.join(30)


def test_a_disconnected_stream_frees_its_slot(one_slot):
    stream = LongStream(one_slot.url)
    stream.close()
    t0 = time.monotonic()
    r = httpx.post(f"{one_slot.url}/v1/completions", timeout=60,
                   json={"model": "long", "prompt": "next", "max_tokens": 4, "temperature": 0})
    waited = time.monotonic() - t0
    print(f"{stream.events} events before the disconnect; the next request took {waited:.2f} s")
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
    assert waited < 5, waited          # the slot's row would have run for 4000 tokens


def test_a_full_queue_answers_429_with_retry_after(one_slot):
    for _ in range(3):      # a long row that ended before "full" was answered freed the slot
        r, queued, slot_freed = _one_too_many(one_slot.url)
        if r is not None and (r.status_code != 200 or not slot_freed):
            break
    assert r is not None, "the second request never queued (its long row ended first, 3 times)"
    print(r.status_code, r.headers, r.text)
    assert r.status_code in (429, 503) and float(r.headers["retry-after"]) > 0, r.text
    assert set(r.json()["error"]) == ERROR_KEYS
    assert queued["r"].status_code == 200, queued["r"].text


def _one_too_many(url):
    """A long row holds the one slot, a second request waits in the queue of one, and a third
    is sent: (its response, the second's, whether the long row had ended by then); (None, ..,
    True) when the long row ended before the second was seen waiting."""
    stream = LongStream(url)
    queued = {}
    waiting = threading.Thread(target=lambda: queued.update(r=httpx.post(
        f"{url}/v1/completions", timeout=60,
        json={"model": "long", "prompt": "queued", "max_tokens": 2})))
    waiting.start()
    deadline = time.monotonic() + 30    # until it waits in the queue of one
    while "mpishard_serve_queue_depth 1.0" not in httpx.get(f"{url}/metrics").text:
        if stream.ended.is_set():       # the slot came free first: no round
            stream.close()
            waiting.join(60)
            return None, queued, True
        assert time.monotonic() < deadline, "the second request never queued"
        time.sleep(0.05)
    try:
        r = httpx.post(f"{url}/v1/completions", timeout=30,
                       json={"model": "long", "prompt": "full", "max_tokens": 2})
        # accepted: the long row's end, if it came first, reaches its reader within seconds
        slot_freed = stream.ended.wait(5) if r.status_code == 200 else False
    finally:
        stream.close()
    waiting.join(60)
    return r, queued, slot_freed


def test_a_stop_string_cuts_the_text_streamed_and_not(llama, client):
    """The first printable ASCII character of the answer after its second, as a stop string:
    the text ends before it and finish_reason is "stop", streamed or not."""
    [ids] = references(llama[1], [b"stop here"], 20)
    full = text_of(ids)
    stop = next(c for c in full[2:] if c.isascii() and c.isprintable())
    want = full[:full.index(stop)]
    whole = client.completions.create(model="llama", prompt="stop here", max_tokens=20,
                                      temperature=0, stop=[stop])
    chunks = list(client.completions.create(model="llama", prompt="stop here", max_tokens=20,
                                            temperature=0, stop=stop, stream=True))
    print(repr(full), repr(stop), repr(whole.choices[0].text))
    assert whole.choices[0].text == "".join(c.choices[0].text for c in chunks) == want
    assert whole.choices[0].finish_reason == chunks[-1].choices[0].finish_reason == "stop"


def test_chat_without_a_template_is_a_400_that_says_so(one_slot):
    r = httpx.post(f"{one_slot.url}/v1/chat/completions", timeout=30, json={
        "model": "long", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 400 and "template" in r.json()["error"]["message"], r.text

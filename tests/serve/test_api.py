"""serve.api: the OpenAI-compatible front against a fake decode loop that serves the real
Intake (take/deliver) with deterministic tokens: the bytes of ANSWER then an eos, or for a
prompt starting "slow" an endless run of "a" until max_tokens. In-process through
starlette's TestClient, and over loopback through uvicorn for the official openai client and
for clients that go away (test_api_uvicorn.py)."""
from __future__ import annotations

import pytest

starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

from fake_app import ANSWER, EOS, ERROR_KEYS, MAX_LEN, MODEL, Served, post  # noqa: E402
from mpishard.serve.protocol import ApiError, Limits, parse_completion  # noqa: E402

@pytest.fixture
def served():
    with Served() as s:
        yield s


def test_completion_plain_and_streamed(served):
    body = {"model": MODEL, "prompt": "Hi there", "max_tokens": 200, "temperature": 0,
            "seed": 7, "top_k": 3}
    r = post(served.client, "/v1/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "text_completion" and out["model"] == MODEL
    assert out["choices"] == [{"index": 0, "text": ANSWER, "logprobs": None,
                               "finish_reason": "stop"}]
    n = len(ANSWER.encode()) + 1                           # the answer's bytes and the eos
    assert out["usage"] == {"prompt_tokens": 8, "completion_tokens": n, "total_tokens": 8 + n}
    assert served.loop.joined[0].ids == list(b"Hi there")
    assert served.loop.joined[0].params == {"max_tokens": 200, "temperature": 0.0,
                                            "top_p": 1.0, "top_k": 3, "seed": 7}
    chunks = post(served.client, "/v1/completions", dict(body, stream=True))
    assert {c["object"] for c in chunks} == {"text_completion"}
    assert len({c["id"] for c in chunks}) == 1 and "usage" not in chunks[0]
    assert "".join(c["choices"][0]["text"] for c in chunks).encode() == ANSWER.encode()
    assert [c["choices"][0]["finish_reason"] for c in chunks][-2:] == [None, "stop"]
    assert len(chunks) > 10                                # streamed, not sent at once


def test_prompt_ids_outside_the_vocabulary_and_top_k_off():
    """A text whose ids the model does not have (a tokenizer larger than the model) is a 400,
    not a request that fails every rank; top_k -1 is off, as vLLM's."""
    limits = Limits(MODEL, MAX_LEN, 100)                     # bytes above 99: no such id
    with pytest.raises(ApiError, match="outside the model's vocabulary") as err:
        parse_completion({"model": MODEL, "prompt": "zzz"}, limits, None)
    assert err.value.status == 400 and err.value.param == "prompt"
    req = parse_completion({"model": MODEL, "prompt": "a", "top_k": -1}, limits, None)
    assert req.params["top_k"] == 0


def test_return_token_ids_whole_and_streamed(served):
    """vLLM's return_token_ids: a whole answer's ids, and a stream's split over its chunks
    (the prompt's on the first chunk only), the eos included as it is counted."""
    want = list(ANSWER.encode()) + [EOS]
    for path, body in (("/v1/completions", {"prompt": "Hi"}),
                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]})):
        body = dict(body, model=MODEL, max_tokens=200, return_token_ids=True)
        choice = post(served.client, path, body).json()["choices"][0]
        assert choice["token_ids"] == want
        prompt = served.loop.joined[-1].ids
        assert choice["prompt_token_ids"] == prompt
        chunks = post(served.client, path, dict(body, stream=True))
        assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == want
        assert chunks[0]["choices"][0]["prompt_token_ids"] == prompt
        assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    plain = post(served.client, "/v1/completions", {"model": MODEL, "prompt": "Hi"}).json()
    assert "token_ids" not in plain["choices"][0]


def test_length_and_usage_chunk(served):
    cut = len("Bonjour, ç".encode()) - 1                   # the ç's first byte only
    body = {"model": MODEL, "prompt": [72, 105], "max_tokens": cut, "stream": True,
            "stream_options": {"include_usage": True}}
    chunks = post(served.client, "/v1/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == {
        "prompt_tokens": 2, "completion_tokens": cut, "total_tokens": cut + 2}
    assert all(c["usage"] is None for c in chunks[:-1])
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    plain = post(served.client, "/v1/completions", dict(body, stream=False)).json()
    assert text == plain["choices"][0]["text"] == "Bonjour, \ufffd"


@pytest.mark.parametrize("stop,want", [("va?", "Bonjour, ça "), (["x", "日本"], "Bonjour, ça va? "),
                                       ("ça", "Bonjour, "), ("END.", "Bonjour, ça va? 日本 ✓ ")])
def test_stop_strings_cut_and_cancel(served, stop, want):
    body = {"model": MODEL, "prompt": "Hi", "stop": stop}
    r = post(served.client, "/v1/completions", dict(body, max_tokens=100)).json()
    assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop"
    assert served.loop.wait_cancelled(served.loop.joined[-1].rid)
    stops = [stop] if isinstance(stop, str) else stop
    hit = next(s for s in stops if ANSWER[len(want):].startswith(s))
    assert r["usage"]["completion_tokens"] == len((want + hit).encode())
    chunks = post(served.client, "/v1/completions", dict(body, max_tokens=100, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == want


def test_chat_plain_and_streamed(served):
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "Ça va?"}]}]
    body = {"model": MODEL, "messages": messages, "max_completion_tokens": 100,
            "presence_penalty": 0, "frequency_penalty": 0.0, "logprobs": False, "user": "u1"}
    r = post(served.client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": ANSWER}
    want = "<|system|>Be brief.\n<|user|>Ça va?\n<|assistant|>".encode()
    assert served.loop.joined[0].ids == list(want)
    assert out["usage"]["prompt_tokens"] == len(want)
    chunks = post(served.client, "/v1/chat/completions", dict(body, stream=True))
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None,
                                        "finish_reason": "stop"}
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == ANSWER


def error(r, status, param=None):
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == ERROR_KEYS and err["message"], err
    if param is not None:
        assert err["param"] == param, err
    return err


@pytest.mark.parametrize("body,status,param", [
    ({"model": "gpt-4", "prompt": "x"}, 404, "model"),
    ({"prompt": "x"}, 400, "model"),
    ({"model": MODEL, "prompt": "x" * MAX_LEN}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "max_tokens": MAX_LEN + 1}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x" * 200, "max_tokens": 100}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": "10"}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": True}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
    ({"model": MODEL, "prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ({"model": MODEL, "prompt": "x", "temperature": 3}, 400, "temperature"),
    ({"model": MODEL, "prompt": 5}, 400, "prompt"),
    ({"model": MODEL, "prompt": ["a", "b"]}, 400, "prompt"),
    ({"model": MODEL, "prompt": [1, 999]}, 400, "prompt"),
    ({"model": MODEL, "prompt": ""}, 400, "prompt"),
    ({"model": MODEL, "prompt": "x", "n": 2}, 400, "n"),
    ({"model": MODEL, "prompt": "x", "presence_penalty": 0.5}, 400, "presence_penalty"),
    ({"model": MODEL, "prompt": "x", "logprobs": 2}, 400, "logprobs"),
    ({"model": MODEL, "prompt": "x", "echo": True}, 400, "echo"),
    ({"model": MODEL, "prompt": "x", "frobnicate": 1}, 400, "frobnicate"),
    ({"model": MODEL, "prompt": "x", "stop": [""]}, 400, "stop"),
    ({"model": MODEL, "prompt": "x", "stream": "yes"}, 400, "stream"),
    ({"model": MODEL, "prompt": "x", "seed": 1.5}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "seed": -1}, 400, "seed"),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, "top_p"),
    ({"model": MODEL, "prompt": "x", "top_k": -2}, 400, "top_k"),
    ({"model": MODEL, "prompt": "x", "stream_options": 1}, 400, "stream_options"),
    ({"model": MODEL, "prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ([1, 2], 400, None),
])
def test_bad_requests_answer_openai_errors_and_the_server_keeps_serving(served, body, status,
                                                                        param):
    error(served.client.post("/v1/completions", json=body), status, param)
    assert served.loop.joined == []                        # nothing was queued
    ok = post(served.client, "/v1/completions", {"model": MODEL, "prompt": "x",
                                                 "max_tokens": 3, "logprobs": None,
                                                 "presence_penalty": 0, "best_of": 1})
    assert ok.json()["choices"][0]["text"] == "Bon"


def test_malformed_json_bad_chat_and_routes(served):
    r = served.client.post("/v1/completions", content=b"{not json",
                           headers={"Content-Type": "application/json"})
    error(r, 400)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    error(served.client.post("/v1/chat/completions", json=dict(chat, messages=[])), 400,
          "messages")
    error(served.client.post("/v1/chat/completions", json=dict(chat, tools=[{"x": 1}])), 400,
          "tools")
    error(served.client.post("/v1/chat/completions", json=dict(chat, max_tokens=MAX_LEN)), 400,
          "max_tokens")
    error(served.client.get("/v1/nothing"), 404)
    error(served.client.get("/v1/completions"), 405)
    models = served.client.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == [MODEL]
    assert served.client.get("/health").json() == {"status": "ok"}


def test_chat_without_template():
    with Served(template=None) as s:
        client = s.client
        err = error(client.post("/v1/chat/completions", json={
            "model": MODEL, "messages": [{"role": "user", "content": "hi"}]}), 400, "messages")
        assert "no chat template" in err["message"]


def test_api_key():
    with Served(api_key="sk-1") as s:
        client = s.client
        body = {"model": MODEL, "prompt": "x", "max_tokens": 2}
        for headers in ({}, {"Authorization": "Bearer sk-2"}, {"Authorization": "sk-1"}):
            assert error(client.post("/v1/completions", json=body, headers=headers),
                         401)["code"] == "invalid_api_key"
        error(client.get("/v1/models"), 401)
        ok = client.post("/v1/completions", json=body, headers={"Authorization": "Bearer sk-1"})
        assert ok.status_code == 200 and ok.json()["choices"][0]["text"] == "Bo"
        assert client.get("/health").status_code == 200


def test_full_queue_and_draining():
    body = {"model": MODEL, "prompt": "x"}
    with Served(max_queue=0) as s:
        client = s.client
        r = client.post("/v1/completions", json=body)
        error(r, 429)
        assert int(r.headers["Retry-After"]) >= 1
    with Served() as s:
        client = s.client
        s.intake.drain()
        r = client.post("/v1/chat/completions",
                        json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]})
        error(r, 503)
        assert int(r.headers["Retry-After"]) >= 1
        assert client.get("/health").status_code == 503


def test_metrics(served):
    post(served.client, "/v1/completions", {"model": MODEL, "prompt": "abc", "max_tokens": 4})
    served.client.post("/v1/completions", json={"model": "nope", "prompt": "x"})
    served.metrics.set_queue(3)
    served.metrics.set_batch(2, 8)
    r = served.client.get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    text = r.text
    for line in ('mpishard_serve_requests_total{endpoint="/v1/completions",status="200"} 1.0',
                 'mpishard_serve_requests_total{endpoint="/v1/completions",status="404"} 1.0',
                 "mpishard_serve_prompt_tokens_total 3.0",
                 "mpishard_serve_generation_tokens_total 4.0",
                 "mpishard_serve_queue_depth 3.0", "mpishard_serve_batch_occupancy 0.25",
                 "mpishard_serve_time_to_first_token_seconds_count 1.0",
                 "mpishard_serve_inter_token_latency_seconds_count 3.0"):
        assert line in text.splitlines(), line

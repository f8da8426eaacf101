"""serve.api over loopback: the app under uvicorn on 127.0.0.1 (fake_app.py's fake loop), the
official openai client, a client that goes away, and real tokenizers streamed."""
from __future__ import annotations

import pytest

starlette = pytest.importorskip("starlette")
uvicorn = pytest.importorskip("uvicorn")
openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
pytest.importorskip("prometheus_client")
pytest.importorskip("jinja2")
pytest.importorskip("tokenizers")

from fake_app import ANSWER, MAX_LEN, MODEL, Served, Uvicorn, post  # noqa: E402
from test_detok import byte_level, metaspace  # noqa: E402


def test_openai_client_over_uvicorn():
    with Served() as s, Uvicorn(s) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        done = client.completions.create(model=MODEL, prompt="Hello", max_tokens=100, seed=1)
        assert done.choices[0].text == ANSWER and done.choices[0].finish_reason == "stop"
        assert done.usage.completion_tokens == len(ANSWER.encode()) + 1
        pieces = [c.choices[0].text for c in client.completions.create(
            model=MODEL, prompt="Hello", max_tokens=100, stream=True)]
        assert "".join(pieces) == ANSWER and len(pieces) > 10
        messages = [{"role": "user", "content": "Hi"}]
        chat = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                              stop=["✓"])
        assert chat.choices[0].message.content == "Bonjour, ça va? 日本 "
        stream = client.chat.completions.create(model=MODEL, messages=messages, stream=True,
                                                stream_options={"include_usage": True})
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ANSWER
        assert chunks[-1].usage.completion_tokens == len(ANSWER.encode()) + 1
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="x")
        with pytest.raises(openai.BadRequestError, match="max_tokens"):
            client.completions.create(model=MODEL, prompt="x", max_tokens=10 ** 6)
        models = client.models.list()
        assert [m.id for m in models.data] == [MODEL]


def test_a_client_that_goes_away_cancels_its_row():
    """The slow rows are held (FakeLoop.hold_slow): none can end by itself, however late the
    server notices that its client went away, so only a cancel ends it."""
    with Served() as s, Uvicorn(s) as server:
        s.loop.hold_slow.set()
        body = {"model": MODEL, "prompt": "slow", "max_tokens": MAX_LEN - 4, "stream": True}
        with httpx.Client(base_url=server.url) as client:
            with client.stream("POST", "/v1/completions", json=body) as r:
                next(r.iter_lines())
            rid = s.loop.wait_joined(0).rid
            assert s.loop.wait_cancelled(rid), "the closed stream did not cancel its row"
            with pytest.raises(httpx.ReadTimeout):
                client.post("/v1/completions", json=dict(body, stream=False), timeout=0.3)
            rid = s.loop.wait_joined(1).rid                 # this request's row, once joined
            assert s.loop.wait_cancelled(rid), "the abandoned request did not cancel its row"
            assert len(s.loop.joined) == 2
            ok = client.post("/v1/completions", json={"model": MODEL, "prompt": "x"})
            assert ok.json()["choices"][0]["text"] == ANSWER.encode()[:16].decode()


@pytest.mark.parametrize("make", [byte_level, metaspace], ids=["byte_level", "metaspace"])
def test_a_real_tokenizer_streams_the_text_it_answers_whole(make):
    """The loop's ids are the tokenizer's own for prompt + answer: the completion's text is the
    tokenizer's text of the answer as it continues the prompt (its leading space kept),
    streamed or not."""
    tok = make()
    eos = tok.get_vocab_size()
    prompt, answer = "Paris is the capital of", " France. 日本語 🐙 straße 😀!"
    whole = tok.encode(prompt + answer).ids
    answer = tok.decode(whole)[len(tok.decode(tok.encode(prompt).ids)):]   # unknown chars gone
    assert answer.startswith(" France. 日本語 ")

    def answers(ids):
        assert ids == whole[:len(ids)]
        return whole[len(ids):] + [eos]

    with Served(tok=tok, answers=answers, eos=eos) as s:
        client = s.client
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 100}
        plain = post(client, "/v1/completions", body).json()
        assert plain["choices"][0]["text"] == answer
        assert plain["usage"]["completion_tokens"] == len(whole) - len(tok.encode(prompt).ids) + 1
        chunks = post(client, "/v1/completions", dict(body, stream=True))
        pieces = [c["choices"][0]["text"] for c in chunks]
        assert "".join(pieces) == answer and not any("\ufffd" in p for p in pieces)
        cut = post(client, "/v1/completions", dict(body, stop=[answer[10:15]])).json()
        assert cut["choices"][0]["text"] == " France. 日"

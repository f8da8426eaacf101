"""The fake decode loop and app the serve.api tests share (tests/serve/test_api*.py): the real
Intake served with deterministic tokens, the bytes of ANSWER then an eos, or for a prompt
starting "slow" an endless run of "a" until max_tokens (while FakeLoop.hold_slow is set a slow
row holds its last token back: it ends only when cancelled, or once the test clears the event);
the app in-process (Served) or over loopback through uvicorn (Uvicorn)."""
from __future__ import annotations

import json
import threading
import time

import uvicorn
from starlette.testclient import TestClient

from mpishard.serve.api import build_app
from mpishard.serve.intake import Intake
from mpishard.serve.metrics import make_metrics

ANSWER = "Bonjour, ça va? 日本 ✓ END."
EOS, MAX_LEN, MODEL = 256, 256, "tiny"
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")
ERROR_KEYS = {"message", "type", "param", "code"}


class FakeLoop(threading.Thread):
    """The decode loop's side of the Intake: one token per row per step, `max_batch` rows."""

    def __init__(self, intake: Intake, max_batch: int = 4, answers=None, eos=EOS):
        super().__init__(daemon=True)
        self.intake, self.max_batch, self.answers, self.eos = intake, max_batch, answers, eos
        self.rows, self.joined, self.cancelled = {}, [], []
        self.halt, self.hold_slow = threading.Event(), threading.Event()

    @staticmethod
    def slow(ticket) -> bool:
        return bytes(ticket.ids).startswith(b"slow")

    def script(self, ticket) -> list:
        if self.answers is not None:
            return self.answers(ticket.ids)
        if self.slow(ticket):
            return [ord("a")] * MAX_LEN
        return list(ANSWER.encode()) + [EOS]

    def run(self) -> None:
        """Steps until halted; an error ends every row with "abort" (the test then fails on
        the error, raised again by Served, rather than hanging)."""
        self.error = None
        try:
            self.steps()
        except BaseException as e:
            self.error = e
            for rid in self.rows:
                self.intake.deliver(rid, None, "abort")
            self.intake.abort_waiting()

    def steps(self) -> None:
        while not self.halt.is_set():
            self.intake.wait(0.01)
            joins, cancels = self.intake.take(self.max_batch - len(self.rows))
            for t in joins:
                self.rows[t.rid] = [t, 0]
                self.joined.append(t)
            for rid in cancels:
                self.cancelled.append(rid)
                if self.rows.pop(rid, None) is not None:
                    self.intake.deliver(rid, None, "abort")
            for rid, row in list(self.rows.items()):
                ticket, step = row
                if step + 1 >= ticket.params["max_tokens"] and self.hold_slow.is_set() \
                        and self.answers is None and self.slow(ticket):
                    continue                        # held: its last token waits
                token = self.script(ticket)[step]
                row[1] = step + 1
                finish = ("stop" if token == self.eos else
                          "length" if row[1] >= ticket.params["max_tokens"] else None)
                self.intake.deliver(rid, token, finish)
                if finish:
                    del self.rows[rid]
            time.sleep(0.005)

    def wait_joined(self, n, timeout=10.0):
        """The ticket of the row that joined `n`-th (from 0), once it has."""
        end = time.time() + timeout
        while time.time() < end and len(self.joined) <= n:
            time.sleep(0.01)
        assert len(self.joined) > n, f"no row {n} joined in {timeout} s: {len(self.joined)}"
        return self.joined[n]

    def wait_cancelled(self, rid, timeout=10.0) -> bool:
        end = time.time() + timeout
        while time.time() < end and rid not in self.cancelled:
            time.sleep(0.01)
        return rid in self.cancelled


class Served:
    """An app on a fresh Intake served by a FakeLoop, and a TestClient of it (a context
    manager). The loop halts before the client's event loop closes: a loop delivering to a
    ticket whose event loop is closed fails."""

    def __init__(self, max_queue=8, api_key=None, template=TEMPLATE, tok=None, answers=None,
                 eos=EOS):
        self.intake, self.metrics = Intake(max_queue), make_metrics()
        self.loop = FakeLoop(self.intake, answers=answers, eos=eos)
        self.app = build_app(self.intake, tok, model_name=MODEL, max_model_len=MAX_LEN,
                             vocab_size=eos + 1, chat_template=template, special_tokens={},
                             eos=[eos], api_key=api_key, metrics=self.metrics)

    def __enter__(self):
        self.loop.start()
        self.client = TestClient(self.app).__enter__()
        return self

    def halt(self) -> None:
        self.loop.halt.set()
        self.loop.join(5)
        if self.loop.error is not None:
            raise self.loop.error

    def __exit__(self, *exc):
        try:
            self.halt()
        finally:
            self.client.__exit__(*exc)


class Uvicorn:
    """The app on 127.0.0.1 with a port the system picks, in a thread."""

    def __init__(self, served: Served):
        self.served = served
        self.server = uvicorn.Server(uvicorn.Config(served.app, host="127.0.0.1", port=0,
                                                    log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        end = time.time() + 20
        while not self.server.started and time.time() < end:
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc):
        try:
            self.served.halt()
        finally:
            self.server.should_exit = True
            self.thread.join(10)


def sse(lines) -> list:
    """The data of each event; the last must be [DONE]."""
    data = [line[len("data: "):] for line in lines if line]
    assert data and data[-1] == "[DONE]", data[-3:]
    assert all(line.startswith("data: ") for line in lines if line)
    return [json.loads(d) for d in data[:-1]]


def post(client, path, body, **kw):
    """The response; for a streamed request the events' data, checked to end with [DONE]."""
    if not body.get("stream"):
        return client.post(path, json=body, **kw)
    with client.stream("POST", path, json=body, **kw) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith(
            "text/event-stream")
        return sse(list(r.iter_lines()))

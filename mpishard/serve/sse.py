"""One request's answer as it arrives from the decode loop: token events turned into text
pieces (detok.py), cut at a stop string, counted, and shaped as OpenAI's response bodies or
as Server-Sent Events in OpenAI's chunk format.

    run = Run(ticket, tok, prompt_ids, stops, eos, metrics, arrived)
    async for piece in run.pieces(): ...          # then run.finish, run.usage()
    StreamingResponse(completion_events(run, head, include_usage), media_type=EVENT_STREAM)

The streamed pieces and the non-streamed text come from the same Run, so their bytes are
equal. A matched stop string cancels the row (ticket.cancel()); so does a run abandoned before
its last event (a client that went away: the generator is closed or cancelled).
"""
from __future__ import annotations

import json
import time

from .detok import Detokenizer, StopMatcher

EVENT_STREAM = "text/event-stream"
DONE = "data: [DONE]\n\n"


class Run:
    """The events of one ticket as text pieces, with the finish reason and token counts."""

    def __init__(self, ticket, tok, prompt_ids: list, stops: list, eos, metrics,
                 arrived: float):
        self.ticket, self.eos, self.metrics, self.arrived = ticket, set(eos), metrics, arrived
        self.detok = Detokenizer(tok, prompt_ids)
        self.stop = StopMatcher(stops)
        self.prompt_ids, self.ids, self.shown = list(prompt_ids), [], 0
        self.prompt_tokens, self.completion_tokens = len(prompt_ids), 0
        self.finish = None
        self._last = None

    def _count(self, token) -> None:
        now = time.perf_counter()
        self.completion_tokens += 1
        self.metrics.tokens(generated=1)
        if self._last is None:
            self.metrics.first_token(now - self.arrived)
        else:
            self.metrics.next_token(now - self._last)
        self._last = now

    async def pieces(self):
        """The completion's text, piece by piece, until its last event or a stop string."""
        try:
            while self.finish is None:
                token, finish = await self.ticket.get()
                piece = ""
                if token is not None:
                    self._count(token)
                    self.ids.append(token)
                    if token not in self.eos:
                        piece = self.detok.add(token)
                if finish is not None:
                    piece += self.detok.flush()
                out, matched = self.stop.feed(piece)
                if matched:
                    self.finish = "stop"
                    if finish is None:
                        self.ticket.cancel()
                elif finish is not None:
                    out += self.stop.flush()
                    self.finish = finish
                if out:
                    yield out
        finally:
            if self.finish is None:          # abandoned: the client went away
                self.ticket.cancel()

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def head(rid: str, kind: str, model: str) -> dict:
    """The fields every body and chunk of one answer shares."""
    return {"id": rid, "object": kind, "created": int(time.time()), "model": model}


def with_ids(run: Run, choice: dict, wanted: bool, first: bool = True) -> dict:
    """`choice` with vLLM's return_token_ids fields when `wanted`: the completion's ids not
    given in an earlier chunk (a whole body: all of them), and on the first the prompt's."""
    if not wanted:
        return choice
    new, run.shown = run.ids[run.shown:], len(run.ids)
    return dict(choice, token_ids=new, **({"prompt_token_ids": run.prompt_ids} if first else {}))


def completion_body(run: Run, text: str, base: dict, ids: bool = False) -> dict:
    return dict(base, choices=[with_ids(run, {"index": 0, "text": text, "logprobs": None,
                                               "finish_reason": run.finish}, ids)],
                usage=run.usage())


def chat_body(run: Run, text: str, base: dict, ids: bool = False) -> dict:
    return dict(base, choices=[with_ids(run, {
        "index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
        "finish_reason": run.finish}, ids)], usage=run.usage())


def event(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _chunk(base: dict, choice: dict, include_usage: bool) -> str:
    body = dict(base, choices=[dict(choice, index=0, logprobs=None)])
    if include_usage:
        body["usage"] = None
    return event(body)


async def _tail(run: Run, base: dict, include_usage: bool):
    if include_usage:
        yield event(dict(base, choices=[], usage=run.usage()))
    yield DONE


async def completion_events(run: Run, base: dict, include_usage: bool, ids: bool = False):
    """SSE of a /v1/completions answer (object "text_completion"): a chunk per piece, the
    finish reason on an empty last chunk, the usage chunk when asked for, then [DONE]; `ids`:
    each chunk carries its token ids (with_ids)."""
    first = True
    async for piece in run.pieces():
        yield _chunk(base, with_ids(run, {"text": piece, "finish_reason": None}, ids, first),
                     include_usage)
        first = False
    yield _chunk(base, with_ids(run, {"text": "", "finish_reason": run.finish}, ids, first),
                 include_usage)
    async for line in _tail(run, base, include_usage):
        yield line


async def chat_events(run: Run, base: dict, include_usage: bool, ids: bool = False):
    """SSE of a /v1/chat/completions answer (object "chat.completion.chunk"): a first delta
    with the assistant role, a delta per piece, an empty delta with the finish reason, the
    usage chunk when asked for, then [DONE]; `ids`: as completion_events."""
    yield _chunk(base, with_ids(run, {"delta": {"role": "assistant", "content": ""},
                                      "finish_reason": None}, ids), include_usage)
    async for piece in run.pieces():
        yield _chunk(base, with_ids(run, {"delta": {"content": piece}, "finish_reason": None},
                                    ids, False), include_usage)
    yield _chunk(base, with_ids(run, {"delta": {}, "finish_reason": run.finish}, ids, False),
                 include_usage)
    async for line in _tail(run, base, include_usage):
        yield line

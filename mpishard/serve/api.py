"""The OpenAI-compatible HTTP front of `mpishard serve` (rank 0): a Starlette app that checks
requests (protocol.py), queues them on the Intake the decode loop serves (intake.py), and
answers with the loop's tokens as text (sse.py, detok.py).

    app = build_app(intake, tok, model_name=..., max_model_len=..., vocab_size=..,
                    chat_template=..., special_tokens=..., eos=[...], api_key=None,
                    metrics=make_metrics())
    uvicorn.run(app, host=..., port=...)

Endpoints: POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /health,
GET /metrics. With an api_key every /v1/ endpoint answers 401 unless the request carries
`Authorization: Bearer KEY`; /health and /metrics stay open for probes and scrapers. A full
queue answers 429 and a draining server 503, both with Retry-After. A client that goes away
(a closed stream or an abandoned plain request) cancels its row.

starlette (the `serve` extra) is imported guarded, so this module imports without it;
build_app then raises an ImportError naming the extra.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
import uuid

from .intake import Draining, QueueFull
from .metrics import SERVE_EXTRA
from .protocol import ApiError, Limits, parse_chat, parse_completion
from .sse import EVENT_STREAM, Run, chat_body, chat_events, completion_body, \
    completion_events, head

try:
    import anyio
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, Response, StreamingResponse
    from starlette.routing import Route
except ImportError:                      # the serve extra is not installed
    Starlette = None
    StreamingResponse = object

DRAIN_RETRY_AFTER = 5                    # seconds a client waits before trying a draining server


def error_response(err: ApiError) -> "JSONResponse":
    return JSONResponse(err.body(), status_code=err.status, headers=err.headers)


class EventStream(StreamingResponse):
    """A StreamingResponse that always watches for the client going away and then cancels the
    request's row (Starlette's own watches only for ASGI servers older than spec 2.4, and a
    stream waiting on the loop sends nothing that would notice)."""

    def __init__(self, content, run: Run):
        super().__init__(content, media_type=EVENT_STREAM,
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.run = run

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as group:
                async def stream() -> None:
                    try:
                        await self.stream_response(send)
                    except OSError:      # the connection broke while sending
                        pass
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            if self.run.finish is None:
                self.run.ticket.cancel()
            await self.body_iterator.aclose()


async def _disconnected(request) -> None:
    """Returns once the client has gone away (the body has been read already)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Server:
    """The routes of one app, sharing the intake, the tokenizer and the limits."""

    def __init__(self, intake, tok, limits: Limits, chat_template, special_tokens, eos,
                 api_key, metrics):
        self.intake, self.tok, self.limits = intake, tok, limits
        self.template, self.special_tokens = chat_template, dict(special_tokens or {})
        self.eos, self.api_key, self.metrics = list(eos), api_key, metrics

    def _authorize(self, request) -> None:
        if self.api_key is None:
            return
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(),
                                                                  self.api_key.encode()):
            raise ApiError(401, "incorrect or missing API key: send 'Authorization: Bearer "
                                "KEY' with the server's --api-key", code="invalid_api_key")

    async def _body(self, request):
        try:
            return json.loads(await request.body())
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})") from None

    def _submit(self, req):
        try:
            return self.intake.submit(req.ids, req.params)
        except QueueFull as e:
            raise ApiError(429, str(e), type="rate_limit_error", code="queue_full",
                           headers={"Retry-After": str(math.ceil(e.retry_after))}) from None
        except Draining as e:
            raise ApiError(503, str(e), type="server_error", code="draining",
                           headers={"Retry-After": str(DRAIN_RETRY_AFTER)}) from None

    async def _generate(self, request, endpoint: str, parse, kind: str):
        arrived = time.perf_counter()
        try:
            self._authorize(request)
            req = parse(await self._body(request))
            ticket = self._submit(req)
        except ApiError as err:
            self.metrics.request(endpoint, err.status)
            return error_response(err)
        self.metrics.tokens(prompt=len(req.ids))
        self.metrics.request(endpoint, 200)
        run = Run(ticket, self.tok, req.ids, req.stops, self.eos, self.metrics, arrived)
        chat = kind == "chat"
        prefix = "chatcmpl-" if chat else "cmpl-"
        if req.stream:
            base = head(prefix + uuid.uuid4().hex, "chat.completion.chunk" if chat
                        else "text_completion", self.limits.model_name)
            events = (chat_events if chat else completion_events)(run, base, req.include_usage,
                                                                  req.token_ids)
            return EventStream(events, run)
        base = head(prefix + uuid.uuid4().hex, "chat.completion" if chat else "text_completion",
                    self.limits.model_name)
        text = await self._collect(request, run)
        if text is None:
            return Response(status_code=499)
        return JSONResponse((chat_body if chat else completion_body)(run, text, base,
                                                                     req.token_ids))

    async def _collect(self, request, run: Run):
        """The whole text of a plain answer; None (the row cancelled) if the client left."""
        async def whole() -> str:
            return "".join([piece async for piece in run.pieces()])

        answer = asyncio.ensure_future(whole())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not answer.done():
                answer.cancel()
                run.ticket.cancel()
        return answer.result() if answer.done() and not answer.cancelled() else None

    async def completions(self, request):
        return await self._generate(
            request, "/v1/completions",
            lambda body: parse_completion(body, self.limits, self.tok), "completion")

    async def chat(self, request):
        return await self._generate(
            request, "/v1/chat/completions",
            lambda body: parse_chat(body, self.limits, self.tok, self.template,
                                    self.special_tokens), "chat")

    async def models(self, request):
        try:
            self._authorize(request)
        except ApiError as err:
            return error_response(err)
        return JSONResponse({"object": "list", "data": [{
            "id": self.limits.model_name, "object": "model", "created": 0,
            "owned_by": "mpishard", "max_model_len": self.limits.max_model_len}]})

    async def health(self, request):
        if self.intake.draining:
            return JSONResponse({"status": "draining"}, status_code=503,
                                headers={"Retry-After": str(DRAIN_RETRY_AFTER)})
        return JSONResponse({"status": "ok"})

    async def prometheus(self, request):
        body, content_type = self.metrics.render()
        return Response(body, headers={"Content-Type": content_type})


async def _http_error(request, exc):
    """Starlette's own refusals (an unknown path, a wrong method) as OpenAI-style errors."""
    err = ApiError(exc.status_code, exc.detail or "error", headers=exc.headers)
    return error_response(err)


def build_app(intake, text, *, model_name: str, max_model_len: int, vocab_size: int,
              chat_template, special_tokens, eos, api_key, metrics):
    """The Starlette app answering OpenAI requests for `model_name` on top of `intake`.

    text: a tokenizers.Tokenizer, or None for the bytes tokenizer; chat_template: the
    template's source (None: chat requests answer 400); special_tokens: the variables the
    template sees (train.chat_template.template_tokens); eos: the ids that end a completion
    (left out of its text); api_key: None, or the key every /v1/ request must bear;
    metrics: a ServeMetrics (serve.metrics.make_metrics)."""
    if Starlette is None:
        raise ImportError(SERVE_EXTRA)
    server = Server(intake, text, Limits(model_name, int(max_model_len), int(vocab_size)),
                    chat_template, special_tokens, eos, api_key, metrics)
    routes = [Route("/v1/completions", server.completions, methods=["POST"]),
              Route("/v1/chat/completions", server.chat, methods=["POST"]),
              Route("/v1/models", server.models, methods=["GET"]),
              Route("/health", server.health, methods=["GET"]),
              Route("/metrics", server.prometheus, methods=["GET"])]
    return Starlette(routes=routes, exception_handlers={HTTPException: _http_error})

"""The OpenAI request bodies the server accepts, checked before anything is queued, and the
OpenAI-style error every refusal answers with.

    limits = Limits(model_name, max_model_len, vocab_size)
    req = parse_completion(body, limits, tok)          # or parse_chat(body, limits, tok,
    req.ids, req.params, req.stops, req.stream            #          template, special_tokens)
    except ApiError as e: JSONResponse(e.body(), e.status, headers=e.headers)

A refusal is {"error": {"message", "type", "param", "code"}} with status 400 (a bad value or
type, a prompt that with its max_tokens does not fit the model), 404 (a model this server does
not serve) or 401/429/503 (api.py). Parameters the server does not implement are accepted with
the neutral value clients send by default (presence_penalty 0, logprobs false, a user, ...);
any other value is refused by name, and so is a parameter nobody defined, rather than being
ignored silently. `n` must be 1. `return_token_ids: true` (vLLM's extension) adds the prompt's
and the completion's token ids to each choice (to each chunk: the ids it carries). The sampling
parameters handed to the decode loop are
{"max_tokens", "temperature", "top_p", "top_k" (0: off; a request's -1 too, as vLLM's), "seed"
(None: unseeded)}.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..train.chat_template import render_chat
from .detok import check_stop, encode

ANY = object()
# parameter -> the values that mean "not used"; ANY: any value (informational parameters)
NEUTRAL_COMMON = {"presence_penalty": (0,), "frequency_penalty": (0,), "logit_bias": ({},),
                  "user": ANY, "metadata": ANY, "service_tier": ANY, "store": (False,),
                  "repetition_penalty": (1,), "min_tokens": (0,)}
NEUTRAL_COMPLETION = dict(NEUTRAL_COMMON, logprobs=(False, ), echo=(False,), best_of=(1,),
                          suffix=("",))
NEUTRAL_CHAT = dict(NEUTRAL_COMMON, logprobs=(False,), top_logprobs=(0,), tools=([],),
                    tool_choice=("none", "auto"), parallel_tool_calls=ANY,
                    response_format=({"type": "text"},), modalities=(["text"],))
COMMON = ("model", "max_tokens", "temperature", "top_p", "top_k", "stop", "seed", "n", "stream",
          "stream_options", "return_token_ids")
COMPLETION_KEYS = COMMON + ("prompt",)
CHAT_KEYS = COMMON + ("messages", "max_completion_tokens")
DEFAULT_COMPLETION_TOKENS = 16           # OpenAI's default max_tokens for /v1/completions
MAX_STOPS = 4                            # OpenAI's limit on stop strings


class ApiError(Exception):
    """A request refused with an OpenAI-style JSON error."""

    def __init__(self, status: int, message: str, param=None, code=None,
                 type="invalid_request_error", headers=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.type, self.headers = type, dict(headers or {})

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


@dataclass
class Limits:
    """What a request must fit: the served model's name, its context length and vocabulary."""
    model_name: str
    max_model_len: int
    vocab_size: int


@dataclass
class Request:
    """A checked generation request: prompt ids, the loop's params, and the HTTP-side rest."""
    ids: list
    params: dict
    stops: list = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    token_ids: bool = False


def _bad(param: str, message: str) -> ApiError:
    return ApiError(400, message, param=param)


def _int(body: dict, key: str, default, low=None):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise _bad(key, f"'{key}' must be an integer, got {type(value).__name__} {value!r}")
    if low is not None and value < low:
        raise _bad(key, f"'{key}' must be at least {low}, got {value}")
    return value


def _float(body: dict, key: str, default, low: float, high: float):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise _bad(key, f"'{key}' must be a number, got {type(value).__name__} {value!r}")
    if not low <= value <= high:
        raise _bad(key, f"'{key}' must be between {low} and {high}, got {value}")
    return float(value)


def _bool(body: dict, key: str, default: bool) -> bool:
    value = body.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise _bad(key, f"'{key}' must be a boolean, got {type(value).__name__} {value!r}")
    return value


def _check_keys(body: dict, known: tuple, neutral: dict) -> None:
    """Unknown parameters and non-neutral values of unsupported ones are refused by name."""
    for key, value in body.items():
        if key in known or value is None:
            continue
        if key not in neutral:
            raise _bad(key, f"unrecognized request argument supplied: {key}")
        allowed = neutral[key]
        if allowed is not ANY and not any(type(value) is type(a) or
                                          {type(value), type(a)} == {int, float}
                                          for a in allowed if a == value):
            raise _bad(key, f"'{key}' is not supported by this server: only "
                            f"{' or '.join(repr(a) for a in allowed)} is accepted, got {value!r}")


def _check_model(body: dict, limits: Limits) -> None:
    model = body.get("model")
    if not isinstance(model, str):
        raise _bad("model", "you must provide a model parameter (a string)")
    if model != limits.model_name:
        raise ApiError(404, f"the model '{model}' does not exist; this server serves "
                            f"'{limits.model_name}'", param="model", code="model_not_found")


def _common(body: dict, limits: Limits, ids: list, max_tokens, param: str) -> Request:
    """The parameters both endpoints share, and the length check of prompt + max_tokens."""
    if not ids:
        raise _bad(param, "the prompt is empty: give at least one token")
    outside = [i for i in ids if not 0 <= i < limits.vocab_size]
    if outside:                          # a tokenizer with more ids than the model has
        raise _bad(param, f"the prompt encodes to token id {outside[0]}, outside the model's "
                          f"vocabulary (0..{limits.vocab_size - 1}): the tokenizer does not "
                          f"match the model")
    room = limits.max_model_len - len(ids)
    if room <= 0:
        raise ApiError(400, f"this model's maximum context length is {limits.max_model_len} "
                            f"tokens; the prompt has {len(ids)}", param=param,
                       code="context_length_exceeded")
    if max_tokens is None:
        max_tokens = room
    if max_tokens > limits.max_model_len:
        raise _bad("max_tokens", f"max_tokens is {max_tokens}, past the model's maximum "
                                 f"context length of {limits.max_model_len} tokens")
    if max_tokens > room:
        raise ApiError(400, f"this model's maximum context length is {limits.max_model_len} "
                            f"tokens; the prompt has {len(ids)} and max_tokens asks for "
                            f"{max_tokens} more", param="max_tokens",
                       code="context_length_exceeded")
    if _int(body, "n", 1) != 1:
        raise _bad("n", "only n=1 is supported: one completion per request")
    try:
        stops = check_stop(body.get("stop"))
    except ValueError as e:
        raise _bad("stop", str(e)) from None
    if len(stops) > MAX_STOPS:
        raise _bad("stop", f"at most {MAX_STOPS} stop strings, got {len(stops)}")
    stream = _bool(body, "stream", False)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise _bad("stream_options", "'stream_options' must be an object")
    include_usage = _bool(options or {}, "include_usage", False)
    params = {"max_tokens": max_tokens,
              "temperature": _float(body, "temperature", 1.0, 0.0, 2.0),
              "top_p": _float(body, "top_p", 1.0, 0.0, 1.0),
              "top_k": max(_int(body, "top_k", 0, low=-1), 0),   # -1: off, as vLLM
              "seed": _int(body, "seed", None, low=0)}      # numpy seeds are non-negative
    if params["top_p"] == 0.0:
        raise _bad("top_p", "'top_p' must be above 0 (use temperature 0 for greedy decoding)")
    return Request(ids, params, stops, stream, include_usage,
                   _bool(body, "return_token_ids", False))


def _prompt_ids(prompt, limits: Limits, tok) -> list:
    """The ids of a completions prompt: a string, token ids, or a list of exactly one of them."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return encode(tok, prompt, special=True)
    if isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool)
                                                   for i in prompt):
        bad = [i for i in prompt if not 0 <= i < limits.vocab_size]
        if bad:
            raise _bad("prompt", f"token id {bad[0]} is outside the vocabulary "
                                 f"(0..{limits.vocab_size - 1})")
        return list(prompt)
    if isinstance(prompt, list) and len(prompt) > 1:
        raise _bad("prompt", "one prompt per request: give a string or a list of token ids")
    raise _bad("prompt", "'prompt' must be a string or a list of token ids, got "
                         f"{type(prompt).__name__}")


def parse_completion(body, limits: Limits, tok) -> Request:
    """A /v1/completions body checked (ApiError otherwise); the prompt is encoded with the
    tokenizer's special tokens, as Hugging Face tokenizers do by default."""
    if not isinstance(body, dict):
        raise _bad(None, "the request body must be a JSON object")
    _check_keys(body, COMPLETION_KEYS, NEUTRAL_COMPLETION)
    _check_model(body, limits)
    if "prompt" not in body:
        raise _bad("prompt", "you must provide a prompt")
    ids = _prompt_ids(body["prompt"], limits, tok)
    max_tokens = _int(body, "max_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = max(1, min(DEFAULT_COMPLETION_TOKENS, limits.max_model_len - len(ids)))
    return _common(body, limits, ids, max_tokens, "prompt")


def _message_text(content, i: int):
    """A message's content as text: a string, or OpenAI's list of {"type": "text"} parts."""
    if not isinstance(content, list):
        return content
    texts = []
    for part in content:
        if not (isinstance(part, dict) and part.get("type") == "text"
                and isinstance(part.get("text"), str)):
            raise _bad("messages", f"message {i}: only text content parts are supported")
        texts.append(part["text"])
    return "".join(texts)


def parse_chat(body, limits: Limits, tok, template, special_tokens) -> Request:
    """A /v1/chat/completions body checked, its messages rendered with the chat template (with
    the generation prompt) and encoded without the tokenizer's special tokens."""
    if not isinstance(body, dict):
        raise _bad(None, "the request body must be a JSON object")
    _check_keys(body, CHAT_KEYS, NEUTRAL_CHAT)
    _check_model(body, limits)
    if template is None:
        raise _bad("messages", f"the model '{limits.model_name}' has no chat template (no "
                               f"chat_template.jinja, no chat_template in "
                               f"tokenizer_config.json): use /v1/completions, or restart the "
                               f"server with --chat-template FILE")
    messages = body.get("messages")
    if isinstance(messages, list):
        messages = [dict(m, content=_message_text(m.get("content"), i)) if isinstance(m, dict)
                    else m for i, m in enumerate(messages)]
    try:
        text = render_chat(template, messages, add_generation_prompt=True,
                           special_tokens=special_tokens)
    except (ValueError, TypeError) as e:          # a bad message: the template's error
        raise _bad("messages", str(e)) from None
    ids = encode(tok, text, special=False)
    max_tokens = _int(body, "max_completion_tokens", None, low=1)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, low=1)
    return _common(body, limits, ids, max_tokens, "messages")

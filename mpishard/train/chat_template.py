"""Chat templates: a conversation rendered and tokenized exactly as `transformers` does it.

    template = chat_template_for(tokenizer, override=None)  # or a --chat-template FILE
    text = render_chat(template, messages, special_tokens=template_tokens(tokenizer.files))
    ids, mask = encode_chat(tokenizer, template, messages)  # int64 ids, uint8 answer mask

`messages` is the OpenAI chat format: a non-empty list of {"role": str, "content": str}
dicts (other keys pass through to the template; keys whose value is None are dropped, as
transformers drops them, so a Parquet struct column's missing fields do not render as "None").

Finding the template (`find_chat_template(files)`, files = {file name: bytes} as
train.tokenizer.read_tokenizer_files reads them): the order `AutoTokenizer.from_pretrained`
uses. A `chat_template.jinja` file first; else the `chat_template` key of
tokenizer_config.json, a string or a list of {"name", "template"} of which "default" is used;
else the legacy processor file `chat_template.json` ({"chat_template": ...}), which a
tokenizer alone never reads but a model directory may hold. None when there is none.
`load_chat_template(path)` reads a `--chat-template FILE` override: the template's text, or
for a .json file its "chat_template" key. `chat_template_for(tokenizer, override=None)`: the
override when given, else the tokenizer's own, else a ValueError naming --chat-template.

Rendering (`render_chat`): jinja2 configured as transformers' `_compile_jinja_template`: an
ImmutableSandboxedEnvironment with trim_blocks and lstrip_blocks, the loopcontrols extension,
the `{% generation %}` block, a `tojson` filter that keeps non-ASCII and does not escape HTML,
the globals `raise_exception`, `strftime_now`, `dict` and a `namespace` refusing underscore
names; the variables are `messages`, `add_generation_prompt`, `tools`/`documents` (None) and
the tokenizer's special tokens (`template_tokens(files)`: bos_token, eos_token, ... from
tokenizer_config.json, or special_tokens_map.json when the config has no
added_tokens_decoder, as transformers reads them). A template that raises (its
`raise_exception`, an undefined name, a syntax error) is a ValueError with its message.

Tokenizing (`encode_chat`): the rendered text is encoded with add_special_tokens=False, as
`apply_chat_template(tokenize=True)` does, so only the template's own special tokens appear.
The mask is 1 on the tokens of the assistant turns. A template with `{% generation %}`
blocks marks them itself, and the mask is then transformers' `return_assistant_tokens_mask`.
Otherwise each assistant turn i is what rendering messages[:i+1] adds to messages[:i] with
the generation prompt: its content and the template's end-of-turn text (Llama 3's
"<|eot_id|>", ChatML's "<|im_end|>\\n"; a template that ignores add_generation_prompt
counts the turn's header too). A template that renders a turn differently once
later messages follow (the prefixes do not nest) is refused: give a template with
`{% generation %}` blocks. A token overlapping an assistant span counts (transformers'
rule). The tokenizer is an HFTokenizer (its `tokenizer` is a `tokenizers.Tokenizer`, whose
offsets map characters to tokens) or the byte tokenizer (each UTF-8 byte one id, a
character's bytes all inside or all outside a span).
"""
from __future__ import annotations

import functools
import json
import os
import re
from contextvars import ContextVar
from datetime import datetime

import numpy as np

from .text import BYTES

JINJA_FILE = "chat_template.jinja"
LEGACY_JSON_FILE = "chat_template.json"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# the named special tokens transformers passes to a template (SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
ASSISTANT = "assistant"
GENERATION_TAG = re.compile(r"\{\%-?\s*generation\s*-?\%\}")
INSTALL = "pip install 'mpishard[sft]'"


def _jinja():
    """The jinja2 module (an optional package: the `sft` extra)."""
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError as e:
        raise ImportError(f"chat templates need jinja2: {INSTALL}") from e
    return jinja2


def _json(files: dict, name: str):
    raw = files.get(name)
    if raw is None:
        return None
    try:
        return json.loads(raw)
    except ValueError as e:
        raise ValueError(f"{name}: not valid JSON ({e})") from None


def _pick(value, where: str):
    """A chat_template value: a string, or a list of named templates of which "default"."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(t, dict) and "name" in t and "template" in t
                                       for t in value):
        named = {t["name"]: t["template"] for t in value}
        if "default" not in named:
            raise ValueError(f"{where}: several chat templates {sorted(named)} and none named "
                             f"'default'; give one with --chat-template FILE")
        return named["default"]
    raise ValueError(f"{where}: chat_template is neither a string nor a list of "
                     f"{{'name', 'template'}} entries")


def find_chat_template(files: dict):
    """The chat template among a tokenizer's files ({name: bytes}), in transformers' order
    (module docstring), or None."""
    if JINJA_FILE in files:
        return files[JINJA_FILE].decode("utf-8")
    config = _json(files, CONFIG_FILE) or {}
    found = _pick(config.get("chat_template"), CONFIG_FILE)
    if found is not None:
        return found
    legacy = _json(files, LEGACY_JSON_FILE) or {}
    return _pick(legacy.get("chat_template"), LEGACY_JSON_FILE)


def load_chat_template(path) -> str:
    """The template of a --chat-template FILE: its text, or a .json file's "chat_template"."""
    path = os.fspath(path)
    with open(path, "rb") as f:
        raw = f.read()
    if not path.endswith(".json"):
        return raw.decode("utf-8")
    found = _pick((_json({path: raw}, path) or {}).get("chat_template"), path)
    if found is None:
        raise ValueError(f"{path}: no chat_template key")
    return found


def chat_template_for(tokenizer, override=None) -> str:
    """The template a run uses: the `--chat-template FILE` override when given, else the one
    among the tokenizer's files (find_chat_template); ValueError when there is neither."""
    if override is not None:
        return load_chat_template(override)
    found = find_chat_template(getattr(tokenizer, "files", None) or {})
    if found is None:
        raise ValueError(f"{tokenizer!r} has no chat template (no chat_template.jinja, no "
                         f"chat_template in tokenizer_config.json); give --chat-template FILE")
    return found


def _token_text(value):
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def template_tokens(files: dict) -> dict:
    """{variable: token text} of the special tokens a template sees (bos_token, eos_token, ...
    and a config's model-specific *_token strings), read as transformers reads them."""
    config = _json(files, CONFIG_FILE) or {}
    tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
    tokens.update({k: v for k, v in config.items()
                   if k.endswith("_token") and k not in tokens and isinstance(v, str)})
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        tokens.update({k: _token_text(v) for k, v in extra.items()})
    if "added_tokens_decoder" not in config:
        legacy = _json(files, SPECIAL_TOKENS_MAP_FILE) or {}
        tokens.update({k: _token_text(v) for k, v in legacy.items() if k in SPECIAL_TOKENS})
    return {k: v for k, v in tokens.items() if v is not None}


@functools.lru_cache(maxsize=8)
def _compile(template: str):
    """The template compiled in transformers' environment (see the module docstring)."""
    jinja2 = _jinja()

    class Generation(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}`: records the character span of its output
        while a tracker is active (transformers' AssistantTracker)."""
        tags = {"generation"}

        def __init__(self, environment):
            super().__init__(environment)
            environment.extend(track=self.track)
            self._tracking = ContextVar("chat_generation", default=None)

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_generation"), [], [],
                                          body).set_lineno(lineno)

        def _generation(self, caller):
            out = caller()
            tracking = self._tracking.get()
            if tracking is not None:
                blocks, spans = tracking
                start = len("".join(blocks))
                spans.append((start, start + len(out)))
            return out

        def track(self, blocks, spans):
            return self._tracking.set((blocks, spans))

        def untrack(self, token):
            self._tracking.reset(token)

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(format):
        return datetime.now().strftime(format)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        def __init__(*args, **kwargs):
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value):
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name):
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template cannot store the underscore name {name!r} on a namespace")

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now,
                       dict=TemplateDict(), namespace=TemplateNamespace)
    extension = next(e for e in env.extensions.values() if isinstance(e, Generation))
    return env.from_string(template), extension


def _reasoning_aliased(message: dict) -> dict:
    """transformers' alias of a message's reasoning: `reasoning_content` and `thinking` set
    from whichever of reasoning_content/thinking/reasoning it has."""
    reasoning = next((message[k] for k in ("reasoning_content", "thinking", "reasoning")
                      if message.get(k) is not None), None)
    if reasoning is None:
        return message
    return {"thinking": reasoning, **message, "reasoning_content": reasoning}


def check_messages(messages) -> list:
    """The messages as the template sees them: None-valued keys dropped, reasoning aliased.
    ValueError unless a non-empty list of dicts with string "role" and "content"."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of {{'role', 'content'}} dicts, "
                         f"got {type(messages).__name__}"
                         + (" (empty)" if isinstance(messages, (list, tuple)) else ""))
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is a {type(message).__name__}, not a "
                             f"{{'role', 'content'}} dict")
        message = {k: v for k, v in message.items() if v is not None}
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                got = "missing" if key not in message else type(message[key]).__name__
                raise ValueError(f"message {i}: {key!r} must be a string ({got})")
        out.append(_reasoning_aliased(message))
    return out


def _render(template: str, messages: list, add_generation_prompt: bool, special_tokens,
            spans=None) -> str:
    """The rendered text; with `spans` (a list) the {% generation %} spans appended to it."""
    if not isinstance(template, str):
        raise ValueError("no chat template: the tokenizer has none; give --chat-template FILE")
    jinja2 = _jinja()
    variables = dict(special_tokens or {}, messages=messages, tools=None, documents=None,
                     add_generation_prompt=add_generation_prompt)
    try:
        compiled, extension = _compile(template)
        if spans is None:
            return compiled.render(**variables)
        blocks = []
        token = extension.track(blocks, spans)
        try:
            for block in compiled.generate(**variables):
                blocks.append(block)
        finally:
            extension.untrack(token)
        return "".join(blocks)
    except jinja2.exceptions.TemplateError as e:
        raise ValueError(f"the chat template failed: {e}") from None


def render_chat(template: str, messages, add_generation_prompt: bool = False,
                special_tokens=None) -> str:
    """`messages` rendered with `template` as transformers' apply_chat_template(tokenize=
    False) renders them; special_tokens: {name: text} (template_tokens(files))."""
    return _render(template, check_messages(messages), add_generation_prompt, special_tokens)


def assistant_spans(template: str, messages, special_tokens=None) -> tuple:
    """(rendered text, [(start, end) character spans of the assistant turns])."""
    messages = check_messages(messages)
    if GENERATION_TAG.search(template or ""):
        spans = []
        return _render(template, messages, False, special_tokens, spans), spans
    text = _render(template, messages, False, special_tokens)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != ASSISTANT:
            continue
        head = _render(template, messages[:i], True, special_tokens)
        turn = _render(template, messages[:i + 1], False, special_tokens)
        if not (turn.startswith(head) and text.startswith(turn)):
            raise ValueError(f"the chat template renders message {i} (assistant) differently "
                             f"once later messages follow, so its tokens cannot be told apart; "
                             f"give a template with {{% generation %}} blocks (--chat-template "
                             f"FILE) or --loss-on all")
        spans.append((len(head), len(turn)))
    return text, spans


def _ids_and_offsets(tokenizer, text: str) -> tuple:
    """(ids, [(start, end)] character offsets per token) of `text`, no special tokens added."""
    inner = getattr(tokenizer, "tokenizer", None)
    if inner is not None:
        encoding = inner.encode(text, add_special_tokens=False)
        return np.asarray(encoding.ids, np.int64), encoding.offsets
    if getattr(tokenizer, "name", None) != BYTES:
        raise TypeError(f"encode_chat needs an HFTokenizer or the byte tokenizer, "
                        f"not {tokenizer!r}")
    ids, offsets = [], []
    for c, char in enumerate(text):
        raw = char.encode("utf-8", errors="surrogatepass")
        ids.extend(raw)
        offsets.extend([(c, c + 1)] * len(raw))
    return np.asarray(ids, np.int64), offsets


def span_mask(offsets, spans) -> np.ndarray:
    """1 on each token overlapping a span (both in order), as apply_chat_template's
    return_assistant_tokens_mask marks them."""
    mask = np.zeros(len(offsets), np.uint8)
    s = 0
    for t, (start, end) in enumerate(offsets):
        while s < len(spans) and start >= spans[s][1]:
            s += 1
        if s == len(spans):
            break
        if end > spans[s][0]:
            mask[t] = 1
    return mask


def encode_chat(tokenizer, template: str, messages) -> tuple:
    """(ids int64, mask uint8) of a conversation: the ids of apply_chat_template(messages,
    tokenize=True) and 1 on the assistant turns' tokens (module docstring)."""
    special = template_tokens(getattr(tokenizer, "files", None) or {})
    text, spans = assistant_spans(template, messages, special)
    ids, offsets = _ids_and_offsets(tokenizer, text)
    return ids, span_mask(offsets, spans)


__all__ = ["assistant_spans", "chat_template_for", "check_messages", "encode_chat",
           "find_chat_template",
           "load_chat_template", "render_chat", "span_mask", "template_tokens"]

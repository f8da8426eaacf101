"""Text in and out of the server: encoding a prompt, decoding a completion as it streams, and
cutting it at a stop string.

    ids = encode(tok, text, special=True)        # tok: a tokenizers.Tokenizer, or None: bytes
    detok = Detokenizer(tok, prompt_ids)
    piece = detok.add(token)                     # the text this token makes printable ("" when
    tail = detok.flush()                         # it waits for more); the rest at the end
    stop = StopMatcher(["\\n\\n"])
    out, matched = stop.feed(piece)              # text safe to send; True once a stop string
    out = stop.flush()                           # appeared (cut, with everything after it)

`tok` None is the bytes tokenizer: each UTF-8 byte one id (0..255); an id past 255 (a model
whose vocabulary adds ids, an eos) prints nothing.

A tokenizers.Tokenizer is decoded incrementally the way vLLM and TGI do it, with a prefix
and a read offset into the ids: the new text is decode(ids[prefix:]) less decode(
ids[prefix:read]). Decoding a window rather than one token at a time keeps BPE merges and
byte-level pieces whole, and starting the window a few tokens back in the prompt keeps a
leading space that a sentencepiece-style (Metaspace) decoder strips from the first token of a
text ("▁Paris" alone decodes to "Paris"). Text ending in U+FFFD (a multi-byte character whose
bytes are split over tokens) is held back until the character completes. The pieces joined
are exactly the text of the completion as it continues the prompt, so a streamed answer and a
whole one are the same bytes.
"""
from __future__ import annotations

import codecs

REPLACEMENT = "\ufffd"
# prompt tokens the first window reaches back (vLLM's INITIAL_INCREMENTAL_DETOKENIZATION_OFFSET)
CONTEXT = 5


def encode(tok, text: str, special: bool = True) -> list:
    """The ids of `text`; special=False leaves out the tokenizer's own special tokens (a
    rendered chat template holds its own)."""
    if tok is None:
        return list(text.encode("utf-8"))
    return tok.encode(text, add_special_tokens=special).ids


class Detokenizer:
    """Incremental decoding of one completion that continues the prompt `context`."""

    def __init__(self, tok, context=()):
        self.tok = tok
        if tok is None:
            self.bytes = codecs.getincrementaldecoder("utf-8")(errors="replace")
            return
        self.ids = list(context)[-CONTEXT:]
        self.prefix = 0
        self.read = len(self.ids)

    def add(self, token: int) -> str:
        """The text that `token` (the next id of the completion) makes printable."""
        if self.tok is None:
            return self.bytes.decode(bytes([token]) if 0 <= token < 256 else b"")
        self.ids.append(int(token))
        head = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        if len(text) <= len(head) or text.endswith(REPLACEMENT):
            return ""
        self.prefix, self.read = self.read, len(self.ids)
        return text[len(head):]

    def flush(self) -> str:
        """What is still held back at the end (an incomplete character, as U+FFFD)."""
        if self.tok is None:
            return self.bytes.decode(b"", final=True)
        head = self.tok.decode(self.ids[self.prefix:self.read])
        text = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return text[len(head):] if len(text) > len(head) else ""


def check_stop(stop) -> list:
    """The stop strings of a request: None, a string or a list of strings, as a list;
    ValueError for anything else or an empty string."""
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("'stop' must be a string or a list of strings")
    if any(s == "" for s in stops):
        raise ValueError("'stop' strings must not be empty")
    return list(stops)


class StopMatcher:
    """Cuts a streamed text at the first occurrence of any stop string, across pieces.

    The end of the text that could begin a stop string is held back until the next piece
    shows whether it does; a matched stop string is left out, with everything after it."""

    def __init__(self, stops: list):
        self.stops = list(stops)
        self.held = ""
        self.matched = False

    def _held_back(self, text: str) -> int:
        """Length of the longest end of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def feed(self, piece: str) -> tuple:
        """(text safe to send now, whether a stop string has matched)."""
        if self.matched:
            return "", True
        text = self.held + piece
        found = [i for i in (text.find(s) for s in self.stops) if i >= 0]
        if found:
            self.matched, self.held = True, ""
            return text[:min(found)], True
        keep = self._held_back(text)
        self.held = text[len(text) - keep:]
        return text[:len(text) - keep], False

    def flush(self) -> str:
        """The held-back text once the completion ended without a match."""
        out, self.held = self.held, ""
        return out

"""A KV cache for incremental decoding of a GPT: keys and values of the positions seen so far.

    cache = KVCache(capacity=model.seq_len)
    with caching(chunks, cache):          # every unit of this rank's stage(s)
        logits = forward(new_tokens)      # (B, t) -> (B, t, V): only the t new positions
    cache.advance(t)

Each attention unit (CausalSelfAttention) keeps, in the cache under its own key, buffers k, v of
shape (B, H_local, capacity, Dh) for the heads it computes (all heads on one device, H/tp under
tp); a pipeline stage's cache holds only its own blocks. A forward over t new tokens writes
their k, v at positions [length, length + t) and attends the t queries to every cached key
with the causal mask shifted by `length` (attention.attention_block with offset=length):

    out = softmax(q k[:, :, :length+t]^T / sqrt(Dh), query i sees key j <= length + i) v[...]

so the prompt goes through in one pass (prefill, t = its length) and each new token in a pass
of t = 1, with the same numbers as recomputing the whole context. The embeddings' positions
move with it: inside `caching`, their `token_positions(t)` is `cache.positions(t)` =
length .. length + t - 1.

The cache holds at most `capacity` (= seq_len) positions: the model has no position beyond.
What to do when it is full is the caller's choice (cli/generate.py recomputes the cropped
window: reset, then a prefill of the last tokens). Units that cannot decode incrementally
(ring/Ulysses attention under cp, the sequence-parallel embedding) have no cache hooks; the
layout check for that is parallel/gpt.check_decode.
"""
from __future__ import annotations

from contextlib import contextmanager

from .attention import attention_block
from .functional import array_module


class KVCache:
    """Cached keys/values per attention unit and the number of positions they hold."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.length = 0
        self.buffers: dict = {}          # attention unit -> (k, v), each (B, H, capacity, Dh)

    def __repr__(self):
        return f"KVCache({self.length}/{self.capacity} positions, {len(self.buffers)} layers)"

    def reset(self) -> None:
        """Forget every position (the buffers are kept for reuse)."""
        self.length = 0

    def positions(self, t: int) -> slice:
        """The positions of t new tokens: length .. length + t - 1 (ValueError past capacity)."""
        if self.length + t > self.capacity:
            raise ValueError(f"KV cache: {t} new positions after {self.length} exceed the "
                             f"model's {self.capacity} (reset it and prefill a shorter window)")
        return slice(self.length, self.length + t)

    def attend(self, unit, q, k, v):
        """q, k, v (B, H, t, Dh) of t new positions -> their attention output (B, H, t, Dh)
        over the cached keys and these; k, v are stored for the next calls."""
        where = self.positions(k.shape[2])
        kb, vb = self.buffers.get(unit, (None, None))
        shape = k.shape[:2] + (self.capacity, k.shape[3])
        if kb is None or kb.shape != shape or kb.dtype != k.dtype:
            xp = array_module(k)
            kb, vb = xp.zeros(shape, dtype=k.dtype), xp.zeros(shape, dtype=v.dtype)
            self.buffers[unit] = (kb, vb)
        kb[:, :, where] = k                                         # append
        vb[:, :, where] = v
        end = where.stop
        out, _ = attention_block(q, kb[:, :, :end], vb[:, :, :end], offset=self.length)
        return out

    def advance(self, t: int) -> None:
        """After a forward of t new tokens through every unit: they are cached now."""
        self.positions(t)
        self.length += int(t)


def cache_units(units):
    """(attention units with a `cache` hook, units with `token_positions`) below `units`,
    looking inside composites (`units`) and wrappers such as Recompute (`inner`)."""
    attention, embeddings = [], []
    stack = list(units)
    while stack:
        u = stack.pop()
        if hasattr(u, "cache"):
            attention.append(u)
        if hasattr(u, "token_positions"):
            embeddings.append(u)
        stack.extend(getattr(u, "units", ()))
        if getattr(u, "inner", None) is not None:
            stack.append(u.inner)
    return attention, embeddings


@contextmanager
def caching(chunks, cache: KVCache):
    """Within: the units of `chunks` (lists of units) decode against `cache` (attention reads
    and appends it, embeddings take positions from it); restored afterwards."""
    attention, embeddings = cache_units([u for chunk in chunks for u in chunk])
    saved = [(u, u.token_positions) for u in embeddings]
    for u in attention:
        u.cache = cache
    for u in embeddings:
        u.token_positions = cache.positions
    try:
        yield cache
    finally:
        for u in attention:
            u.cache = None
        for u, positions in saved:
            u.token_positions = positions


__all__ = ["KVCache", "cache_units", "caching"]

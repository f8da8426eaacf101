"""A KV cache for incremental decoding: keys and values of the positions seen so far, per row.

    cache = KVCache(capacity=model.seq_len)
    cache.extend(real)                    # (B, t) bool: which new tokens are real (optional)
    with caching(chunks, cache):          # every unit of this rank's stage(s)
        logits = forward(new_tokens)      # (B, t) -> (B, 1, V): the newest slot's logits
    cache.advance(t)

Each attention unit keeps, in the cache under its own key, buffers k, v of shape
(B, Hkv, capacity, Dh) for the kv heads it computes (all on one device, its share under tp); a
pipeline stage's cache holds only its own blocks, a data-parallel rank only its own rows. A
forward over t new tokens writes their k, v at slots [length, length + t) and attends the t
queries to the cached keys:

    out = softmax(q k[:, :, :length+t]^T / sqrt(Dh) + mask) v[:, :, :length+t]
    mask[b, i, j] = 0 if j <= length + i (causal by slot) and slot j of row b is real, else -inf

so a prompt goes through in one pass (prefill) and each new token in a pass of t = 1, with the
same numbers as recomputing the whole context. Rows of different lengths are left-padded: the
padding slots are never real (`extend`'s False), so no real query sees them, and a padding
query sees no key (its output is 0 and unused). Grouped-query attention: with Hkv < Hq kv heads
query head h reads kv head h // (Hq / Hkv) (HF's repeat_kv), computed without repeating the
buffers (the g = Hq / Hkv query heads of a kv head ride along the query axis).

Positions: a row's real tokens are numbered 0, 1, ... from its first real token (transformers'
cumsum(attention_mask) - 1); a padding slot gets the position of the real token before it
(clipped to 0: unused). Inside `caching`, the units' `token_positions(t)` is
`cache.positions(t)`: the (B, t) integer array of the new tokens after an `extend`, or the slice
length .. length + t - 1 when no rows were declared (one unpadded batch).

The cache holds at most `capacity` slots, at most seq_len (the model has no position beyond);
parallel/decode.py sizes it by the request (first prefill + max_new_tokens - 1), so the buffers
are not seq_len long for a short answer. What to do when it is full is the caller's choice
(parallel/decode.py recomputes the cropped window: reset, then a prefill of the last tokens).
Units that cannot decode incrementally (ring/Ulysses attention under cp, the sequence-parallel
embedding) have no cache hooks; the layout check for that is parallel/decoder.check_decode.
"""
from __future__ import annotations

from contextlib import contextmanager

from .attention import attention_block, causal_mask
from .autocast import FULL
from .functional import array_module


class KVCache:
    """Cached keys/values per attention unit, the slots they fill and which slots are real."""

    def __init__(self, capacity: int):
        self.capacity = int(capacity)
        self.length = 0
        self.buffers: dict = {}          # attention unit -> (k, v), each (B, Hkv, capacity, Dh)
        self.real = None                 # (B, capacity) bool once rows are declared (extend)
        self.seen = None                 # (B,) real tokens per row so far
        self.new_positions = None        # (B, t) positions of the slots being filled

    def __repr__(self):
        return f"KVCache({self.length}/{self.capacity} positions, {len(self.buffers)} layers)"

    def reset(self) -> None:
        """Forget every position (the buffers are kept for reuse)."""
        self.length = 0
        self.real = self.seen = self.new_positions = None

    def _check_room(self, t: int) -> None:
        if self.length + t > self.capacity:
            raise ValueError(f"KV cache: {t} new positions after {self.length} exceed the "
                             f"model's {self.capacity} (reset it and prefill a shorter window)")

    def extend(self, real) -> None:
        """Declare the next forward's t new slots per row: real (B, t) bool (an xp array),
        False for left padding. Sets their positions (module docstring)."""
        xp = array_module(real)
        b, t = real.shape
        self._check_room(t)
        if self.real is None:
            self.real = xp.zeros((b, self.capacity), dtype=bool)
            self.seen = xp.zeros(b, dtype=xp.int64)
        if self.real.shape[0] != b:
            raise ValueError(f"KV cache: {b} rows after {self.real.shape[0]} (reset it first)")
        self.real[:, self.length:self.length + t] = real
        count = self.seen[:, None] + xp.cumsum(real, axis=1)       # real tokens up to each slot
        self.new_positions = xp.maximum(count - 1, 0)
        self.seen = count[:, -1]

    def positions(self, t: int):
        """The positions of t new tokens: the (B, t) array declared by `extend`, else the
        slice length .. length + t - 1 (ValueError past capacity)."""
        self._check_room(t)
        if self.new_positions is not None:
            if self.new_positions.shape[1] != t:
                raise ValueError(f"KV cache: a forward of {t} tokens after extend() declared "
                                 f"{self.new_positions.shape[1]}")
            return self.new_positions
        return slice(self.length, self.length + t)

    def attend(self, unit, q, k, v, cast=FULL):
        """q (B, Hq, t, Dh), k, v (B, Hkv, t, Dh) of t new slots -> their attention output
        (B, Hq, t, Dh) over the cached keys and these; k, v are stored for the next calls.
        cast: the unit's matmul precision (its `autocast`, nn/autocast.py). k and v are
        stored as `cast.round` gives them to the attention's matmuls (rounding is
        idempotent, so the values are those of rounding at use): under 16-bit compute on a
        device the cache holds 2 bytes an element, and a step's rounding of the cached
        prefix is a 2-byte copy where it was a conversion from float32 (on the CPU's
        emulation the cache is float32 on the grid, rounded again at use)."""
        xp = array_module(k)
        b, hq, t, dh = q.shape
        hkv = k.shape[1]
        if hq % hkv:
            raise ValueError(f"KV cache: {hq} query heads do not divide into {hkv} kv heads")
        self._check_room(t)
        k, v = cast.round(k), cast.round(v)         # as the attention's matmuls take them
        kb, vb = self.buffers.get(unit, (None, None))
        shape = (b, hkv, self.capacity, dh)
        if kb is None or kb.shape != shape or kb.dtype != k.dtype:
            if self.length:
                raise ValueError(f"KV cache: keys of shape {tuple(k.shape)} after "
                                 f"{self.length} cached positions of {kb.shape}")
            kb, vb = xp.zeros(shape, dtype=k.dtype), xp.zeros(shape, dtype=v.dtype)
            self.buffers[unit] = (kb, vb)
        end = self.length + t
        kb[:, :, self.length:end] = k                                # append
        vb[:, :, self.length:end] = v
        g = hq // hkv                    # query heads j*g .. j*g+g-1 read kv head j
        visible = causal_mask(xp, t, end, self.length)              # (t, end) by slot
        if self.real is not None:
            visible = visible[None] & self.real[:, None, :end]       # (B, t, end)
        visible = xp.concatenate([visible] * g, axis=-2)[..., None, :, :]   # (., 1, g t, end)
        out, _ = attention_block(q.reshape(b, hkv, g * t, dh), kb[:, :, :end], vb[:, :, :end],
                                 visible=visible, cast=cast)
        return out.reshape(b, hq, t, dh)

    def last_tokens(self, h):
        """h (B, t, d) -> (B, 1, d): each row's last slot, its newest token (left padding
        puts every row's last real token there): the only logits a decode step uses."""
        return h[:, -1:]

    def advance(self, t: int) -> None:
        """After a forward of t new tokens through every unit: they are cached now."""
        self._check_room(t)
        self.length += int(t)
        self.new_positions = None


def walk_units(units):
    """Every unit of `units` and below, looking inside composites (`units`) and wrappers such
    as Recompute (`inner`)."""
    stack = list(units)
    while stack:
        u = stack.pop()
        yield u
        stack.extend(getattr(u, "units", ()))
        if getattr(u, "inner", None) is not None:
            stack.append(u.inner)


def cache_units(units):
    """(attention units with a `cache` hook, units with `token_positions`, heads with a
    `keep_last` hook) below `units`."""
    every = list(walk_units(units))
    return ([u for u in every if hasattr(u, "cache")],
            [u for u in every if hasattr(u, "token_positions")],
            [u for u in every if hasattr(u, "keep_last")])


@contextmanager
def caching(chunks, cache: KVCache):
    """Within: the units of `chunks` (lists of units) decode against `cache` (attention reads
    and appends it, units with positions take them from it, heads compute the logits of the
    positions `cache.last_tokens` keeps); restored afterwards."""
    attention, embeddings, heads = cache_units([u for chunk in chunks for u in chunk])
    saved = [(u, u.token_positions) for u in embeddings]
    for u in attention:
        u.cache = cache
    for u in embeddings:
        u.token_positions = cache.positions
    for u in heads:
        u.keep_last = cache.last_tokens
    try:
        yield cache
    finally:
        for u in attention:
            u.cache = None
        for u, positions in saved:
            u.token_positions = positions
        for u in heads:
            u.keep_last = None


__all__ = ["KVCache", "cache_units", "caching", "walk_units"]

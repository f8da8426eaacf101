"""Batched generation: `engine.generate(prompts, max_new_tokens, ...)` (no MPI of its own).

Every step runs ONE forward for all prompts and draws one token per prompt:

    cached (the default; every layout parallel.decoder.check_decode allows: not cp, not
    sequence_parallel)
        prefill  the prompts left-padded to the longest, L slots; a padding slot is not real
                 (KVCache.extend), so no real token attends to it, and each row's positions
                 count its real tokens from 0 (transformers' cumsum(attention_mask) - 1)
        step     one token per row at slot L + s, attending to its row's cached real slots
                 (the cache holds the L + max_new_tokens - 1 slots the run fills, at most
                 seq_len: its buffers are sized by the request, not by the model's positions)
        full     when the next slot would pass seq_len, the window is recomputed: the cache is
                 reset and each row's last `refill` tokens (default seq_len) are prefilled
                 again, left-padded (with refill = seq_len every later step sees exactly the
                 last seq_len tokens of its row, as recomputing the cropped context would)
    recomputed (cp, sequence_parallel, or kv_cache=False)
        step     each row's last seq_len tokens right-padded to a common length (rounded up
                 to what cp/sequence_parallel split), the whole batch recomputed, the logits
                 taken at each row's last real token (causal: real tokens never see the
                 padding after them)

Padding is no token for the experts either: each forward runs inside
nn/moe_routing.valid_tokens with its real slots (cached: `real`; recomputed: each row's tokens
up to its last real one), so a Mixtral's left or right padding takes no expert capacity and a
prompt's logits and ids do not depend on the other prompts' lengths. (Under cp and
sequence_parallel, where a recomputed window's tokens are split, capacity_factor is refused,
so there is no capacity for padding to take and no mask is given.)

Rows: under data-parallel axes (dp, fsdp) the rows are split over the data-parallel ranks, as
a training batch is (engine.shard_batch), the row count padded to a multiple of the
data-parallel size with one-token dummy rows; the cache of a rank holds its own rows. A prompt
that ended (its `eos`) stays in the batch, masked: its later tokens are computed and dropped
(the batch shape and every rank's rows stay fixed; the loop stops when all have ended).
`gather_batch` gives every rank the same logits (B, V) and every rank draws from its own
generator seeded with `seed` (nn/sampling.py), so all ranks return the same ids without
communicating them.

Input errors (no prompts, an empty prompt, ids outside the vocabulary, max_new_tokens < 0,
sampling options out of range, eos outside the vocabulary, and when recomputing a window that
cannot be padded to the cp/sequence_parallel multiple within seq_len) raise the same
ValueError on every rank before any communication.
"""
from __future__ import annotations

import math
from numbers import Integral

import numpy as np

from ..nn.functional import array_module
from ..nn.kv_cache import KVCache, caching
from ..nn.moe_routing import valid_tokens
from ..nn.sampling import check_sampling, sample
from ..validate import check_number
from .decoder import check_decode


class Decoder:
    """The loop's collaborators: host rows of ids -> float64 logits (B, V) of each row's last
    token. predict(x), shard(rows) (rows -> this rank's rows on the device), gather(y) (the
    rank's outputs -> every row's, on the host) and chunks (the units a cache hooks into) are
    the engine's predict, shard_batch, gather_batch + to_host and chunks; rows: the row count
    must divide by it (the data-parallel size); length_multiple: T must divide by it when
    recomputing (cp, sequence_parallel)."""

    def __init__(self, predict, shard, gather, chunks, rows=1, length_multiple=1):
        self.predict, self.shard, self.gather, self.chunks = predict, shard, gather, chunks
        self.rows, self.length_multiple = rows, length_multiple

    @classmethod
    def of(cls, engine):
        layout = engine.layout
        cp, tp = layout.size("cp"), layout.size("tp")
        sp = tp if layout.option("sequence_parallel", 0) else 1
        return cls(engine.predict, engine.shard_batch,
                   lambda y: engine.backend.to_host(engine.gather_batch(y)), engine.chunks,
                   engine.data_parallel_size, math.lcm(2 * cp if cp > 1 else 1, sp))

    def cached_step(self, ids, real, cache: KVCache, vocab: int):
        """ids, real (B, t): new slots (left padding not real) -> logits (B, V) at slot t-1."""
        x, mask = self.shard(ids), self.shard(real)
        cache.extend(mask)
        with caching(self.chunks, cache), valid_tokens(self.chunks, mask):
            y = self.predict(x)
        cache.advance(ids.shape[1])
        if y is not None:                                   # the last slot only
            y = array_module(y).ascontiguousarray(y[:, -1:])
        return self.gather(y)[:, -1, :vocab].astype(np.float64)

    def recomputed_step(self, ids, last, vocab: int):
        """ids (B, T) right-padded, last (B,) index of each row's last real token -> (B, V)."""
        real = None if self.length_multiple > 1 else \
            self.shard(np.arange(ids.shape[1]) <= np.asarray(last)[:, None])
        with valid_tokens(self.chunks, real):
            y = self.gather(self.predict(self.shard(ids)))
        return y[np.arange(len(last)), last, :vocab].astype(np.float64)


def check_generate(model, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos):
    """The prompts as lists of ints and the eos ids as a set (ValueError/TypeError, no MPI)."""
    if not model.generates:
        raise TypeError(f"generate needs a language model (a decoder spec), got {model!r}")
    v = model.vocab_size
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("generate: prompts must be a non-empty list of token-id lists")
    rows = []
    for i, p in enumerate(prompts):
        ids = np.asarray(p)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"generate: prompt {i} must be a non-empty list of token ids, got "
                             f"shape {ids.shape}")
        if ids.dtype.kind not in "iu" or ids.min() < 0 or ids.max() >= v:
            raise ValueError(f"generate: prompt {i} must hold integer token ids in [0, {v})")
        rows.append([int(t) for t in ids])
    check_number("max_new_tokens", max_new_tokens, low=0, integer=True)
    check_sampling(temperature, top_k, top_p)
    check_number("seed", seed, low=0, integer=True)
    eos = [] if eos is None else [eos] if isinstance(eos, Integral) else list(eos)
    if any(isinstance(t, bool) or not isinstance(t, Integral) or not 0 <= t < v for t in eos):
        raise ValueError(f"generate: eos {eos} must be token ids in [0, {v})")
    return rows, {int(t) for t in eos}


def generate(engine, prompts, max_new_tokens, temperature=1.0, top_k=0, top_p=1.0, seed=0,
             eos=None, *, kv_cache=True, refill=None, on_token=None) -> list:
    """Collective: the generated ids of each prompt (a list per prompt, the same on every
    rank; a row ends after its first eos id, which is included). kv_cache=False recomputes the
    whole context each step; refill: see the module docstring; on_token(row, id) is called
    for each id as it is drawn. engine.generate is this function."""
    model = engine.model
    rows, eos = check_generate(model, prompts, max_new_tokens, temperature, top_k, top_p,
                               seed, eos)
    seq_len = model.seq_len
    refill = seq_len if refill is None else check_number("refill", refill, low=1,
                                                         integer=True)
    if refill > seq_len:
        raise ValueError(f"refill={refill} must lie in [1, seq_len={seq_len}]")
    cached = kv_cache and decodes_with_cache(engine.layout)
    decoder = Decoder.of(engine)
    if not cached:
        check_windows(rows, max_new_tokens, seq_len, decoder.length_multiple, engine.layout)
    n = len(rows)
    rows += [[0] for _ in range(-n % decoder.rows)]     # dummy rows: a multiple of dp ranks
    step = (_cached_logits(decoder, rows, seq_len, refill, max_new_tokens) if cached else
            _recomputed_logits(decoder, rows, seq_len))
    rng, out, live = np.random.default_rng(seed), [[] for _ in range(n)], list(range(n))
    for _ in range(max_new_tokens):
        if not live:
            break
        ids = sample(step(model.vocab_size)[:n], rng, temperature, top_k, top_p)
        for i in range(len(rows)):
            rows[i].append(int(ids[i]) if i < n else 0)
        for i in list(live):
            out[i].append(int(ids[i]))
            if on_token is not None:
                on_token(i, int(ids[i]))
            if int(ids[i]) in eos:
                live.remove(i)
    return out


def check_windows(rows, max_new_tokens: int, seq_len: int, multiple: int, layout) -> None:
    """ValueError (no MPI) when a recomputed window would have to be padded past seq_len: the
    longest window, min(seq_len, longest prompt + max_new_tokens - 1) tokens, rounded up to
    the multiple that cp / sequence_parallel split, must fit the model's positions."""
    longest = min(seq_len, max(map(len, rows)) + max_new_tokens - 1)
    if max_new_tokens and -(-longest // multiple) * multiple > seq_len:
        raise ValueError(f"generate under {layout.text} recomputes windows of up to {longest} "
                         f"tokens padded to a multiple of {multiple}, past the model's "
                         f"seq_len={seq_len}: use a seq_len that divides by {multiple}, "
                         f"shorter prompts or fewer new tokens")


def _cached_logits(decoder, rows, seq_len: int, refill: int, max_new_tokens: int):
    """step(vocab) -> logits (B, V) of the rows' latest tokens, with a KV cache of the slots
    the run can fill: the first prefill's width + max_new_tokens - 1, at most seq_len (a
    model with 131,072 positions does not get a cache that long for a 50-token answer)."""
    width = max(min(len(r), seq_len) for r in rows)
    cache = KVCache(min(seq_len, width + max(max_new_tokens - 1, 0)))
    window = seq_len                     # the first prefill: each row's last seq_len tokens

    def step(vocab):
        nonlocal window
        if cache.length and cache.length < cache.capacity:     # capacity < seq_len: never full
            ids = np.asarray([[r[-1]] for r in rows], dtype=np.int64)
            return decoder.cached_step(ids, np.ones(ids.shape, dtype=bool), cache, vocab)
        cache.reset()                    # first step, or full: (re)fill the window
        ids, real = left_padded([r[-window:] for r in rows])
        window = refill
        return decoder.cached_step(ids, real, cache, vocab)
    return step


def _recomputed_logits(decoder, rows, seq_len: int):
    """step(vocab) -> logits (B, V) of the rows' latest tokens, recomputing every context."""
    m = decoder.length_multiple

    def step(vocab):
        windows = [r[-seq_len:] for r in rows]
        t = max(len(w) for w in windows)
        t = min(-(-t // m) * m, seq_len)
        ids = np.zeros((len(rows), t), dtype=np.int64)
        for i, w in enumerate(windows):
            ids[i, :len(w)] = w
        return decoder.recomputed_step(ids, np.array([len(w) - 1 for w in windows]), vocab)
    return step


def left_padded(windows):
    """Token lists -> (ids (B, L) with 0 before the shorter rows, real (B, L) bool)."""
    width = max(len(w) for w in windows)
    ids = np.zeros((len(windows), width), dtype=np.int64)
    real = np.zeros(ids.shape, dtype=bool)
    for i, w in enumerate(windows):
        ids[i, width - len(w):] = w
        real[i, width - len(w):] = True
    return ids, real


def decodes_with_cache(layout) -> bool:
    """Whether the units of `layout` decode with a KV cache (decoder.check_decode)."""
    try:
        check_decode(layout)
    except ValueError:
        return False
    return True


__all__ = ["Decoder", "check_generate", "check_windows", "decodes_with_cache", "generate",
           "left_padded"]

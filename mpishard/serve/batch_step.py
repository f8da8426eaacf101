"""One step of the server's batch: the rows' new tokens through the model, against the slots.

    stepper = Stepper(engine, max_batch, max_len)
    logits = stepper.forward(slots, starts, chunks)    # (n, V) float64, the same on every rank

Row i of a step is chunks[i], the next tokens of the request in slot slots[i], starting at
position starts[i]: a prefill is the prompt at start 0, a decode step the last drawn token at
start = the row's length so far, and both kinds share a step. The chunks are right-padded to
the longest (serve/slots.py: padding is neither cached nor used), and the logits after each
chunk's last token come back to every rank of the replica (engine.gather_batch: from the last
pp stage, vocab shards under tp gathered).

Under pp the rows go through the stages as `microbatches` groups of contiguous rows, one
engine.predict per group, called back to back: predict's sends do not wait for the next stage
to compute, so stage 0 runs group 2 while stage 1 runs group 1. Every rank selects the same
group in the cache before each predict, so each stage's units see the rows they are fed.
The groups' outputs stay on the last stage until all ran, then travel once.

Padding is no token for the experts either: each predict runs inside
nn/moe_routing.valid_tokens with its real tokens, as parallel/decode.Decoder does.
dp is not a layout of one replica: serve runs dp as independent replicas (serve/replicas.py).
"""
from __future__ import annotations

import numpy as np

from ..nn.kv_cache import caching
from ..nn.moe_routing import valid_tokens
from ..parallel.decoder import check_decode
from ..validate import check_number
from .slots import SlotCache


class Stepper:
    """The model side of the serving loop on every rank of one replica (collective calls,
    same arguments on every rank, the constructor included: a one-token forward allocates the
    KV pool, so a pool that does not fit fails at start-up, not under load; the engine must
    hold its weights). microbatches: the groups a step's rows go through a pipeline in
    (default: the layout's microbatches, 1 without pp)."""

    def __init__(self, engine, max_batch: int, max_len: int, microbatches=None):
        layout, model = engine.layout, engine.model
        check_decode(layout)                                     # not cp, sequence_parallel
        if engine.data_parallel_size > 1:
            raise ValueError(f"layout {layout.text!r}: a replica has no data-parallel axes; "
                             f"serve runs dp as replicas (serve/replicas.split_replicas)")
        check_number("max_batch", max_batch, low=1, integer=True)
        check_number("max_len", max_len, low=1, integer=True)
        if max_len > model.seq_len:
            raise ValueError(f"max_len={max_len} is past the model's seq_len={model.seq_len}")
        m = engine.microbatches if microbatches is None else microbatches
        self.microbatches = check_number("microbatches", m, low=1, integer=True)
        self.engine, self.vocab = engine, model.vocab_size
        self.cache = SlotCache(max_batch, max_len, engine.xp)
        self.forward([0], [0], [[0]])   # allocates the whole pool now (its junk key at slot 0,
        #                                 position 0 is overwritten by the slot's first row)

    def __repr__(self):
        return f"Stepper({self.cache!r}, microbatches={self.microbatches})"

    def nbytes(self) -> int:
        """Bytes the KV pool holds on this rank, all of it from the start (slots.kv_pool_bytes
        gives them, at most, before any engine is built)."""
        return self.cache.nbytes()

    def check(self, slots, starts, chunks) -> None:
        """ValueError (no MPI) for a step the pool or the vocabulary cannot take."""
        if not (len(slots) == len(starts) == len(chunks)) or not slots:
            raise ValueError(f"Stepper.forward: {len(slots)} slots, {len(starts)} starts, "
                             f"{len(chunks)} chunks (one each per row, at least one row)")
        for s, chunk in zip(slots, chunks):
            if not chunk or not all(0 <= int(t) < self.vocab for t in chunk):
                raise ValueError(f"Stepper.forward: slot {s}: the chunk must hold token ids "
                                 f"in [0, {self.vocab}), got {list(chunk)[:8]}")

    def forward(self, slots, starts, chunks) -> np.ndarray:
        """(n, V) float64 on the host, every rank the same: the logits after each chunk's last
        token, chunk i written to slot slots[i] from position starts[i] (module docstring)."""
        self.check(slots, starts, chunks)
        groups = np.array_split(np.arange(len(slots)), min(self.microbatches, len(slots)))
        ys = [self._predict([slots[i] for i in g], [starts[i] for i in g],
                            [chunks[i] for i in g]) for g in groups]
        engine = self.engine
        y = None if ys[0] is None else engine.xp.concatenate(ys)     # the last stage's
        logits = engine.backend.to_host(engine.gather_batch(y))       # (n, V_padded)
        return np.asarray(logits[:, :self.vocab], dtype=np.float64)

    def _predict(self, slots, starts, chunks):
        """One predict of a group of rows: (n, V) device logits at each row's last real token
        on the last pp stage, None on the others."""
        engine, lengths = self.engine, [len(c) for c in chunks]
        t = max(lengths)
        ids = np.zeros((len(chunks), t), dtype=np.int64)           # right-padded (n, t)
        for i, chunk in enumerate(chunks):
            ids[i, :len(chunk)] = chunk
        real = np.arange(t) < np.asarray(lengths)[:, None]         # (n, t) bool
        self.cache.select(slots, starts, t, lengths)
        with caching(engine.chunks, self.cache), \
                valid_tokens(engine.chunks, engine.shard_batch(real)):
            y = engine.predict(engine.shard_batch(ids))            # (n, 1, V) or None
        if y is None:
            return None
        xp = engine.xp
        if y.shape[1] != 1:              # a head that is no nn.layers.Head computed every t
            y = y[xp.arange(len(chunks)), xp.asarray(np.asarray(lengths) - 1)][:, None]
        return xp.ascontiguousarray(y[:, 0])   # 'n 1 v -> n v': each row's last real token


__all__ = ["Stepper"]

"""The server's KV cache: a pool of `max_batch` slots of `max_len` positions, one row per slot.

    cache = SlotCache(max_batch, max_len, xp)
    cache.select(slots, starts, t, lengths)   # the next forward: row i -> slot slots[i]
    with caching(chunks, cache):              # nn/kv_cache.caching hooks it into the units
        y = forward(ids)                      # ids (n, t): the rows' new tokens, right-padded

Unlike nn/kv_cache.KVCache (one batch that starts and grows together), each row here has its
own start: row i writes its lengths[i] real new tokens at positions starts[i] ..
starts[i] + lengths[i] - 1 of its slot, so a prompt's prefill and other rows' decode steps can
share a forward, and a slot freed by a finished row is reused by the next one (its old keys
are simply overwritten: a query sees only positions <= its own, all written by its row).

Each attention unit keeps, under its own key, buffers k, v of shape (max_batch, Hkv, max_len,
Dh) for the kv heads it computes (its share under tp, its stage's blocks under pp), allocated
on first use; `kv_pool_bytes` gives their size (at most) from the model and layout before
that. A forward
of t tokens per row:

    store    kb[slots[i], :, starts[i] + j] = k[i, :, j]          for each real token j
    keys     K = kb[slots, :, :end]    (n, Hkv, end, Dh),  end = max_i (starts[i] + lengths[i])
    mask     visible[i, j, p] = p <= starts[i] + j                 (causal by position)
    out      softmax(q K^T / sqrt(Dh) + mask) V                    (n, Hq, t, Dh)

k and v are stored as the attention's matmuls take them (`cast.round`, as KVCache): under
16-bit compute on a device, 2 bytes an element.

Right padding (token j >= lengths[i]) is neither stored nor used: its query attends to junk
and its output is dropped by the caller; its position is clipped to max_len - 1 so the
embeddings stay inside their tables. Grouped-query attention as KVCache: the g = Hq / Hkv
query heads of a kv head ride along the query axis, so the buffers are never repeated.
"""
from __future__ import annotations

from collections import Counter

import numpy as np

from ..comm.mesh import parse_layout
from ..nn.attention import attention_block
from ..nn.autocast import FULL
from ..nn.functional import array_module
from ..parallel.stages import assign_stages


class SlotCache:
    """Keys/values of `max_batch` independent rows of up to `max_len` positions (module
    docstring); duck-typed like nn/kv_cache.KVCache for nn/kv_cache.caching."""

    def __init__(self, max_batch: int, max_len: int, xp):
        self.max_batch, self.max_len, self.xp = int(max_batch), int(max_len), xp
        self.buffers: dict = {}          # attention unit -> (k, v), (max_batch, Hkv, L, Dh)
        self.t = 0
        self.slots = self.pos = self.write = None
        self.end = 0

    def __repr__(self):
        return (f"SlotCache({self.max_batch} slots x {self.max_len} positions, "
                f"{len(self.buffers)} layers, {self.nbytes()} bytes)")

    def select(self, slots, starts, t: int, lengths=None) -> None:
        """Declare the next forward: row i holds t new tokens of slot slots[i] at positions
        starts[i] .. starts[i] + t - 1, the first lengths[i] of them real (default all t; the
        rest right padding). ValueError for a slot outside the pool or used twice, or tokens
        past max_len."""
        n, t = len(slots), int(t)
        lengths = [t] * n if lengths is None else [int(x) for x in lengths]
        if len(starts) != n or len(lengths) != n or n == 0 or t < 1:
            raise ValueError(f"SlotCache.select: {n} slots, {len(starts)} starts, "
                             f"{len(lengths)} lengths, t={t}")
        if len(set(slots)) != n or not all(0 <= s < self.max_batch for s in slots):
            raise ValueError(f"SlotCache.select: slots {list(slots)} must be distinct, in "
                             f"[0, {self.max_batch})")
        for s, a, m in zip(slots, starts, lengths):
            if not (a >= 0 and 1 <= m <= t and a + m <= self.max_len):
                raise ValueError(f"SlotCache.select: slot {s}: {m} of {t} tokens from "
                                 f"position {a} do not fit its {self.max_len} positions")
        xp = self.xp
        start = np.asarray(starts, dtype=np.int64)
        pos = np.minimum(start[:, None] + np.arange(t), self.max_len - 1)     # (n, t)
        real = np.arange(t) < np.asarray(lengths)[:, None]                     # (n, t)
        rows, cols = np.nonzero(real)                                          # real tokens
        self.t, self.end = t, int((start + lengths).max())
        self.last = xp.asarray(np.asarray(lengths, dtype=np.int64) - 1)          # (n,)
        self.slots = xp.asarray(np.asarray(slots, dtype=np.int64))
        self.pos = xp.asarray(pos)
        self.write = tuple(xp.asarray(a) for a in
                           (np.asarray(slots)[rows], pos[rows, cols], rows, cols))

    def last_tokens(self, h):
        """h (n, t, d) -> (n, 1, d): each selected row's last real token (its chunk's end,
        before the right padding): the only logits a step uses (nn/layers.Head)."""
        xp = array_module(h)
        return h[xp.arange(h.shape[0]), self.last][:, None]

    def positions(self, t: int):
        """The (n, t) int64 positions of the selected rows' new tokens (the units'
        token_positions while caching)."""
        if t != self.t:
            raise ValueError(f"SlotCache: a forward of {t} tokens after select() declared "
                             f"{self.t}")
        return self.pos

    def _buffers(self, unit, k):
        """The unit's (k, v) buffers, allocated (zeros) on its first call."""
        kb, vb = self.buffers.get(unit, (None, None))
        shape = (self.max_batch, k.shape[1], self.max_len, k.shape[3])
        if kb is None:
            kb = self.xp.zeros(shape, dtype=k.dtype)
            vb = self.xp.zeros(shape, dtype=k.dtype)
            self.buffers[unit] = (kb, vb)
        elif kb.shape != shape or kb.dtype != k.dtype:
            raise ValueError(f"SlotCache: keys {tuple(k.shape)} {k.dtype} for a pool of "
                             f"{kb.shape} {kb.dtype}")
        return kb, vb

    def attend(self, unit, q, k, v, cast=FULL):
        """q (n, Hq, t, Dh), k, v (n, Hkv, t, Dh) of the selected rows' t new tokens -> their
        attention output (n, Hq, t, Dh) over each row's keys up to its own position; the real
        tokens' k, v are stored in the rows' slots for the next forwards. cast: the unit's
        matmul precision (its `autocast`, nn/autocast.py), as kv_cache.KVCache.attend."""
        xp = array_module(q)
        n, hq, t, dh = q.shape
        hkv = k.shape[1]
        if hq % hkv:
            raise ValueError(f"SlotCache: {hq} query heads do not divide into {hkv} kv heads")
        if self.pos is None or (n, t) != tuple(self.pos.shape):
            raise ValueError(f"SlotCache: a forward of {(n, t)} tokens after select() "
                             f"declared {None if self.pos is None else self.pos.shape}")
        k, v = cast.round(k), cast.round(v)     # stored as the matmuls take them (KVCache)
        kb, vb = self._buffers(unit, k)
        slot, pos, row, col = self.write
        kb[slot, :, pos] = k[row, :, col]                # (m, Hkv, Dh): the real tokens
        vb[slot, :, pos] = v[row, :, col]
        keys, values = kb[self.slots, :, :self.end], vb[self.slots, :, :self.end]
        visible = xp.arange(self.end) <= self.pos[:, :, None]            # (n, t, end)
        g = hq // hkv                    # query heads j*g .. j*g+g-1 read kv head j
        visible = xp.concatenate([visible] * g, axis=1)[:, None]         # (n, 1, g t, end)
        out, _ = attention_block(q.reshape(n, hkv, g * t, dh), keys, values, visible=visible,
                                 cast=cast)
        return out.reshape(n, hq, t, dh)

    def nbytes(self) -> int:
        """Bytes the pool's buffers take on this rank (0 before the first forward)."""
        return sum(kb.nbytes + vb.nbytes for kb, vb in self.buffers.values())


def kv_pool_bytes(model, layout, max_batch: int, max_len: int, dtype) -> int:
    """The bytes a SlotCache of max_batch x max_len takes at most on any rank of `layout`,
    before anything is allocated (no MPI), `dtype` the cache's (the engine's, or under 16-bit
    compute on a device the 16-bit one: the pool holds what the matmuls take): k and v for
    each block of the fullest pp stage, of the columns one tp rank caches. Exact when tp
    splits the kv heads (model.kv_width(tp) =
    kv_width(1) / tp) or there is no tp. When tp does not divide them, each rank holds every
    kv head, and caches them as is (kv_width(tp)) or, when its query heads do not read them in
    order, repeated one per local query head (d_model / tp): the larger of the two is given."""
    layout = parse_layout(layout)
    pp, tp = layout.size("pp"), layout.size("tp")
    blocks = max(Counter(k % pp for k in assign_stages(model, layout)).values())
    width = model.kv_width(tp)
    if width * tp != model.kv_width(1):                   # every kv head on every tp rank
        width = max(width, model.d_model // tp)
    return 2 * blocks * int(max_batch) * int(max_len) * width * np.dtype(dtype).itemsize


__all__ = ["SlotCache", "kv_pool_bytes"]

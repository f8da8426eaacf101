"""Packed rows: several documents in one row, attention kept inside each, positions restarted.

A packed batch carries, beside its token ids (B, T), the document id of every token (B, T):
equal ids in one contiguous run are one document, -1 marks padding. Then

    positions  pos[b, i] = i - (the index where token i's run starts)        (B, T)
    attention  query i sees key j  iff  j <= i (causal)  and  doc[b, i] == doc[b, j]
               (block-diagonal causal: the (B, 1, Tq, Tk) mask `visible`)

so a packed row computes exactly what its documents compute alone, each from position 0
(learned positions and rotary alike). Padding is a document of its own: it sees only padding,
and no real token sees it. Rows that each hold one document from their first token, padding
only after it (fine-tune rows padded, not packed), need neither: causal attention already
keeps the padding out of every real token's view and the positions already start at 0, so
the units are told nothing (`rows` None) and run their unmasked paths. The padding still
counts nowhere: `real(mb)` (False at -1) is what a mixture of experts reads to route it to no
expert (models/llama/moe_units.py).

`Documents` is the per-rank context the units read it from. The engine sets the document ids
of a step (`set`, keyed by microbatch: a pipeline's microbatch k gets rows k*b:(k+1)*b) before
it runs the layers, and the units that need them (the position embedding, every attention
path) hold the one `Documents` object of their rank (`attach`, like nn.activations.meter_tapes)
and ask `rows(mb)`: the (B_mb, T) ids of the whole sequence in global order (a context-parallel
rank cuts its own tokens from it), or None when the batch is not packed. `ids(mb)` are the
ids as given (what recompute keeps), `real(mb)` their padding mask. Nothing here
communicates: every rank of a row's tp/pp/cp peers is given the same rows.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from .functional import array_module
from .layers import every_layer

PADDING = -1
"""The document id of padding tokens."""


def check_documents(ids) -> np.ndarray:
    """ids (B, T) as an int64 host array whose equal ids are contiguous runs (ValueError,
    before any communication, naming the row otherwise)."""
    ids = np.asarray(ids)
    if ids.dtype.kind not in "iu":
        raise ValueError(f"documents must be integer ids, got {ids.dtype}")
    ids = ids.astype(np.int64, copy=False)
    for b, row in enumerate(ids):
        starts = np.flatnonzero(np.diff(row)) + 1                 # where a new run begins
        runs = row[np.concatenate([[0], starts])] if row.size else row
        if np.unique(runs).size != runs.size:
            raise ValueError(f"documents: row {b} has a document id in two separate runs; a "
                             f"document's tokens must be contiguous")
    return ids


def positions(ids):
    """(B, T) position of each token within its document (0 at each run's start)."""
    xp = array_module(ids)
    t = ids.shape[-1]
    index = xp.broadcast_to(xp.arange(t), ids.shape)
    new = xp.ones(ids.shape, dtype=bool)
    new[..., 1:] = ids[..., 1:] != ids[..., :-1]                   # a run starts here
    start = xp.where(new, index, 0)
    return index - _running_max(start)


def local_positions(ids, where):
    """(B, t) positions within their documents of the t tokens a rank holds, ids (B, T) being
    the whole sequence's: `where` says which of the T they are (take_positions)."""
    return take_positions(positions(ids), where)


def take_positions(pos, where):
    """pos (B, T) (positions(ids)) at the t tokens `where` names, in the form of a unit's
    `token_positions(t)` (nn/transformer.py): a slice (0 .. t-1 without cp), or a tuple of
    slices taken in order (a cp rank's two chunks). ValueError for per-row positions (a KV
    cache's: decoding never packs documents)."""
    if isinstance(where, slice):
        return pos[:, where]
    if isinstance(where, tuple):
        return array_module(pos).concatenate([pos[:, s] for s in where], axis=1)
    raise ValueError("packed documents take the tokens' places in the whole sequence (slices);"
                     " per-row positions (a KV cache's) decode unpacked rows only")


def rows_of(documents, mb: int):
    """documents.rows(mb), or None where a unit was given no Documents (built outside an
    engine) or the batch is not packed."""
    return None if documents is None else documents.rows(mb)


def ids_of(documents, mb: int):
    """documents.ids(mb) (packed or not), or None where a unit was given no Documents or the
    batch came without ids."""
    return None if documents is None else documents.ids(mb)


def real_of(documents, mb: int):
    """documents.real(mb): (B_mb, T) bool, False at padding; None where a unit was given no
    Documents or the batch has no padding."""
    return None if documents is None else documents.real(mb)


def one_document_rows(ids, pad=None) -> bool:
    """Whether every row of ids (B, T) holds at most one document, from its first token, with
    padding only after it: such rows need no attention mask (module docstring). pad: ids ==
    PADDING where the caller has it."""
    xp = array_module(ids)
    pad = ids == PADDING if pad is None else pad
    return bool(xp.all((ids == ids[:, :1]) | pad)) and bool(xp.all(pad[:, 1:] >= pad[:, :-1]))


def positions_of(documents, mb: int):
    """positions(rows_of(documents, mb)), computed once per microbatch's ids and shared by
    the units that ask (every block's rotary), or None when not packed."""
    return None if documents is None else documents.positions(mb)


def _running_max(a):
    """Running maximum along the last axis (cumulative), on any array module: log2(T)
    doubling steps of element-wise maxima."""
    xp = array_module(a)
    out, shift = a.copy(), 1
    while shift < a.shape[-1]:
        xp.maximum(out[..., shift:], out[..., :-shift].copy(), out=out[..., shift:])
        shift *= 2
    return out


def visible(ids_q, ids_k):
    """(B, 1, Tq, Tk) bool: query i may see key j only within its document (the causal part
    is the attention's own offset mask)."""
    return (ids_q[:, None, :, None] == ids_k[:, None, None, :])


class Documents:
    """The document ids of the current batch on this rank, by microbatch (module docstring)."""

    def __init__(self, sequence_ranks: int = 1):
        self.sequence_ranks = int(sequence_ranks)   # cp: each rank holds T / cp of a row
        self._rows: dict = {}
        self._positions: dict = {}                   # mb -> (the ids, positions(ids))
        self._kinds: dict = {}                       # mb -> (the ids, packed, real)

    def set(self, ids, microbatches: int = 1, mb: int = 0) -> None:
        """ids (B, T) on the device, or None (a batch without ids); split into `microbatches`
        equal row blocks keyed mb .. mb + microbatches - 1."""
        self._rows, self._positions, self._kinds = {}, {}, {}
        if ids is None:
            return
        b = ids.shape[0] // microbatches
        for k in range(microbatches):
            self._rows[mb + k] = ids[k * b:(k + 1) * b]

    @property
    def packed(self) -> bool:
        """Whether any microbatch holds document ids (packed rows, or rows of one document
        and padding)."""
        return bool(self._rows)

    def ids(self, mb: int):
        """Microbatch mb's (B_mb, T) document ids as given, or None."""
        return self._rows.get(mb)

    def _kind(self, mb: int):
        """(ids, packed, real) of microbatch mb, worked out once for those very ids: packed
        unless one_document_rows; real the (B_mb, T) mask of non-padding, None without
        padding. None when mb has no ids."""
        ids = self._rows.get(mb)
        if ids is None:
            return None
        kind = self._kinds.get(mb)
        if kind is None or kind[0] is not ids:
            pad = ids == PADDING
            real = ~pad if bool(pad.any()) else None
            kind = self._kinds[mb] = (ids, not one_document_rows(ids, pad), real)
        return kind

    def rows(self, mb: int):
        """Microbatch mb's (B_mb, T) document ids where attention and positions need them, or
        None when the batch is not packed (no ids, or one document per row: module
        docstring)."""
        kind = self._kind(mb)
        return kind[0] if kind is not None and kind[1] else None

    def real(self, mb: int):
        """Microbatch mb's (B_mb, T) bool mask, False at padding (id -1), or None when it has
        no padding (or no ids)."""
        kind = self._kind(mb)
        return None if kind is None else kind[2]

    def positions(self, mb: int):
        """positions(rows(mb)), cached for those very ids (None when not packed)."""
        ids = self.rows(mb)
        if ids is None:
            return None
        cached = self._positions.get(mb)
        if cached is None or cached[0] is not ids:
            cached = self._positions[mb] = (ids, positions(ids))
        return cached[1]

    @contextmanager
    def holding(self, mb: int, ids):
        """Within: ids(mb) is `ids` (the ids a unit saved at its first forward, ids_of; a
        recomputed forward sees them even after the engine moved on to other rows); restored
        after."""
        saved = self._rows.pop(mb, None)
        if ids is not None:
            self._rows[mb] = ids
        try:
            yield self
        finally:
            self._rows.pop(mb, None)
            if saved is not None:
                self._rows[mb] = saved


def attach(chunks, documents: Documents) -> None:
    """Give `documents` to every layer in `chunks` (lists of layers), or inside them (a
    composite's units, a wrapper's inner unit), that reads document ids: those whose class
    declares a `documents` attribute."""
    for layer in every_layer(chunks):
        if hasattr(type(layer), "documents"):
            layer.documents = documents


__all__ = ["Documents", "PADDING", "attach", "check_documents", "ids_of", "local_positions",
           "one_document_rows", "positions", "positions_of", "real_of", "rows_of",
           "take_positions", "visible"]

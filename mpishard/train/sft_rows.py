"""Fine-tune rows: examples laid into rows of seq_len + 1 tokens, padded or packed, with labels.

    rows = ExampleRows(examples, seq_len=512, pack=True)   # examples: ExampleTokens
    x, t, d = rows.rows([3, 7])          # (2, 512) ids, labels (-100: not counted), documents

An example (examples.ExampleTokens: ids, a loss mask, starts) is a record's tokens. A row
holds seq_len + 1 tokens r[0..T] (T = seq_len) and, per token, the id of the example it
belongs to within the row (0, 1, ...; -1 on padding). The model reads x = r[0:T] and is
scored on the labels

    t[i] = r[i+1]   if token i+1 is of the same example as token i, and the mask of token
                    i+1 is 1 (loss_on "completion") or it is a real token (loss_on "all")
    t[i] = -100     else (nn.losses.CrossEntropy's ignore_index: counted nowhere)

so an example's last token, whose next token is another example's or padding, is never
scored, nor is padding, nor (by default) a prompt's token.

Without packing each row holds one example (cut to seq_len + 1 tokens), padded with id 0 at
the end; the padding comes after every real token, so causal attention leaves the real tokens
as they are and attention needs no mask. The engine is given the document ids all the same
(0, then -1 on padding): rows of one document need no mask (nn/documents.py), and a Mixtral
(models/llama/moe_units.py) routes the padding to no expert. With packing (`pack=True`)
whole examples share a row: first-fit decreasing by length (each example, longest first and
in index order among equals, goes into the first row with room for it; an example longer than
a row is cut to seq_len + 1 tokens; no example is split over two rows). The plan depends on
the lengths only (`starts`), so every rank computes the same rows without communicating, and
the engine is given the document ids of x (nn/documents.py: attention inside each example,
positions restarting at each), which makes a packed row compute what its examples compute
alone.

Rows are made on demand: `rows(idx)` reads the tokens and masks of those rows' examples only
(one integer-array read each, as text.Windows reads a token file), so a memory-mapped set is
never read whole. `RowView` stands in for the (N, T) arrays a Dataset holds (x, t or the
document ids), so the DistributedBatcher takes a rank's rows of each batch as it takes
windows; the three views share the last rows built. Known up front, for the log: the share of
real (non-padding) tokens among the inputs, and the number of counted targets (`counted`,
which reads the mask once, a chunk at a time).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .text import TextDataset

IGNORE_INDEX = -100                      # nn.losses.CrossEntropy's default
PAD_ID = 0                               # the id padding tokens hold (never scored)
PADDING = -1                             # the document id of padding (nn.documents.PADDING)
LOSS_ON = ("completion", "all")
READ_CHUNK = 1 << 22                     # mask values read at a time by `counted`


def first_fit_decreasing(lengths, capacity: int) -> tuple:
    """(order, row_starts): rows of at most `capacity` tokens filled with examples of
    `lengths` (each at most capacity) by first-fit decreasing; row r holds examples
    order[row_starts[r]:row_starts[r+1]] in the order they were placed (longest first).
    A max segment tree over the rows' free room finds each example's first fitting row in
    O(log n)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    n = len(lengths)
    if n and (lengths.min() < 1 or lengths.max() > capacity):
        raise ValueError(f"example lengths must lie in [1, {capacity}]")
    size = 1
    while size < max(n, 1):
        size *= 2
    free = [capacity] * (2 * size)         # leaves: rows, all empty; inner nodes: max
    placed = np.empty(n, dtype=np.int64)
    used, decreasing = 0, np.argsort(-lengths, kind="stable")
    for e in decreasing.tolist():
        need, node = int(lengths[e]), 1
        while node < size:                 # the leftmost leaf with room
            node = 2 * node if free[2 * node] >= need else 2 * node + 1
        row = node - size
        placed[e], used = row, max(used, row + 1)
        free[node] -= need
        node //= 2
        while node:                        # up while the maximum changes
            top = max(free[2 * node], free[2 * node + 1])
            if free[node] == top:
                break
            free[node], node = top, node // 2
    order = decreasing[np.argsort(placed[decreasing], kind="stable")]   # by row, as placed
    row_starts = np.zeros(used + 1, dtype=np.int64)
    np.cumsum(np.bincount(placed, minlength=used), out=row_starts[1:])
    return order, row_starts


class ExampleRows:
    """The rows of `examples` (module docstring): `len` rows of seq_len inputs, made on
    demand by `rows(idx)`. Empty examples are left out."""

    def __init__(self, examples, seq_len: int, pack: bool = False, loss_on: str = "completion"):
        if loss_on not in LOSS_ON:
            raise ValueError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
        self.examples, self.seq_len = examples, int(seq_len)
        self.pack, self.loss_on = bool(pack), loss_on
        starts = np.asarray(examples.starts, dtype=np.int64)
        self.starts = starts
        self.lengths = np.minimum(np.diff(starts), self.seq_len + 1)   # cut to one row
        kept = np.flatnonzero(self.lengths > 0)
        if pack:
            order, row_starts = first_fit_decreasing(self.lengths[kept], self.seq_len + 1)
            self.order, self.row_starts = kept[order], row_starts
        else:
            self.order, self.row_starts = kept, np.arange(len(kept) + 1, dtype=np.int64)
        self._last, self._counted = None, None

    def __len__(self) -> int:
        return len(self.row_starts) - 1

    @property
    def truncated(self) -> int:
        """How many examples are longer than a row (seq_len + 1 tokens) and were cut to it:
        their tokens past the cut count nowhere."""
        return int((np.diff(self.starts) > self.seq_len + 1).sum())

    @property
    def real_share(self) -> float:
        """Share of the rows' input positions that hold a real token (not padding)."""
        if not len(self):
            return 0.0
        used = np.add.reduceat(self.lengths[self.order], self.row_starts[:-1])
        return float(np.minimum(used, self.seq_len).sum()) / (len(self) * self.seq_len)

    @property
    def counted(self) -> int:
        """The labels of all rows that count (not -100): every example's tokens after its
        first, within its row, whose mask is 1 (all of them for loss_on 'all')."""
        if self._counted is None:
            n = self.lengths[self.order]
            if self.loss_on == "all":
                self._counted = int(np.maximum(n - 1, 0).sum())
            else:
                self._counted = _masked_count(self.examples.mask, self.starts[self.order], n)
        return self._counted

    def rows(self, idx) -> tuple:
        """(x, t, documents) of rows `idx` (a 1-D integer array): int64 (B, T) inputs,
        labels and document ids (-1 on padding, packed or not); the last rows asked for
        are kept, so the three RowViews of one batch build them once."""
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        key = idx.tobytes()
        if self._last is None or self._last[0] != key:
            self._last = (key, self._build(idx))
        return self._last[1]

    def _build(self, idx) -> tuple:
        n_rows, width = len(idx), self.seq_len + 1
        if idx.size and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"row index out of range for {len(self)} rows")
        first, last = self.row_starts[idx], self.row_starts[idx + 1]
        per_row = last - first
        which = _ranges(first, per_row)                      # positions in self.order
        ex = self.order[which]
        row = np.repeat(np.arange(n_rows), per_row)
        doc = which - np.repeat(first, per_row)              # the example's id within its row
        n = self.lengths[ex]
        offset = _exclusive_cumsum(n)                        # each example's first column
        if ex.size:                                          # (every row holds an example)
            offset -= np.repeat(offset[_exclusive_cumsum(per_row)], per_row)
        token = _ranges(self.starts[ex], n)                  # its tokens in the file
        col = _ranges(offset, n)
        r = np.repeat(row, n)
        tokens = np.full((n_rows, width), PAD_ID, dtype=np.int64)
        docs = np.full((n_rows, width), PADDING, dtype=np.int64)
        counts = np.zeros((n_rows, width), dtype=bool)
        tokens[r, col] = self.examples.ids[token]
        docs[r, col] = np.repeat(doc, n)
        counts[r, col] = True if self.loss_on == "all" else \
            np.asarray(self.examples.mask[token]) != 0
        same = (docs[:, 1:] == docs[:, :-1]) & (docs[:, 1:] != PADDING)
        t = np.where(same & counts[:, 1:], tokens[:, 1:], IGNORE_INDEX)
        return tokens[:, :-1], t, docs[:, :-1]


def _exclusive_cumsum(a) -> np.ndarray:
    out = np.zeros(len(a), dtype=np.int64)
    np.cumsum(a[:-1], out=out[1:])
    return out


def _ranges(begin, count) -> np.ndarray:
    """The concatenation of arange(begin[i], begin[i] + count[i]) over i."""
    begin, count = np.asarray(begin, np.int64), np.asarray(count, np.int64)
    total = int(count.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(begin - _exclusive_cumsum(count), count) + np.arange(total)


def _masked_count(mask, begins, lengths) -> int:
    """Sum over examples of mask[begin + 1 : begin + length] (a token after each example's
    first that counts), reading the mask READ_CHUNK values at a time in file order."""
    order = np.argsort(begins, kind="stable")
    begins, lengths = begins[order], lengths[order]
    total, i = 0, 0
    while i < len(begins):
        j = max(i + 1, int(np.searchsorted(begins, begins[i] + READ_CHUNK, side="left")))
        lo, hi = int(begins[i]), int((begins[i:j] + lengths[i:j]).max())
        values = np.asarray(mask[np.arange(lo, hi)], dtype=np.int64)
        sums = np.zeros(hi - lo + 1, dtype=np.int64)
        np.cumsum(values, out=sums[1:])
        b, n = begins[i:j] - lo, lengths[i:j]
        total += int(np.where(n > 1, sums[b + n] - sums[np.minimum(b + 1, b + n)], 0).sum())
        i = j
    return total


class RowView:
    """One of a ExampleRows' arrays as a (N, T) stand-in: 'x', 't' or 'documents'; indexed
    with row indices (or a slice), as text.Windows is."""

    FIELDS = ("x", "t", "documents")

    def __init__(self, rows: ExampleRows, field: str):
        self.source, self.field = rows, field
        self.dtype = np.dtype(np.int64)

    @property
    def seq_len(self) -> int:
        return self.source.seq_len

    @property
    def shape(self) -> tuple:
        return (len(self.source), self.source.seq_len)

    @property
    def ndim(self) -> int:
        return 2

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, rows):
        if isinstance(rows, slice):
            rows = np.arange(*rows.indices(len(self)))
        rows = np.asarray(rows)
        flat = np.where(rows < 0, rows + len(self), rows).reshape(-1)
        out = self.source.rows(flat)[self.FIELDS.index(self.field)]
        return out.reshape(rows.shape + (self.seq_len,))

    def __array__(self, dtype=None, copy=None):
        out = self[:]
        return out if dtype is None else out.astype(dtype)

    def __repr__(self) -> str:
        return f"RowView({self.field}, {len(self)} x {self.seq_len})"


@dataclass(repr=False)
class ExampleDataset(TextDataset):
    """A TextDataset of fine-tune rows (ExampleRows): labels with ignored targets, document
    ids (d_train, d_test: packed, or one example and padding per row), and what the log says
    of them (rows_text)."""

    pack: bool = False

    @property
    def masked(self) -> bool:
        return True

    def rows_hint(self) -> str:
        """What the training rows are and what gives more of them (for a --batch that is
        larger than their number)."""
        if self.pack:
            return (f"packed rows of seq_len + 1 = {self.seq_len + 1} tokens, each holding "
                    f"whole examples: a smaller --batch, a lower --seq-len or more data gives "
                    f"more rows")
        return "padded rows, one example each: a smaller --batch or more data gives more rows"

    def rows_text(self, batch: int) -> str:
        """One line: the rows, their share of real tokens and the counted targets."""
        rows = self.x_train.source
        per_step = rows.counted * batch / max(len(rows), 1)
        return (f"{len(rows)} {'packed' if self.pack else 'padded'} training rows of "
                f"{rows.seq_len} tokens from {len(rows.order)} examples: "
                f"{100 * rows.real_share:.1f}% real tokens, {rows.counted} counted targets "
                f"(loss on {rows.loss_on}), about {per_step:.0f} per step of {batch} rows")


def example_dataset(name: str, splits: dict, seq_len: int, vocab_size: int, info: dict,
                    pack: bool = False, loss_on: str = "completion") -> ExampleDataset:
    """The ExampleDataset of {"train", "val"} ExampleTokens cut into rows of seq_len (module
    docstring); ValueError when a split has no row or nothing to count."""
    views = {}
    for split, examples in splits.items():
        rows = ExampleRows(examples, seq_len, pack, loss_on)
        if not len(rows) or not rows.counted:
            raise ValueError(f"the {split} split has {len(rows)} row(s) and no target that "
                             f"counts (loss on {loss_on}): nothing to "
                             f"{'train on' if split == 'train' else 'evaluate'}"
                             + _cut_hint(rows))
        views[split] = [RowView(rows, f) for f in RowView.FIELDS]
        info = dict(info, **{f"{split}_rows": len(rows), f"{split}_counted": rows.counted,
                             f"{split}_real_share": rows.real_share,
                             f"{split}_truncated": rows.truncated})
    (x0, t0, d0), (x1, t1, d1) = views["train"], views["val"]
    return ExampleDataset(name, x0, t0, x1, t1, "language", vocab_size, corpus=info,
                          d_train=d0, d_test=d1, pack=pack)


def _cut_hint(rows: ExampleRows) -> str:
    """'; ...raise --seq-len' when the examples count targets that all lie past the cut at
    seq_len + 1 tokens (else '')."""
    if not rows.truncated:
        return ""
    longest = int(np.diff(rows.starts).max())
    if not ExampleRows(rows.examples, longest - 1, False, rows.loss_on).counted:
        return ""                                    # uncut, they count nothing either
    return (f"; {rows.truncated} example(s) are longer than seq_len + 1 = {rows.seq_len + 1} "
            f"tokens and every counted target lies past that cut: raise --seq-len (the "
            f"longest example has {longest} tokens)")


__all__ = ["ExampleDataset", "ExampleRows", "IGNORE_INDEX", "LOSS_ON", "RowView",
           "example_dataset", "first_fit_decreasing"]

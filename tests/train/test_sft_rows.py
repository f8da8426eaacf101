"""Fine-tune rows (train/sft_rows.py) against a plain per-example reference: padded and packed
rows, labels, the first-fit-decreasing plan, the counts for the log, and reads of only the rows
asked for."""
import numpy as np
import pytest

from mpishard.train.data import DistributedBatcher
from mpishard.train.examples import ExampleTokens
from mpishard.train.sft_rows import (IGNORE_INDEX, ExampleRows, RowView, example_dataset,
                                     first_fit_decreasing)

SEQ = 8


def examples(lengths, seed=0, vocab=50):
    """ExampleTokens of the given lengths: random ids and a random 0/1 mask."""
    rng = np.random.default_rng(seed)
    starts = np.zeros(len(lengths) + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    ids = rng.integers(1, vocab, starts[-1]).astype(np.uint16)
    mask = rng.integers(0, 2, starts[-1]).astype(np.uint8)
    return ExampleTokens(ids, mask, starts)


def naive_ffd(lengths, capacity):
    """First-fit decreasing with a linear scan: rows as lists of example indices."""
    rows, free = [], []
    for e in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        for r, room in enumerate(free):
            if room >= lengths[e]:
                rows[r].append(e)
                free[r] -= lengths[e]
                break
        else:
            rows.append([e])
            free.append(capacity - lengths[e])
    return rows


def reference_row(ex, members, loss_on="completion"):
    """x, t, documents of one row holding examples `members` in order, token by token."""
    tokens, docs, counts = [], [], []
    for d, e in enumerate(members):
        ids, mask = ex.example(e)
        ids, mask = ids[:SEQ + 1], mask[:SEQ + 1]
        tokens += [int(i) for i in ids]
        docs += [d] * len(ids)
        counts += [bool(m) or loss_on == "all" for m in mask]
    pad = SEQ + 1 - len(tokens)
    tokens, docs, counts = tokens + [0] * pad, docs + [-1] * pad, counts + [False] * pad
    t = [tokens[i + 1] if docs[i + 1] == docs[i] != -1 and counts[i + 1] else IGNORE_INDEX
         for i in range(SEQ)]
    return np.array(tokens[:SEQ]), np.array(t), np.array(docs[:SEQ])


LENGTHS = [3, 12, 1, 0, 7, 2, 9, 4, 5, 1, 6, 2]       # one empty, two longer than a row


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_padded_rows_are_one_example_each(loss_on):
    ex = examples(LENGTHS)
    rows = ExampleRows(ex, SEQ, pack=False, loss_on=loss_on)
    kept = [e for e, n in enumerate(LENGTHS) if n]
    assert len(rows) == len(kept)
    x, t, d = rows.rows(np.arange(len(rows)))
    for r, e in enumerate(kept):
        want_x, want_t, want_d = reference_row(ex, [e], loss_on)
        np.testing.assert_array_equal(x[r], want_x)
        np.testing.assert_array_equal(t[r], want_t)
        np.testing.assert_array_equal(d[r], want_d)         # 0, then -1 on padding
    assert rows.counted == int((t != IGNORE_INDEX).sum())
    real = sum(min(LENGTHS[e], SEQ) for e in kept)
    assert rows.real_share == pytest.approx(real / (len(kept) * SEQ), rel=1e-12)


def test_plan_is_first_fit_decreasing():
    rng = np.random.default_rng(1)
    lengths = rng.integers(1, 10, 300)
    order, row_starts = first_fit_decreasing(lengths, 10)
    got = [order[a:b].tolist() for a, b in zip(row_starts[:-1], row_starts[1:])]
    assert got == naive_ffd(lengths.tolist(), 10)
    assert sorted(order.tolist()) == list(range(300))            # each example once
    assert all(lengths[r].sum() <= 10 for r in got)
    again = first_fit_decreasing(lengths, 10)
    assert all(np.array_equal(a, b) for a, b in zip((order, row_starts), again))


@pytest.mark.parametrize("loss_on", ["completion", "all"])
def test_packed_rows_hold_whole_examples(loss_on):
    ex = examples(LENGTHS, seed=2)
    rows = ExampleRows(ex, SEQ, pack=True, loss_on=loss_on)
    cut = [min(n, SEQ + 1) for n in LENGTHS]
    kept = [e for e, n in enumerate(cut) if n]
    plan = naive_ffd([cut[e] for e in kept], SEQ + 1)
    assert len(rows) == len(plan) < len(kept)
    x, t, d = rows.rows(np.arange(len(rows)))
    for r, members in enumerate(plan):
        want = reference_row(ex, [kept[m] for m in members], loss_on)
        for got, w in zip((x[r], t[r], d[r]), want):
            np.testing.assert_array_equal(got, w)
    # an example's last token is never scored: no label crosses a document boundary
    assert not ((d[:, :-1] != d[:, 1:]) & (t[:, :-1] != IGNORE_INDEX)).any()
    assert (t[d == -1] == IGNORE_INDEX).all()
    assert rows.counted == int((t != IGNORE_INDEX).sum())
    assert rows.real_share == pytest.approx((d != -1).mean(), rel=1e-12)


class CountingReads:
    """An ids or mask array that records the positions read."""

    def __init__(self, values):
        self.values, self.read = values, set()

    def __getitem__(self, idx):
        self.read.update(np.asarray(idx).reshape(-1).tolist())
        return self.values[idx]

    def __len__(self):
        return len(self.values)


@pytest.mark.parametrize("pack", [False, True])
def test_rows_read_only_their_examples(pack):
    ex = examples(LENGTHS, seed=3)
    ids, mask = CountingReads(ex.ids), CountingReads(ex.mask)
    rows = ExampleRows(ExampleTokens(ids, mask, ex.starts), SEQ, pack=pack)
    assert not ids.read and not mask.read                  # the plan reads starts only
    pick = np.array([1, 0])
    x, t, d = rows.rows(pick)
    members = np.concatenate([rows.order[rows.row_starts[r]:rows.row_starts[r + 1]]
                              for r in pick])
    wanted = {p for e in members for p in range(ex.starts[e],
                                                 ex.starts[e] + min(LENGTHS[e], SEQ + 1))}
    assert ids.read == wanted and mask.read == wanted
    ids.read.clear()
    views = [RowView(rows, f) for f in RowView.FIELDS]
    got = [v[pick] for v in views[:2 + pack]]               # one build for the three views
    assert not ids.read
    np.testing.assert_array_equal(got[0], x)
    np.testing.assert_array_equal(got[1], t)
    np.testing.assert_array_equal(views[0][-1], rows.rows([len(rows) - 1])[0][0])
    np.testing.assert_array_equal(views[0][:2], views[0][np.arange(2)])
    assert views[0].shape == (len(rows), SEQ) and np.asarray(views[1]).shape == views[1].shape


def test_dataset_and_batcher_carry_documents():
    train, val = examples([3, 5, 2, 6, 1, 4, 7, 2] * 4, seed=4), examples([4, 6, 3], seed=5)
    data = example_dataset("t", {"train": train, "val": val}, SEQ, 50, {}, pack=True)
    assert data.masked and data.d_train is not None and data.seq_len == SEQ
    assert "% real tokens" in data.rows_text(4)
    b = DistributedBatcher(data.x_train, data.t_train, 4, dp_size=2, dp_rank=1, seed=0,
                           accumulate=2, documents=data.d_train)
    for micro, ((x, t), d) in enumerate(zip(b.micro_batches(1), b.micro_documents(1))):
        idx = b.local_indices(*b.position(1), micro)
        for got, want in ((x, data.x_train), (t, data.t_train), (d, data.d_train)):
            np.testing.assert_array_equal(got, want[idx])
    assert DistributedBatcher(data.x_train, data.t_train, 4).micro_documents(0) == [None]
    padded = example_dataset("t", {"train": train, "val": val}, SEQ, 50, {}, pack=False)
    assert len(padded.d_train) == len(padded.x_train)      # padding marked for the experts
    assert len(padded.d_test) == len(padded.x_test)


def test_nothing_to_count_is_refused():
    ex = examples([3, 4], seed=6)
    none = ExampleTokens(ex.ids, np.zeros_like(ex.mask), ex.starts)
    with pytest.raises(ValueError, match="val split .* no target that counts"):
        example_dataset("t", {"train": ex, "val": none}, SEQ, 50, {})
    with pytest.raises(ValueError, match="loss_on"):
        ExampleRows(ex, SEQ, loss_on="prompt")

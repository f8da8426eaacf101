"""Packed rows in the GPT's units (nn/transformer.py, nn/recompute.py), serial.

The embedding's positions restart at 0 at each document (and a cp rank's two chunks take
theirs from the whole row), the attention core of a packed row equals each document's alone,
forward and backward; a recomputed unit sees the documents of its first forward; decoding
after a packed step is the unpacked decoding (the KV cache never reads documents).
The engine-level exactness on every layout is tests/parallel/test_packing.py's.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import mpishard as ms
from mpishard.nn import attention as att
from mpishard.nn import documents as docs
from mpishard.nn.layers import LocalAccess
from mpishard.nn.recompute import Recompute
from mpishard.nn.transformer import CausalSelfAttention, Embedding
from mpishard.parallel.context_parallel import TokenPositions

IDS = np.array([[0, 0, 0, 1, 1, 2, 2, 2],
                [0, 0, 0, 0, 0, 0, -1, -1]])
WANT = np.array([[0, 1, 2, 0, 1, 0, 1, 2],
                 [0, 1, 2, 3, 4, 5, 0, 1]])


def attached(unit, ids, mb=0):
    """unit with a Documents holding `ids` for microbatch mb."""
    unit.documents = docs.Documents()
    unit.documents.set(ids, 1, mb)
    return unit


def embedding(rng, vocab=11, n_pos=8, d=4, **kw):
    store = SimpleNamespace(params={"embed/tokens": rng.standard_normal((vocab, d)),
                                    "embed/positions": rng.standard_normal((n_pos, d))},
                            grads={"embed/tokens": np.zeros((vocab, d)),
                                   "embed/positions": np.zeros((n_pos, d))})
    return Embedding(LocalAccess(store), **kw), store


def test_positions_restart_at_each_document():
    np.testing.assert_array_equal(docs.positions(IDS), WANT)
    np.testing.assert_array_equal(docs.local_positions(IDS, slice(2, 6)), WANT[:, 2:6])


def test_embedding_adds_positions_within_documents(rng):
    unit, store = embedding(rng)
    tokens = rng.integers(0, 11, IDS.shape)
    h = attached(unit, IDS, mb=3).forward(tokens, mb=3)
    table, pos = store.params["embed/tokens"], store.params["embed/positions"]
    np.testing.assert_array_equal(h, table[tokens] + pos[WANT])
    dy = rng.standard_normal(h.shape)
    unit.documents.set(None)                 # the backward needs nothing but its tape
    assert unit.backward(dy, mb=3) is None
    dpos = np.zeros_like(pos)
    np.add.at(dpos, WANT, dy)
    np.testing.assert_allclose(store.grads["embed/positions"], dpos, rtol=1e-14)


def test_unpacked_microbatch_keeps_leading_positions(rng):
    unit, store = embedding(rng)
    tokens = rng.integers(0, 11, IDS.shape)
    h = attached(unit, IDS, mb=0).forward(tokens, mb=1)          # mb 1 is not packed
    np.testing.assert_array_equal(h, store.params["embed/tokens"][tokens]
                                  + store.params["embed/positions"][:8])


def test_cp_rank_positions_come_from_the_whole_row(rng):
    """cp=2, rank 1 holds chunks 1 and 2 of 4: tokens 2, 3 and 4, 5 of the row."""
    unit, store = embedding(rng, token_positions=TokenPositions(2, 1, 8))
    tokens = rng.integers(0, 11, (2, 4))
    h = attached(unit, IDS).forward(tokens)
    np.testing.assert_array_equal(h, store.params["embed/tokens"][tokens]
                                  + store.params["embed/positions"][WANT[:, 2:6]])


def test_packed_documents_refuse_per_row_positions(rng):
    """A KV cache's per-row positions with packed documents: refused (decoding never packs)."""
    unit, _ = embedding(rng, token_positions=lambda t: np.zeros((2, t), np.int64))
    with pytest.raises(ValueError, match="decode unpacked rows only"):
        attached(unit, IDS).forward(np.zeros((2, 8), np.int64))


def qkv(rng, b=2, t=8, heads=2, dh=3):
    return rng.standard_normal((b, t, 3 * heads * dh))


def test_attention_of_a_packed_row_is_each_document_alone(rng):
    """Row 0's documents [0:3], [3:5], [5:8] and row 1's [0:6] (padding [6:8]) run alone:
    the same outputs and the same gradient of q | k | v."""
    a, heads = qkv(rng), 2
    unit = attached(CausalSelfAttention(heads), IDS)
    y = unit.forward(a)
    dy = rng.standard_normal(y.shape)
    da = unit.backward(dy)
    for row, spans in ((0, [(0, 3), (3, 5), (5, 8)]), (1, [(0, 6), (6, 8)])):
        for lo, hi in spans:
            alone = CausalSelfAttention(heads)
            piece = a[row:row + 1, lo:hi]
            np.testing.assert_allclose(y[row, lo:hi], alone.forward(piece)[0], rtol=1e-12)
            np.testing.assert_allclose(da[row, lo:hi], alone.backward(dy[row:row + 1, lo:hi])[0],
                                       rtol=1e-12, atol=1e-15)


def test_attention_mask_matches_the_block_primitive(rng):
    """The unit's packed output is attention_block's with offset 0 and documents.visible."""
    a, heads = qkv(rng), 2
    y = attached(CausalSelfAttention(heads), IDS).forward(a, record=False)
    q, k, v = att.split_heads(a, heads)
    out, _ = att.attention_block(q, k, v, offset=0, visible=docs.visible(IDS, IDS))
    np.testing.assert_array_equal(y, att.merge_heads(out))


def test_recompute_sees_the_documents_of_its_first_forward(rng):
    """The engine moves on (another microbatch's documents, or none) before the backward:
    the recomputed forward still runs in the documents it first saw."""
    a, heads = qkv(rng), 2
    plain = attached(CausalSelfAttention(heads), IDS)
    plain.forward(a)
    dy = rng.standard_normal((2, 8, heads * 3))
    want = plain.backward(dy)
    wrapped = Recompute(CausalSelfAttention(heads))
    wrapped.documents = wrapped.inner.documents = docs.Documents()
    wrapped.documents.set(IDS)
    wrapped.forward(a)
    wrapped.documents.set(None)                            # e.g. another forward, unpacked
    np.testing.assert_array_equal(wrapped.backward(dy), want)
    assert not wrapped.documents.packed                    # restored after the backward


def test_generation_after_a_packed_step_is_unpacked():
    """A packed train_step, then greedy decoding with the KV cache: the same ids as an engine
    that never saw documents."""
    model = ms.GPT(vocab_size=17, seq_len=12, d_model=16, n_heads=4, n_layers=2, d_ff=32)
    params = model.init(0)
    fresh = ms.SingleDevice(model)
    fresh.load_checkpoint(params)
    want = fresh.generate([[1, 2, 3], [4, 5]], 4, temperature=0)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    x = np.arange(24).reshape(2, 12) % 17
    engine.train_step(x, x, "cross_entropy", documents=np.repeat([[0] * 6 + [1] * 6], 2, 0))
    assert engine.generate([[1, 2, 3], [4, 5]], 4, temperature=0) == want

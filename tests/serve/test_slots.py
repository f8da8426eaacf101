"""serve/slots.SlotCache: rows at their own positions in their own slots attend as the whole
sequence of each row does (causal attention recomputed from scratch, GQA included), right
padding is never stored, a reused slot's old keys are overwritten, bad selections are refused;
kv_pool_bytes is the pool's size before anything is allocated, on one rank and per tp/pp rank.

`pytest tests/serve/test_slots.py`
"""
import numpy as np
import pytest
from conftest import assert_close

import mpishard as ms
from mpishard.nn.attention import causal_attention_forward
from mpishard.serve.slots import SlotCache, kv_pool_bytes

HQ, HKV, DH, MAX_LEN = 4, 2, 3, 12


def whole(seq_q, seq_k, seq_v):
    """Causal GQA attention of whole sequences (1, H, T, Dh): the reference, kv repeated."""
    g = seq_q.shape[1] // seq_k.shape[1]
    out, _ = causal_attention_forward(seq_q, np.repeat(seq_k, g, axis=1),
                                      np.repeat(seq_v, g, axis=1))
    return out


def steps_of(rng, lengths):
    """Random q, k, v of one row's whole sequence, (1, H, T, Dh) each."""
    t = sum(lengths)
    return (rng.standard_normal((1, HQ, t, DH)), rng.standard_normal((1, HKV, t, DH)),
            rng.standard_normal((1, HKV, t, DH)))


def test_rows_at_their_own_positions_attend_as_their_whole_sequences():
    """Three rows in slots 2, 0, 3 fed in uneven chunks that share forwards (right-padded),
    each chunk's output equal to the rows' whole-sequence causal attention there."""
    rng = np.random.default_rng(0)
    plan = {2: [5, 1, 1, 3], 0: [2, 4, 1, 1], 3: [1, 1, 6, 1]}     # slot -> chunk lengths
    seqs = {s: steps_of(rng, ls) for s, ls in plan.items()}
    want = {s: whole(*seqs[s]) for s in plan}
    cache, unit, fed = SlotCache(4, MAX_LEN, np), object(), {s: 0 for s in plan}
    for step in range(4):
        slots = list(plan)
        lengths = [plan[s][step] for s in slots]
        t = max(lengths)
        q, k, v = (np.zeros((len(slots), h, t, DH)) for h in (HQ, HKV, HKV))
        for i, s in enumerate(slots):                      # right-padded with junk
            a, m = fed[s], lengths[i]
            for arr, src in zip((q, k, v), seqs[s]):
                arr[i] = 7.0
                arr[i, :, :m] = src[0, :, a:a + m]
        cache.select(slots, [fed[s] for s in slots], t, lengths)
        assert cache.positions(t).tolist() == [
            [min(fed[s] + j, MAX_LEN - 1) for j in range(t)] for s in slots]
        out = cache.attend(unit, q, k, v)
        for i, s in enumerate(slots):
            a, m = fed[s], lengths[i]
            assert_close(out[i, :, :m], want[s][0, :, a:a + m], what=f"slot {s} step {step}")
            fed[s] += m
    kb, vb = cache.buffers[unit]
    assert kb.shape == (4, HKV, MAX_LEN, DH)
    for s in plan:                                         # only real tokens were stored
        assert np.array_equal(kb[s, :, :fed[s]], seqs[s][1][0])
        assert not kb[s, :, fed[s]:].any() and not vb[s, :, fed[s]:].any()
    assert not kb[1].any(), "an unused slot stays empty"
    assert cache.nbytes() == 2 * kb.nbytes


def test_a_reused_slot_forgets_its_previous_row():
    rng = np.random.default_rng(1)
    cache, unit = SlotCache(1, MAX_LEN, np), object()
    old = steps_of(rng, [9])
    cache.select([0], [0], 9)
    cache.attend(unit, *old)
    new = steps_of(rng, [3, 1])
    cache.select([0], [0], 3)
    first = cache.attend(unit, *(a[:, :, :3] for a in new))
    cache.select([0], [3], 1)
    second = cache.attend(unit, *(a[:, :, 3:] for a in new))
    want = whole(*new)
    assert_close(first, want[:, :, :3], what="prefill over an old row")
    assert_close(second, want[:, :, 3:], what="decode over an old row")


@pytest.mark.parametrize("slots,starts,t,lengths,what", [
    ([4], [0], 1, None, "distinct, in"), ([1, 1], [0, 0], 1, None, "distinct, in"),
    ([0], [MAX_LEN - 1], 2, None, "do not fit"), ([0], [-1], 1, None, "do not fit"),
    ([0], [0], 2, [3], "do not fit"), ([0], [0], 2, [0], "do not fit"),
    ([], [], 1, None, "0 slots"), ([0, 1], [0], 1, None, "2 slots, 1 starts")])
def test_a_selection_the_pool_cannot_take_is_refused(slots, starts, t, lengths, what):
    with pytest.raises(ValueError, match=what):
        SlotCache(4, MAX_LEN, np).select(slots, starts, t, lengths)


def test_a_forward_of_another_shape_than_selected_is_refused():
    cache = SlotCache(2, MAX_LEN, np)
    cache.select([0, 1], [0, 0], 2)
    with pytest.raises(ValueError, match="declared"):
        cache.positions(3)
    q, k, v = steps_of(np.random.default_rng(2), [2])
    with pytest.raises(ValueError, match="declared"):
        cache.attend(object(), q, k, v)                    # one row, two selected


@pytest.mark.parametrize("layout,blocks,width", [
    ("single", 3, 16), ("tp=2", 3, 8), ("pp=2", 2, 16), ("tp=2,pp=3", 1, 8),
    ("dp=2,tp=2", 3, 8)])
def test_the_pool_size_is_known_before_allocation(layout, blocks, width):
    """k and v of each block of the fullest stage, the kv columns of one tp rank: all 4 kv
    heads of Dh 4 split over tp (a Llama with 2 kv heads: see the next test)."""
    model = ms.GPT(vocab_size=256, seq_len=32, d_model=16, n_heads=4, n_layers=3)
    assert kv_pool_bytes(model, layout, 5, 20, np.float32) == 2 * blocks * 5 * 20 * width * 4


@pytest.mark.parametrize("n_kv,tp,width", [(2, 1, 8), (2, 2, 4), (1, 2, 8), (1, 4, 4)])
def test_the_pool_of_grouped_kv_heads_under_tp(n_kv, tp, width):
    """Dh = 4: split kv heads are cached as they are; a tp rank that holds every kv head (tp
    does not divide them) may cache them repeated, one per local query head: at most
    d_model / tp columns (tests/serve/test_batch_step.py checks the pools the units fill)."""
    model = ms.Llama(vocab_size=256, seq_len=32, d_model=16, n_heads=4, n_layers=2,
                     n_kv_heads=n_kv)
    assert kv_pool_bytes(model, f"tp={tp}" if tp > 1 else "single", 3, 10, np.float64) == \
        2 * 2 * 3 * 10 * width * 8

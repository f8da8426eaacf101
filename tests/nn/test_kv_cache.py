"""The KV cache (nn/kv_cache.py) on its own: prefill + steps equal causal attention over the
whole sequence (float64, rtol 1e-9), with grouped-query heads (Hkv < Hq, query head h reading kv
head h // (Hq/Hkv) as HF's repeat_kv), left padding that no real token sees, and per-row
positions; position_rows/add_position_grads in the (B, t) array form."""
import numpy as np
import pytest

import mpishard as ms
from conftest import RTOL64, assert_close
from mpishard.nn.attention import causal_attention_forward
from mpishard.nn.functional import embedding_backward
from mpishard.nn.kv_cache import KVCache, caching
from mpishard.nn.transformer import add_position_grads, position_rows

rng = np.random.default_rng(0)


def qkv(b, hq, hkv, t, dh=4):
    return (rng.normal(size=(b, hq, t, dh)), rng.normal(size=(b, hkv, t, dh)),
            rng.normal(size=(b, hkv, t, dh)))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_prefill_and_steps_equal_full_causal_attention(hq, hkv):
    q, k, v = qkv(2, hq, hkv, 7)
    g = hq // hkv
    want, _ = causal_attention_forward(q, np.repeat(k, g, axis=1), np.repeat(v, g, axis=1))
    cache, unit = KVCache(8), object()
    got = [cache.attend(unit, q[:, :, :4], k[:, :, :4], v[:, :, :4])]
    cache.advance(4)
    for i in range(4, 7):
        got.append(cache.attend(unit, q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1]))
        cache.advance(1)
    assert_close(np.concatenate(got, axis=2), want, rtol=RTOL64, what=f"GQA {hq}/{hkv}")
    with pytest.raises(ValueError, match="exceed"):
        cache.attend(unit, *qkv(2, hq, hkv, 2))


def test_left_padding_is_invisible_and_positions_count_real_tokens():
    """Row 0 has 2 padding slots: its real tokens' outputs equal the unpadded row's."""
    q, k, v = qkv(2, 4, 2, 5)
    real = np.array([[False, False, True, True, True], [True] * 5])
    cache, unit = KVCache(8), object()
    cache.extend(real)
    assert cache.positions(5).tolist() == [[0, 0, 0, 1, 2], [0, 1, 2, 3, 4]]
    out = cache.attend(unit, q, k, v)
    cache.advance(5)
    alone, _ = causal_attention_forward(q[:1, :, 2:], np.repeat(k[:1, :, 2:], 2, axis=1),
                                        np.repeat(v[:1, :, 2:], 2, axis=1))
    assert_close(out[:1, :, 2:], alone, rtol=RTOL64, what="padded row")
    assert not out[0, :, :2].any(), "a padding query sees no key: output 0"
    cache.extend(np.ones((2, 1), dtype=bool))
    assert cache.positions(1).tolist() == [[3], [5]]
    with pytest.raises(ValueError, match="declared"):
        cache.positions(2)
    cache.reset()
    assert cache.positions(3) == slice(0, 3)            # no rows declared: one plain slice


def test_position_rows_and_their_gradient_in_every_form():
    pos = rng.normal(size=(10, 3))
    where = np.array([[0, 0, 1], [4, 5, 6]])
    assert_close(position_rows(pos, where), pos[where], rtol=0, what="array form")
    assert_close(position_rows(pos, where, 1, 2), pos[where][:, 1:3], rtol=0, what="lo, n")
    assert_close(position_rows(pos, (slice(0, 2), slice(6, 8))), pos[[0, 1, 6, 7]], rtol=0)
    assert_close(position_rows(pos, slice(2, 6), 1, 2), pos[3:5], rtol=0, what="slice lo, n")
    dy = rng.normal(size=(2, 3, 3))
    forms = [(where, where), (slice(3, 6), [3, 4, 5]),
             ((slice(0, 1), slice(8, 10)), [0, 8, 9])]
    for form, rows in forms:
        dpos = np.zeros_like(pos)
        add_position_grads(dpos, form, dy)
        idx = np.broadcast_to(np.asarray(rows), (2, 3))       # each row's positions
        assert_close(dpos, embedding_backward(dy, idx, 10), rtol=RTOL64, what=f"{form}")


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_cached_forward_computes_the_head_on_the_last_slot_only(kind):
    """Under caching the model's Head (nn.layers.Head) runs on each row's last slot: the
    logits are (B, 1, V) and equal the full forward's last position; outside it, (B, T, V)."""
    sizes = dict(vocab_size=64, seq_len=16, d_model=16, n_heads=4, n_layers=2)
    model = ms.GPT(**sizes) if kind == "gpt" else ms.Llama(**sizes, n_kv_heads=2, d_ff=24)
    engine = ms.make_engine(model, "single", report_errors=False)
    engine.load_checkpoint(model.init(seed=0))
    ids = rng.integers(0, 64, size=(2, 6))
    full = engine.predict(ids)
    with caching(engine.chunks, KVCache(8)):
        last = engine.predict(ids)
    assert full.shape == (2, 6, 64) and last.shape == (2, 1, 64)
    assert_close(last, full[:, -1:], rtol=RTOL64, what=kind)

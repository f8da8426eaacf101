"""Generation of one prompt with a KV cache (nn/kv_cache.py; cli/generate.py's generate_tokens
and last_logits, over engine.generate and parallel/decode.Decoder): greedy decoding with the
cache equals argmax of full recomputation, token for token, and the logits agree in float64
(rtol 1e-9) at every step, the cache full and refilled included (seq_len 16, 40 new tokens);
under single, tp=2, pp=2 and dp=2,tp=2 the same; a seeded sampled text is the same on 1 and 2
ranks. Batches of prompts: test_generate_batched.py.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/integration/test_gpt_generate.py`
for N in 1, 2, 4, 8 (a k-rank layout runs on `group_comm(k)`).
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import RTOL64, group_comm
from mpishard.cli.generate import generate_tokens, last_logits
from mpishard.nn.kv_cache import KVCache, caching
from mpishard.parallel.decoder import check_decode
from mpishard.comm.mesh import parse_layout

PROMPT = [3, 1, 4, 1, 5]


def make_gpt():
    return ms.GPT(vocab_size=16, seq_len=16, d_model=16, n_heads=4, n_layers=2, d_ff=32)


def loaded(layout="single", comm=None, model=None):
    model = model or make_gpt()
    engine = ms.make_engine(model, layout, comm=MPI.COMM_SELF if comm is None else comm)
    engine.load_checkpoint(model.init(seed=1))
    return engine


def check_cached_equals_recomputed(engine, n_new=40):
    """Greedy with the cache == argmax of full recomputation for n_new tokens; every step's
    logits agree (the cache runs full at seq_len and is refilled)."""
    seq_len, tokens = engine.model.seq_len, list(PROMPT)
    cache, pending, worst = KVCache(seq_len), list(PROMPT), 0.0
    for step in range(n_new):
        full = last_logits(engine, tokens[-seq_len:])
        if cache.length + len(pending) > seq_len:
            cache.reset()
            pending = tokens[-seq_len:]
        cached = last_logits(engine, pending, cache)
        worst = max(worst, float(np.max(np.abs(cached - full))))
        np.testing.assert_allclose(cached, full, rtol=RTOL64, atol=1e-12,
                                   err_msg=f"{engine.layout.text} step {step}")
        assert int(np.argmax(cached)) == int(np.argmax(full))
        tokens.append(int(np.argmax(full)))
        pending = tokens[-1:]
    greedy = generate_tokens(engine, PROMPT, n_new, temperature=0.0)
    assert greedy == tokens[len(PROMPT):], f"{engine.layout.text}: generate differs"
    print(f"{engine.layout.text}: {n_new} greedy tokens equal, max |logit diff| {worst:.2e}")
    assert sum(len(layer.tape) for layer in engine.layers) == 0, "a tape was recorded"


# -- serial -------------------------------------------------------------------------------------
def test_single_cached_greedy_equals_recomputation():
    check_cached_equals_recomputed(loaded())


def test_recompute_attn_layout_decodes_with_the_cache():
    check_cached_equals_recomputed(loaded("single,recompute=attn"), n_new=24)


def test_cache_hooks_are_restored_and_capacity_checked():
    engine = loaded()
    cache = KVCache(engine.model.seq_len)
    with caching(engine.chunks, cache):
        engine.predict(np.asarray([PROMPT]))
    cache.advance(len(PROMPT))
    x = np.asarray([PROMPT])
    np.testing.assert_allclose(engine.predict(x), loaded().predict(x), rtol=0)  # hooks gone
    assert len(cache.buffers) == engine.model.n_layers
    assert next(iter(cache.buffers.values()))[0].shape == (1, 4, 16, 4)   # (B, H, S, Dh)
    with pytest.raises(ValueError, match="exceed"):
        cache.positions(engine.model.seq_len)


def test_refill_window_and_fallbacks():
    engine = loaded()
    out = generate_tokens(engine, PROMPT, 30, temperature=0.0, refill=8)
    assert len(out) == 30
    # refill = seq_len is the default; no cache at all gives the same greedy text
    assert generate_tokens(engine, PROMPT, 30, temperature=0.0) == \
        generate_tokens(engine, PROMPT, 30, temperature=0.0, kv_cache=False)
    with pytest.raises(ValueError, match="refill"):
        generate_tokens(engine, PROMPT, 1, refill=0)
    for layout in ("cp=2", "tp=2,sequence_parallel=1"):
        with pytest.raises(ValueError, match="KV cache"):
            check_decode(parse_layout(layout))


# -- MPI ----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["tp=2", "pp=2", "dp=2"])
def test_cached_greedy_equals_recomputation_on_two_ranks(layout):
    check_cached_equals_recomputed(loaded(layout, group_comm(2)))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["dp=2,tp=2", "tp=2,pp=2"])
def test_cached_greedy_equals_recomputation_on_four_ranks(layout):
    check_cached_equals_recomputed(loaded(layout, group_comm(4)), n_new=24)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["tp=2", "pp=2"])
def test_sampled_text_is_the_same_on_one_and_two_ranks(layout):
    kw = dict(temperature=0.9, top_k=8, seed=7)
    ref = generate_tokens(loaded(), PROMPT, 30, **kw)
    out = generate_tokens(loaded(layout, group_comm(2)), PROMPT, 30, **kw)
    assert out == ref, f"{layout}: {out} != single {ref}"

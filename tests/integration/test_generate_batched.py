"""Batched generation (engine.generate, parallel/decode.py): prompts of different lengths in one
batch, left-padded, with per-row positions and a KV cache.

Greedy in float64: the batch gives each prompt the ids it gets alone, and the ids of full
recomputation without a cache (the single-device engine's predict on each row's whole context,
argmax, one row at a time); every cached step's logits equal that recomputation (rtol 1e-9),
past seq_len too (the window refill); the same under single, dp, fsdp, tp, pp and tp+pp at 1, 2
and 4 ranks, for a GPT and a Llama with grouped-query attention. Sampling with a fixed seed is
the same on every layout. Bad input raises the same ValueError on every rank before any
communication.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/integration/test_generate_batched.py` for N in 2, 4 (a k-rank layout runs on `group_comm(k)`).
"""
import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import RTOL64, assert_close, group_comm
from mpishard.nn.kv_cache import KVCache
from mpishard.parallel.decode import Decoder, left_padded

PROMPTS = [[3, 1, 4, 1, 5], [2, 7], [9, 9, 9, 9, 9, 9, 9, 1], [6]]
SEQ_LEN = 16


def make_model(kind):
    if kind == "gpt":
        return ms.GPT(vocab_size=16, seq_len=SEQ_LEN, d_model=16, n_heads=4, n_layers=2,
                      d_ff=32)
    return ms.Llama(vocab_size=16, seq_len=SEQ_LEN, d_model=16, n_heads=4, n_layers=2,
                    n_kv_heads=2, d_ff=32)


def loaded(kind, layout="single", comm=None):
    model = make_model(kind)
    engine = ms.make_engine(model, layout, comm=MPI.COMM_SELF if comm is None else comm)
    engine.load_checkpoint(model.init(seed=1))
    return engine


def recomputed(ref, prompt, n_new):
    """Greedy ids by full recomputation of one row's last seq_len tokens, no cache."""
    tokens = list(prompt)
    for _ in range(n_new):
        logits = ref.predict(np.asarray([tokens[-SEQ_LEN:]]))[0, -1]
        tokens.append(int(np.argmax(logits)))
    return tokens[len(prompt):]


def check_greedy(kind, engine, n_new=14):
    """engine.generate of the batch == each prompt alone == recomputation (tokens)."""
    ref = loaded(kind)
    want = [recomputed(ref, p, n_new) for p in PROMPTS]
    got = engine.generate(PROMPTS, n_new, temperature=0)
    assert got == want, f"{kind} {engine.layout.text}: batch {got} != recomputed {want}"
    assert [engine.generate([p], n_new, temperature=0)[0] for p in PROMPTS] == want
    assert engine.generate(PROMPTS, n_new, temperature=0, kv_cache=False) == want
    assert sum(len(layer.tape) for layer in engine.layers) == 0, "a tape was recorded"


def check_cached_logits(kind, engine, n_new=12):
    """Every cached step's logits (B, V) == each row's recomputed logits at rtol 1e-9: the
    left-padded prefill, then one token per row, the refill past seq_len included."""
    ref, decoder = loaded(kind), Decoder.of(engine)
    rows = [list(p) for p in PROMPTS]
    rows += [[0] for _ in range(-len(rows) % decoder.rows)]
    cache, worst, v = KVCache(SEQ_LEN), 0.0, engine.model.vocab_size
    for step in range(n_new):
        if cache.length == 0 or cache.length == SEQ_LEN:
            cache.reset()
            ids, real = left_padded([r[-SEQ_LEN:] for r in rows])
        else:
            ids = np.asarray([[r[-1]] for r in rows])
            real = np.ones(ids.shape, dtype=bool)
        got = decoder.cached_step(ids, real, cache, v)
        want = np.stack([ref.predict(np.asarray([r[-SEQ_LEN:]]))[0, -1] for r in rows])
        assert_close(got, want, rtol=RTOL64, what=f"{kind} {engine.layout.text} step {step}")
        worst = max(worst, float(np.abs(got - want).max()))
        for r, t in zip(rows, np.argmax(want, axis=-1)):
            r.append(int(t))
    assert max(len(r) for r in rows) > SEQ_LEN, "the window was never refilled"
    print(f"{kind} {engine.layout.text}: {n_new} steps, max |logit diff| {worst:.2e}")


SAMPLING = dict(temperature=0.9, top_k=6, top_p=0.8, seed=7)


# -- serial -------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", ["single", "single,recompute=attn"])
def test_batched_greedy_equals_each_prompt_alone_and_recomputation(kind, layout):
    engine = loaded(kind, layout)
    check_greedy(kind, engine)
    check_cached_logits(kind, engine)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_eos_ends_a_row_and_the_window_is_refilled(kind):
    engine = loaded(kind)
    full = engine.generate(PROMPTS, 30, temperature=0)    # 8 + 30 > seq_len: refilled
    assert full == [recomputed(loaded(kind), p, 30) for p in PROMPTS]
    eos = full[0][3]
    out = engine.generate(PROMPTS, 30, temperature=0, eos=[eos, 99 % 16])
    for row, ref in zip(out, full):
        stops = [i for i, t in enumerate(ref) if t in (eos, 99 % 16)]
        assert row == (ref[:stops[0] + 1] if stops else ref)     # eos included, then done
    assert engine.generate(PROMPTS, 0) == [[] for _ in PROMPTS]
    sampled = engine.generate(PROMPTS, 10, **SAMPLING)
    assert sampled == engine.generate(PROMPTS, 10, **SAMPLING)
    assert sampled != engine.generate(PROMPTS, 10, **dict(SAMPLING, seed=8))
    assert all(len(r) == 10 and all(0 <= t < 16 for t in r) for r in sampled)


@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_a_prompt_longer_than_seq_len_starts_from_its_last_window(kind):
    """The refill rule from the start: a 20-token prompt is prefilled as its last 16."""
    engine, ref = loaded(kind), loaded(kind)
    batch = [list(range(16)) + [3, 1, 4, 1], [5]]
    assert engine.generate(batch, 6, temperature=0) == [recomputed(ref, p, 6) for p in batch]


BAD = [
    (dict(prompts=[]), "non-empty list"),
    (dict(prompts=[[1, 2], []]), "prompt 1 must be a non-empty"),
    (dict(prompts=[[1, 16]]), "prompt 0 must hold integer token ids in \\[0, 16\\)"),
    (dict(prompts=[[1, -1]]), "prompt 0 must hold integer"),
    (dict(max_new_tokens=-1), "max_new_tokens must be an integer >= 0"),
    (dict(top_p=0.0), "top_p must be > 0"),
    (dict(top_p=1.5), "top_p must lie in \\(0, 1\\]"),
    (dict(temperature=-1.0), "temperature must be >= 0"),
    (dict(top_k=-2), "top_k must be an integer >= 0"),
    (dict(eos=16), "eos \\[16\\] must be token ids"),
]


def check_bad_input(engine):
    """Every bad call raises its ValueError with no collective or message sent."""
    for change, message in BAD:
        kw = dict(dict(prompts=PROMPTS, max_new_tokens=3), **change)
        engine.reset_comm_stats()
        with pytest.raises(ValueError, match=message):
            engine.generate(**kw)
        assert not any(engine.comm_calls.values()), f"{change}: {engine.comm_calls}"


def test_bad_input_raises_before_any_communication():
    check_bad_input(loaded("gpt"))
    mlp = ms.make_engine(ms.MLP([4, 3]), comm=MPI.COMM_SELF)
    mlp.load_checkpoint(ms.MLP([4, 3]).init(seed=0))
    with pytest.raises(TypeError, match="needs a language model"):
        mlp.generate([[1]], 2)


# -- MPI ----------------------------------------------------------------------------------------
TWO = ["dp=2", "fsdp=2", "tp=2", "pp=2"]
FOUR = ["dp=2,tp=2", "tp=2,pp=2", "fsdp=2,pp=2", "dp=4"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", TWO)
def test_batched_generation_on_two_ranks(kind, layout):
    engine = loaded(kind, layout, group_comm(2))
    check_greedy(kind, engine)
    check_cached_logits(kind, engine)
    assert engine.generate(PROMPTS, 10, **SAMPLING) == loaded(kind).generate(PROMPTS, 10,
                                                                             **SAMPLING)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", ["pp=2,schedule=interleaved", "fsdp=2,zero=1", "tp=2"])
def test_tied_odd_vocabulary_and_interleaved_stages_on_two_ranks(kind, layout):
    """Tied 4-block models with V = 17 (padded under tp), virtual pipeline stages: greedy
    batched ids equal single's."""
    sizes = dict(vocab_size=17, seq_len=SEQ_LEN, d_model=16, n_heads=4, n_layers=4, d_ff=32,
                 tied=True)
    model = ms.GPT(**sizes) if kind == "gpt" else ms.Llama(**sizes, n_kv_heads=2)
    params = model.init(seed=3)
    engines = [ms.make_engine(model, lay, comm=c) for lay, c in
               (("single", MPI.COMM_SELF), (layout, group_comm(2)))]
    batch = PROMPTS + [[16, 0]]
    out = []
    for engine in engines:
        engine.load_checkpoint(params)
        out.append(engine.generate(batch, 14, temperature=0))
    assert out[1] == out[0], f"{kind} {layout}: {out[1]} != single {out[0]}"


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("kind", ["gpt", "llama"])
@pytest.mark.parametrize("layout", FOUR)
def test_batched_generation_on_four_ranks(kind, layout):
    engine = loaded(kind, layout, group_comm(4))
    check_greedy(kind, engine, n_new=10)
    check_cached_logits(kind, engine, n_new=10)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["cp=2", "tp=2,sequence_parallel=1"])
def test_layouts_without_a_cache_recompute_the_batch(layout):
    """cp and sequence_parallel have no cache hooks: the right-padded batch is recomputed."""
    engine = loaded("gpt", layout, group_comm(2))
    ref = loaded("gpt")
    assert engine.generate(PROMPTS, 6, temperature=0) == \
        [recomputed(ref, p, 6) for p in PROMPTS]


@pytest.mark.mpi(min_size=2)
def test_bad_input_is_the_same_error_on_every_rank():
    comm = group_comm(2)
    engine = loaded("gpt", "tp=2", comm)
    check_bad_input(engine)
    messages = []
    for change, _ in BAD:
        try:
            engine.generate(**dict(dict(prompts=PROMPTS, max_new_tokens=3), **change))
        except ValueError as exc:
            messages.append(str(exc))
    assert len(set(map(tuple, comm.allgather(messages)))) == 1
    assert engine.generate(PROMPTS, 4, temperature=0) == loaded("gpt").generate(
        PROMPTS, 4, temperature=0)                            # the engine still works


@pytest.mark.mpi(min_size=2)
def test_a_window_cp_cannot_split_within_seq_len_is_refused_up_front():
    """cp=2 recomputes windows padded to a multiple of 4: with seq_len 10 a 10-token window
    cannot be, so a run that would reach one raises the same ValueError on every rank before
    any communication (instead of after some steps); a run whose windows stay within 8
    tokens generates single's ids."""
    comm = group_comm(2)
    model = ms.GPT(vocab_size=16, seq_len=10, d_model=16, n_heads=4, n_layers=1)
    engine, ref = ms.make_engine(model, "cp=2", comm=comm), ms.SingleDevice(model)
    for e in (engine, ref):
        e.load_checkpoint(model.init(seed=1))
    engine.reset_comm_stats()
    with pytest.raises(ValueError, match="windows of up to 10 tokens padded to a multiple "
                                         "of 4, past the model's seq_len=10"):
        engine.generate([[1, 2, 3], [4]], 8, temperature=0)
    assert not any(engine.comm_calls.values()), engine.comm_calls
    assert engine.generate([[1, 2, 3], [4]], 6, temperature=0) == \
        ref.generate([[1, 2, 3], [4]], 6, temperature=0)


def test_the_cache_is_sized_by_the_request_not_the_positions(monkeypatch):
    """A model with 512 positions and a 14-token answer to 8-token prompts: the cache holds
    8 + 14 - 1 slots (buffers (B, Hkv, 21, Dh)), and the ids equal the recomputed ones."""
    import mpishard.parallel.decode as decode

    made = []

    class Recorded(KVCache):
        def __init__(self, capacity):
            super().__init__(capacity)
            made.append(self)

    monkeypatch.setattr(decode, "KVCache", Recorded)
    model = ms.Llama(vocab_size=16, seq_len=512, d_model=16, n_heads=4, n_layers=2,
                     n_kv_heads=2, d_ff=32)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(model.init(seed=1))
    got = engine.generate(PROMPTS, 14, temperature=0)
    assert [c.capacity for c in made] == [8 + 14 - 1]
    assert {b[0].shape[2] for b in made[0].buffers.values()} == {21}
    assert got == engine.generate(PROMPTS, 14, temperature=0, kv_cache=False)

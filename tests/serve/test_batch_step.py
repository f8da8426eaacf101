"""serve/batch_step.Stepper: rows joining a running batch at different steps, in different
slots (one reused after its row finished, one prompt prefilled in chunks), decoded greedily
through the Stepper, give the tokens of engine.generate(prompt alone, temperature=0) and the
alone-run's logits (float64, rtol 1e-9), for a GPT, a Llama and a Mixtral (capacity_factor
None), on single and on tp=2, pp=2 (microbatches=2), tp=2,pp=2 and dp=2 replicas.

Serial: `pytest tests/serve/test_batch_step.py -m "not mpi"`.
MPI, N in 1, 2, 4, 8: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi \
    tests/serve/test_batch_step.py`
"""
import numpy as np
from mpi4py import MPI
import pytest
from conftest import assert_close, group_comm

import mpishard as ms
from mpishard.parallel.decode import Decoder, _cached_logits
from mpishard.serve.batch_step import Stepper
from mpishard.serve.replicas import replica_comm, split_replicas
from mpishard.serve.slots import kv_pool_bytes
from test_device_double import MODES, device_backend

SEQ, MAX_BATCH = 32, 3
PROMPTS = [[5, 6, 7, 8, 9], [1, 2, 3, 4, 200, 100, 50, 9, 17], [250, 3, 3],
           [7, 70, 170, 255, 0, 1, 2], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 11]]
# (prompt, step it joins at, slot, new tokens, prefill chunk size or None for whole)
SCHEDULE = [(0, 0, 1, 6, None), (1, 0, 0, 3, None), (2, 2, 2, 5, None),
            (3, 4, 0, 4, None),            # slot 0 again: row 1 ended at step 2
            (4, 6, 1, 3, 4)]               # slot 1 again, its prompt fed 4 + 4 + 3 tokens


def gpt():
    return ms.GPT(vocab_size=256, seq_len=SEQ, d_model=16, n_heads=4, n_layers=2)


def llama():
    return ms.Llama(vocab_size=256, seq_len=SEQ, d_model=16, n_heads=4, n_layers=2,
                    n_kv_heads=2, d_ff=24, rope_theta=500.0)


def mixtral():
    """One kv head: under tp each rank holds it whole and caches it as it is."""
    return ms.Llama(vocab_size=256, seq_len=SEQ, d_model=16, n_heads=4, n_layers=2,
                    n_kv_heads=1, d_ff=12, rope_theta=500.0, n_experts=4, top_k=2,
                    capacity_factor=None)


MODELS = {"gpt": gpt, "llama": llama, "mixtral": mixtral}


def engine_on(model, layout="single", comm=None):
    engine = ms.SingleDevice(model) if layout == "single" and comm is None else \
        ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(model.init(seed=3))
    return engine


def alone(engine, prompt, n_new):
    """(greedy ids, their logits (n_new, V)) of one prompt as generate decodes it."""
    rows = [list(prompt)]
    step = _cached_logits(Decoder.of(engine), rows, SEQ, SEQ, n_new)
    ids, logits = [], []
    for _ in range(n_new):
        logits.append(step(engine.model.vocab_size)[0])
        ids.append(int(np.argmax(logits[-1])))
        rows[0].append(ids[-1])
    return ids, np.array(logits)


def served(stepper, prompts, schedule):
    """Drive the stepper as the serving loop does: each step, the rows that join send their
    prompt (or its next chunk) from their position so far, the running ones their last
    token; greedy ids. Returns {request: (ids, logits (n_new, V))}."""
    rows, out, step = {}, {}, 0          # request -> [slot, tokens fed, tokens, new wanted]
    todo = list(enumerate(schedule))
    while todo or rows:
        for r, (p, at, slot, n_new, chunk) in list(todo):
            if at <= step:
                assert all(v[0] != slot for v in rows.values()), "slot still busy"
                rows[r] = [slot, 0, list(prompts[p]), n_new, chunk]
                out[r] = ([], [])
                todo.remove((r, (p, at, slot, n_new, chunk)))
        order = sorted(rows)
        slots, starts, chunks = [], [], []
        for r in order:
            slot, fed, tokens, _, size = rows[r]
            take = tokens[fed:] if size is None else tokens[fed:fed + size]
            slots.append(slot)
            starts.append(fed)
            chunks.append(take)
        if order:
            logits = stepper.forward(slots, starts, chunks)
        for i, r in enumerate(order):
            rows[r][1] += len(chunks[i])
            slot, fed, tokens, n_new, _ = rows[r]
            if fed < len(tokens):                  # a prompt chunk: no token drawn yet
                continue
            ids, ls = out[r]
            ids.append(int(np.argmax(logits[i])))
            ls.append(logits[i])
            tokens.append(ids[-1])
            if len(ids) == n_new:
                del rows[r]
        step += 1
    return {r: (ids, np.array(ls)) for r, (ids, ls) in out.items()}


def check_served(engine, reference, prompts=PROMPTS, schedule=SCHEDULE, microbatches=None):
    """The stepper on `engine` against `reference` (a single-device engine) alone."""
    stepper = Stepper(engine, MAX_BATCH, SEQ, microbatches=microbatches)
    pool = stepper.nbytes()                       # allocated by the constructor, never grown
    got = served(stepper, prompts, schedule)
    assert stepper.nbytes() == pool > 0
    for r, (p, _, _, n_new, _) in enumerate(schedule):
        want_ids, want_logits = alone(reference, prompts[p], n_new)
        assert want_ids == reference.generate([prompts[p]], n_new, temperature=0.0)[0]
        ids, logits = got[r]
        assert ids == want_ids, f"request {r}: {ids} != {want_ids}"
        assert_close(logits, want_logits, what=f"request {r} logits")
    return stepper


@pytest.mark.parametrize("name", sorted(MODELS))
def test_rows_joining_a_running_batch_decode_as_each_prompt_alone(name):
    model = MODELS[name]()
    engine = engine_on(model)
    stepper = check_served(engine, engine)
    assert stepper.nbytes() == kv_pool_bytes(model, "single", MAX_BATCH, SEQ, np.float64)


def test_microbatches_without_pp_split_the_rows_and_change_nothing():
    engine = engine_on(llama())
    check_served(engine, engine, microbatches=2)


def test_a_step_the_pool_or_the_vocabulary_cannot_take_is_refused():
    stepper = Stepper(engine_on(gpt()), MAX_BATCH, 16)
    for slots, starts, chunks, what in [([3], [0], [[1]], "slots"),
                                        ([0, 0], [0, 0], [[1], [2]], "distinct"),
                                        ([0], [15], [[1, 2]], "do not fit"),
                                        ([0], [0], [[256]], "token ids"),
                                        ([0], [0], [[]], "token ids"),
                                        ([0, 1], [0], [[1], [2]], "one each")]:
        with pytest.raises(ValueError, match=what):
            stepper.forward(slots, starts, chunks)
    with pytest.raises(ValueError, match="seq_len"):
        Stepper(engine_on(gpt()), 2, SEQ + 1)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
def test_the_stepper_on_device_arrays(mode):
    """On the strict stand-in for cupy (a stray np. call on a device array raises): the pool,
    its indices and masks live on the device; the numbers are numpy single's."""
    comm = group_comm(1)
    backend, _ = device_backend(comm, mode)
    model = mixtral()
    with ms.make_engine(model, "single", comm=comm, device=backend) as engine:
        engine.load_checkpoint(model.init(seed=3))
        check_served(engine, engine_on(model))


# -- layouts ---------------------------------------------------------------------------------------
LAYOUTS = [("tp=2", 2, None), ("pp=2,microbatches=2", 2, None), ("pp=2", 2, 3),
           ("tp=2,pp=2,microbatches=2", 4, None),
           ("tp=4", 4, None)]                 # the Llama's 2 kv heads repeated per query head


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("layout,n,microbatches", LAYOUTS, ids=[lay for lay, _, _ in LAYOUTS])
def test_a_layout_serves_each_prompt_as_single_alone(layout, n, microbatches, name):
    model = MODELS[name]()
    with engine_on(model, layout, group_comm(n)) as engine:
        stepper = check_served(engine, engine_on(model), microbatches=microbatches)
    bound = kv_pool_bytes(model, layout, MAX_BATCH, SEQ, np.float64)
    tp = engine.layout.size("tp")
    assert stepper.nbytes() <= bound
    if model.kv_width(tp) * tp == model.kv_width(1):      # tp splits the kv heads: exact
        assert stepper.nbytes() == bound


REPLICAS = [("dp=2", 2), ("dp=2,tp=2", 4), ("dp=2,pp=2,microbatches=2", 4)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("name", sorted(MODELS))
@pytest.mark.parametrize("layout,n", REPLICAS, ids=[lay for lay, _ in REPLICAS])
def test_replicas_each_serve_their_own_prompts_as_single_alone(layout, n, name):
    """Each replica, an engine on its own sub-communicator, runs other prompts."""
    comm = group_comm(n)
    replicas, inner = split_replicas(layout, comm.Get_size())
    sub, index = replica_comm(comm, replicas)
    try:
        model = MODELS[name]()
        prompts = PROMPTS[index:] + PROMPTS[:index]          # replica 1: other prompts
        with engine_on(model, inner, sub) as engine:
            check_served(engine, engine_on(model), prompts)
    finally:
        sub.Free()


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_16_bit_compute_serves_each_prompt_as_generate_alone(name):
    """compute_dtype="bfloat16" (float32 master): the Stepper's slot cache rounds its
    attention's matmuls as generate's cache does (the unit's autocast reaches both), so the
    served ids are generate's and the logits agree to float32 summation order: 0 here, bound
    a quarter of a bf16 ulp of the logits' scale (the slot cache without the unit's rounding
    is 0.5-1 ulp off)."""
    model = MODELS[name]()
    engine = ms.make_engine(model, "single", comm=MPI.COMM_SELF, dtype=np.float32,
                            compute_dtype="bfloat16")
    engine.load_checkpoint(model.init(seed=3))
    serves_as_generate_alone(engine, Stepper(engine, MAX_BATCH, SEQ))
    engine.close()


def serves_as_generate_alone(engine, stepper):
    """Each prompt the 16-bit `stepper` serves: generate's ids alone, logits within a
    quarter of a bf16 ulp of their scale."""
    got = served(stepper, PROMPTS, SCHEDULE)
    for r, (p, _, _, n_new, _) in enumerate(SCHEDULE):
        want_ids, want_logits = alone(engine, PROMPTS[p], n_new)
        ids, logits = got[r]
        ulps = np.abs(logits - want_logits).max() / (2.0 ** -8 * np.abs(want_logits).max())
        assert ids == want_ids and ulps <= 0.25, (r, ids, want_ids, ulps)


@pytest.mark.parametrize("name", ["gpt", "llama"])
def test_16_bit_compute_on_a_device_keeps_a_16_bit_pool(name):
    """On the device double with compute_dtype="bfloat16": the slot pool holds k and v in
    bfloat16, half of kv_pool_bytes at float32 (the values the attention's matmuls take, so
    nothing is rounded twice), and serves each prompt as generate does alone."""
    import ml_dtypes
    backend, _ = device_backend(MPI.COMM_SELF, "staged")
    model = MODELS[name]()
    engine = ms.make_engine(model, "single", comm=MPI.COMM_SELF, dtype=np.float32,
                            compute_dtype="bfloat16", device=backend)
    engine.load_checkpoint(model.init(seed=3))
    stepper = Stepper(engine, MAX_BATCH, SEQ)
    bf16 = np.dtype(ml_dtypes.bfloat16)
    assert {a.dtype for pair in stepper.cache.buffers.values() for a in pair} == {bf16}
    assert stepper.nbytes() == kv_pool_bytes(model, "single", MAX_BATCH, SEQ, bf16) == \
        kv_pool_bytes(model, "single", MAX_BATCH, SEQ, np.float32) // 2
    serves_as_generate_alone(engine, stepper)
    engine.close()

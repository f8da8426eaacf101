"""ms.Qwen2 on every layout against single in float64 (rtol 1e-9): train_step's loss, every
gathered gradient (the q, k and v biases included), the gathered logits and parameters, on dp,
fsdp (zero 1-3), tp (kv heads split or replicated, sequence_parallel), pp (1f1b, zero bubble),
cp (ring and Ulysses) and their compositions, and on the strict device double; KV-cached
greedy generation equals single's; a checkpoint reopens as ms.Qwen2. Serially: the biases'
placements follow their weights'.

MPI tests, for N in 1, 2, 4:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/models/qwen2/test_qwen2_layouts.py`
(a k-rank layout runs on `group_comm(k)`).
"""
import os
import shutil
import tempfile

import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, group_comm
from mpishard.parallel.compose import plan_params
from test_device_double import MODES
from test_llama_layouts import check_device_step, compare_with_single


def make_qwen2(n_layers=2, tied=False, n_kv_heads=2, vocab=13, n_heads=4, seq_len=8):
    """d_model = 4 n_heads (Dh = 4), an odd vocabulary."""
    return ms.Qwen2(vocab_size=vocab, seq_len=seq_len, d_model=4 * n_heads, n_heads=n_heads,
                    n_layers=n_layers, n_kv_heads=n_kv_heads, d_ff=24, rope_theta=500.0,
                    tied=tied)


# -- serial ----------------------------------------------------------------------------------------
def test_the_biases_follow_their_weights_output_columns():
    """Under tp a bias is split like its weight's columns (whole heads), or replicated with
    replicated kv weights; under fsdp (zero=3) split along dim 0 like every parameter."""
    for kv, tp in ((2, 2), (1, 2), (2, 4)):
        plan = plan_params(make_qwen2(n_kv_heads=kv), ms.parse_layout(f"tp={tp}"))
        for p in "qkv":
            w = plan[f"block_0/attn/{p}/weights"].placement.shards
            b = plan[f"block_0/attn/{p}/bias"].placement.shards
            assert [(s.axis, s.dim) for s in b] == [(s.axis, 0) for s in w], (kv, tp, p, w, b)
    plan = plan_params(make_qwen2(), ms.parse_layout("fsdp=2"))
    assert [(s.axis, s.dim) for s in plan["block_1/attn/v/bias"].placement.shards] == \
        [("fsdp", 0)]


# -- every layout against single -------------------------------------------------------------------
TWO = [("dp=2", {}), ("fsdp=2,zero=1", {}), ("fsdp=2,zero=2", {"tied": True}),
       ("fsdp=2,zero=3", {}), ("fsdp=2,zero=3,prefetch=1", {"T": 5}),
       ("tp=2", {}), ("tp=2", {"n_kv_heads": 1}), ("tp=2", {"n_heads": 6, "n_kv_heads": 3}),
       ("tp=2,sequence_parallel=1", {}), ("tp=2,sequence_parallel=1", {"n_kv_heads": 1}),
       ("pp=2,schedule=1f1b", {"T": 6}), ("pp=2,schedule=zb1p", {}),
       ("pp=2,schedule=interleaved", {"n_layers": 4}),
       ("cp=2", {}), ("cp=2", {"n_kv_heads": 1, "tied": True}), ("cp=2,cp_kind=ulysses", {}),
       ("dp=2,recompute=1", {}), ("tp=2,recompute=attn", {"n_kv_heads": 1})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw}" for lay, kw in TWO])
def test_two_rank_layouts_equal_single(layout, kw):
    T = kw.pop("T", 8)
    compare_with_single(group_comm(2), layout, make_qwen2(**kw), T=T)


FOUR = [("tp=4", {}), ("tp=4", {"n_kv_heads": 4, "tied": True}),
        ("tp=4,sequence_parallel=1", {"n_kv_heads": 1}), ("dp=2,tp=2", {"n_kv_heads": 1}),
        ("tp=2,pp=2", {"tied": True}), ("tp=2,fsdp=2", {"n_kv_heads": 1}),
        ("tp=2,fsdp=2,zero=1,sequence_parallel=1", {}), ("fsdp=2,pp=2", {"T": 6}),
        ("fsdp=4,zero=3", {}), ("cp=4", {}), ("tp=2,cp=2", {"n_kv_heads": 1}),
        ("tp=2,cp=2,cp_kind=ulysses", {}), ("cp=2,pp=2", {"tied": True}),
        ("cp=2,fsdp=2", {}), ("dp=2,pp=2", {})]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw}" for lay, kw in FOUR])
def test_four_rank_layouts_equal_single(layout, kw):
    T = kw.pop("T", 8)
    compare_with_single(group_comm(4), layout, make_qwen2(**kw), T=T)


@pytest.mark.mpi(min_size=1)
def test_one_rank_equals_single():
    compare_with_single(group_comm(1), "dp=1", make_qwen2(tied=True))


# -- the strict device double (tests/device_double.py) ---------------------------------------------
DEVICE = [("single", 1, {}), ("tp=2", 2, {"n_kv_heads": 1}), ("fsdp=2", 2, {}),
          ("cp=2", 2, {})]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,n,kw", DEVICE, ids=[f"{v}-{kw}" for v, _, kw in DEVICE])
def test_train_step_on_device_arrays(layout, n, kw, mode):
    """On the stand-in for cupy (the biases fetched, added and reduced on the device), no
    array crosses the bus but MPI's staging, and the step equals numpy single's."""
    check_device_step(make_qwen2(**kw), layout, n, mode, logits=False)


# -- generation, training, checkpoints -------------------------------------------------------------
GENERATE = [(1, "single", {}), (2, "tp=2", {"n_kv_heads": 1}), (2, "pp=2", {}),
            (2, "fsdp=2", {}), (4, "tp=2,pp=2", {"tied": True}), (4, "tp=4", {})]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("n,layout,kw", GENERATE, ids=[f"{lay}-{kw}" for _, lay, kw in GENERATE])
def test_cached_greedy_generation_equals_single(n, layout, kw):
    """Prompts of different lengths, past seq_len (the cache refills): the KV-cached greedy
    ids equal single's recomputed ones."""
    comm = group_comm(n)
    model = make_qwen2(seq_len=12, **kw)
    rng = np.random.default_rng(4)
    params = {k: 6 * v + (rng.standard_normal(v.shape) if k.endswith("/bias") else 0)
              for k, v in model.init(4).items()}
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    single = ms.SingleDevice(model)
    single.load_checkpoint(params)
    want = single.generate(prompts, 10, temperature=0, kv_cache=False)
    engine = single if layout == "single" else ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    got = engine.generate(prompts, 10, temperature=0)
    print(f"{layout}: {got}")
    assert got == want


@pytest.mark.mpi(min_size=2)
def test_adamw_under_tp_follows_single_and_the_checkpoint_reopens():
    """Three AdamW steps under tp=2 (kv heads replicated: their biases' gradients summed over
    tp) follow single's; the checkpoint reopens as the same ms.Qwen2 under fsdp=2 and single."""
    comm = group_comm(2)
    model = make_qwen2(n_kv_heads=1)
    params = model.init(seed=5)
    x = np.random.default_rng(3).integers(0, model.vocab_size, (4, 8))
    CE = ms.losses.CrossEntropy()
    losses = []
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    ref_opt = ms.optim.AdamW(ref, lr=1e-2)
    engine = ms.make_engine(model, "tp=2", comm=comm)
    engine.load_checkpoint(params)
    opt = ms.optim.AdamW(engine, lr=1e-2)
    for _ in range(3):
        want, g = ref.train_step(x, np.roll(x, -1, 1), CE)
        ref_opt.step(g)
        got, g = engine.train_step(engine.shard_batch(x), engine.shard_batch(np.roll(x, -1, 1)),
                                   CE)
        opt.step(g)
        losses.append((got, want))
    print("tp=2 vs single losses", losses)
    assert losses[-1][1] < losses[0][1]
    assert_close([g for g, _ in losses], [w for _, w in losses], what="tp=2 AdamW losses")
    trained = engine.gather_params()
    assert_close(trained["block_0/attn/k/bias"], ref.gather_params()["block_0/attn/k/bias"],
                 what="trained k bias")
    tmp = comm.bcast(tempfile.mkdtemp(prefix="qwen2-ckpt-") if comm.Get_rank() == 0 else None)
    path = os.path.join(tmp, "ck")
    ms.checkpoint.save(path, engine, opt, step=3)
    ck = ms.checkpoint.load(path)
    assert repr(ck.model()) == repr(model) and ck.model().kind == "qwen2"
    for layout in ("fsdp=2", "single"):
        other = ms.SingleDevice(ck.model()) if layout == "single" else \
            ms.make_engine(ck.model(), layout, comm=comm)
        other.load_checkpoint(ms.checkpoint.load(path))
        got = other.gather_params()
        assert set(got) == set(trained) and all((got[k] == trained[k]).all() for k in got), \
            layout
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp)

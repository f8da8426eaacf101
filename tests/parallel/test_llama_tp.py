"""ms.Llama under tensor parallelism (tp) and sequence parallelism: every layout against single
in float64 (rtol 1e-9): loss, every gathered gradient, gathered logits and parameters. kv
heads split over tp when n_kv_heads % tp == 0 and replicated (gradients summed over tp)
otherwise; an odd vocabulary (padded to a multiple of tp by the placements); tied and untied.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_llama_tp.py`
for N in 1, 2, 4 (a k-rank layout runs on `group_comm(k)`).
"""
import os
import shutil
import tempfile

import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import group_comm
from mpishard.parallel.compose import plan_params
from mpishard.parallel.decoder import check_decoder_layout
from mpishard.models.llama.tensor_parallel import local_heads
from test_llama_layouts import compare_with_single, make_llama


# -- serial: placements and head grouping ----------------------------------------------------------
@pytest.mark.parametrize("kv,tp,split", [(2, 2, True), (4, 4, True), (2, 4, False),
                                         (1, 2, False)])
def test_kv_weights_split_only_when_tp_divides_the_kv_heads(kv, tp, split):
    plan = plan_params(make_llama(n_kv_heads=kv), ms.parse_layout(f"tp={tp}"))
    shards = {n: info.placement.shards for n, info in plan.items()}
    assert bool(shards["block_0/attn/k/weights"]) == split == bool(shards["block_1/attn/v/weights"])
    assert shards["block_0/attn/q/weights"][0].dim == 1
    assert shards["block_0/attn/proj/weights"][0].dim == 0
    assert shards["block_0/mlp/down/weights"][0].dim == 0
    assert [s.dim for s in shards["block_0/mlp/gate/weights"]] == [1]
    assert shards["block_0/ln_1/scale"] == () and shards["ln_f/scale"] == ()


def test_each_query_head_keeps_its_kv_head_under_tp():
    """H=4, K=2 at tp=4 (replicated kv): rank r's one query head r uses kv head r // 2; at
    tp=2 (split) rank r's heads 2r, 2r+1 use its one local kv head."""
    model = make_llama(n_kv_heads=2)
    assert [local_heads(model, 4, r).kv_heads for r in range(4)] == [(0,), (0,), (1,), (1,)]
    assert [local_heads(model, 2, r).kv_heads for r in range(2)] == [(0, 0), (0, 0)]
    assert local_heads(model, 2, 1).n_kv == 1 and local_heads(model, 4, 3).n_kv == 2
    six = make_llama(n_heads=6, n_kv_heads=3)          # a rank's heads span two kv groups
    assert [local_heads(six, 2, r).kv_heads for r in range(2)] == [(0, 0, 1), (1, 2, 2)]


def test_tp_must_divide_heads_and_d_ff():
    """The message names the model's class (a Llama, not "the GPT's")."""
    with pytest.raises(ValueError, match="tp=8 does not divide the Llama's n_heads=4"):
        plan_params(make_llama(), ms.parse_layout("tp=8"))
    odd = ms.Llama(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=1, d_ff=15)
    with pytest.raises(ValueError, match="tp=2 does not divide the Llama's d_ff=15"):
        plan_params(odd, ms.parse_layout("tp=2"))
    with pytest.raises(ValueError, match="ep=2 is not yet supported for Llama models"):
        check_decoder_layout(make_llama(), ms.parse_layout("ep=2"))


# -- every layout against single -------------------------------------------------------------------
TWO = [("tp=2", {}), ("tp=2", {"n_kv_heads": 1}), ("tp=2", {"n_heads": 6, "n_kv_heads": 3}),
       ("tp=2", {"tied": True, "vocab": 16}),
       ("tp=2", {"vocab": 16, "n_kv_heads": 4}),
       ("tp=2,sequence_parallel=1", {}), ("tp=2,sequence_parallel=1", {"n_kv_heads": 1,
                                                                       "tied": True}),
       ("tp=2,recompute=1", {"n_kv_heads": 1})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw}" for lay, kw in TWO])
def test_two_rank_tp_layouts_equal_single(layout, kw):
    compare_with_single(group_comm(2), layout, make_llama(**kw))


FOUR = [("tp=4", {}), ("tp=4", {"n_kv_heads": 4, "tied": True}),
        ("tp=4,sequence_parallel=1", {"n_kv_heads": 1}),
        ("dp=2,tp=2", {"n_kv_heads": 1}), ("tp=2,pp=2", {"tied": True}),
        ("tp=2,pp=2,schedule=zb1p", {}), ("tp=2,fsdp=2", {"n_kv_heads": 1}),
        ("tp=2,fsdp=2,zero=1,sequence_parallel=1", {})]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw}" for lay, kw in FOUR])
def test_four_rank_tp_layouts_equal_single(layout, kw):
    compare_with_single(group_comm(4), layout, make_llama(**kw))


GENERATE = [(2, "tp=2", {"n_heads": 6, "n_kv_heads": 3}), (2, "tp=2", {"n_kv_heads": 1}),
            (4, "tp=4", {}), (4, "tp=2,pp=2", {"tied": True})]


@pytest.mark.parametrize("n,layout,kw", GENERATE, ids=[f"{lay}-{kw}" for _, lay, kw in GENERATE])
@pytest.mark.mpi(min_size=2)
def test_cached_greedy_generation_under_tp_equals_single(n, layout, kw):
    """Prompts of different lengths, past seq_len (the cache refills): the KV-cached greedy
    ids under tp (the cache holds this rank's kv heads, or, grouped unevenly, its query
    heads' copies) equal single's recomputed ones."""
    if MPI.COMM_WORLD.Get_size() < n:
        pytest.skip(f"needs {n} ranks")
    model = make_llama(seq_len=12, **kw)
    params = {k: 6 * v for k, v in model.init(4).items()}
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    single = ms.SingleDevice(model)
    single.load_checkpoint(params)
    want = single.generate(prompts, 10, temperature=0, kv_cache=False)
    engine = ms.make_engine(model, layout, comm=group_comm(n))
    engine.load_checkpoint(params)
    got = engine.generate(prompts, 10, temperature=0)
    print(f"{layout}: {got}")
    assert got == want


@pytest.mark.mpi(min_size=2)
def test_checkpoint_saved_under_tp_reopens_under_other_layouts():
    """Saved under tp=2 (vocab 13 padded to 14, kv heads replicated), the checkpoint reopens as
    the same ms.Llama and loads bit for bit under single, cp=2 and fsdp=2."""
    comm = group_comm(2)
    model = make_llama(n_kv_heads=1, tied=True)
    params = {k: v + 0.01 * i for i, (k, v) in enumerate(model.init(seed=7).items())}
    engine = ms.make_engine(model, "tp=2", comm=comm)
    engine.load_checkpoint(params)
    tmp = comm.bcast(tempfile.mkdtemp(prefix="llama-tp-") if comm.Get_rank() == 0 else None)
    path = os.path.join(tmp, "ck")
    ms.checkpoint.save(path, engine, step=1)
    ck = ms.checkpoint.load(path)
    assert repr(ck.model()) == repr(model)
    for layout in ("single", "cp=2", "fsdp=2"):
        other = ms.SingleDevice(ck.model()) if layout == "single" else \
            ms.make_engine(ck.model(), layout, comm=comm)
        other.load_checkpoint(ms.checkpoint.load(path))
        got = other.gather_params()
        assert set(got) == set(params) and all((got[k] == params[k]).all() for k in params), \
            layout
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp)

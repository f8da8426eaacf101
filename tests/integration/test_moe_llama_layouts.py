"""A Mixtral (ms.Llama with n_experts) on the engine: expert parallelism inside the blocks,
alone and with dp, fsdp (zero 1-3), tp (with and without sequence_parallel), pp, cp and
recompute, against single in float64 (rtol 1e-9): loss (with and without the load-balancing
loss; under pp with schedule=gpipe, the only schedule that allows it), every gathered
gradient, the gathered logits and the routing statistics; capacity drops the same assignments
on every layout; KV-cached greedy generation under ep.

MPI tests, for N in 1, 2, 4 (and 8 for the dp=2,ep=2,tp=2 case):
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi \
    tests/integration/test_moe_llama_layouts.py`
"""
import os

import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, single_reference
from mpishard.parallel.compose import plan_params
from test_device_double import MODES, device_backend
from test_gpt_engine import make_case
from test_llama_layouts import CE, adamw_steps, compare_with_single


AUX = {"router_aux_loss_coef": 0.3}


def make_mixtral(n_experts=4, top_k=2, n_layers=2, **kw):
    """d_model 16, 4 query heads over 2 kv heads, an odd vocabulary, F = 12 per expert."""
    return ms.Llama(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=n_layers,
                    n_kv_heads=2, d_ff=12, rope_theta=500.0, n_experts=n_experts, top_k=top_k,
                    **kw)


def routing(engine):
    return {k: engine.stats[k] for k in ("moe_routed", "moe_kept", "moe_dropped")}


def check(n, layout, **kw):
    """`layout` on n ranks equals single (compare_with_single), and so do its routing
    statistics (summed over the ranks holding different tokens)."""
    T = kw.pop("T", 8)
    model = make_mixtral(**kw)
    engine = compare_with_single(group_comm(n), layout, model, T=T)
    ref = compare_with_single(group_comm(1), "single", model, T=T) if n > 1 else engine
    if layout.find("pp=") < 0:              # pp: each stage counts its own blocks
        assert routing(engine) == routing(ref), layout
    return engine


# -- serial ----------------------------------------------------------------------------------------
def test_experts_split_on_dim_0_over_ep_before_fsdp():
    plan = plan_params(make_mixtral(), ms.parse_layout("ep=2,fsdp=2,zero=3"))
    assert str(plan["block_0/moe/experts/gate/weights"].placement) == \
        "[Shard(ep, dim=0), Shard(fsdp, dim=0, pad)] stage 0"
    assert str(plan["block_0/moe/router/weights"].placement) == \
        "[Shard(fsdp, dim=0, pad)] stage 0"
    plan = plan_params(make_mixtral(), ms.parse_layout("ep=2,tp=2"))
    assert str(plan["block_1/moe/experts/down/weights"].placement) == \
        "[Shard(ep, dim=0)] stage 0"


@pytest.mark.parametrize("model,layout,match", [
    (make_mixtral(n_experts=3), "ep=2", "does not divide n_experts=3"),
    (make_mixtral(capacity_factor=1.0), "cp=2", "capacity_factor=1.0"),
    (make_mixtral(capacity_factor=1.0), "tp=2,sequence_parallel=1", "sequence_parallel"),
    (ms.Llama(13, 8, 16, 4, 2), "ep=2", "has none"),
    (make_mixtral(**AUX), "ep=2,pp=2", "only schedule=gpipe .*not schedule=1f1b"),
    (make_mixtral(**AUX), "pp=2,schedule=zb1p", "only schedule=gpipe .*not schedule=zb1p"),
    (make_mixtral(n_layers=4, **AUX), "pp=2,schedule=interleaved",
     "only schedule=gpipe .*not schedule=interleaved")])
def test_layouts_that_do_not_fit_are_refused(model, layout, match):
    with pytest.raises(ValueError, match=match):
        plan_params(model, ms.parse_layout(layout))


@pytest.mark.mpi(min_size=2)
def test_aux_under_pp_refused_on_every_rank_before_any_communication():
    """make_engine raises the same ValueError on both ranks (nothing collective is reached:
    a rank that went on would hang the test's timeout)."""
    with pytest.raises(ValueError, match="only schedule=gpipe .*not schedule=1f1b"):
        ms.make_engine(make_mixtral(**AUX), "pp=2,schedule=1f1b", comm=group_comm(2))


# -- every layout against single -------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_single_on_one_rank_routes_as_recorded():
    check(1, "dp=1", **AUX)
    engine = check(1, "dp=1", capacity_factor=0.75)
    assert engine.stats["moe_dropped"] > 0 and sum(engine.stats["moe_routed"]) == 2 * 8 * 8 * 2
    before = routing(engine)
    engine.predict(engine.shard_batch(np.zeros((3, 5), dtype=np.int64)))
    assert routing(engine) == before, "predict counted as a training step's routing"


TWO = [("ep=2", {}), ("ep=2", {"top_k": 1, "T": 5}), ("ep=2", {"capacity_factor": 0.75}),
       ("ep=2", {"n_experts": 2, "tied": True}), ("ep=2,recompute=1", {}),
       ("ep=2", AUX), ("ep=2,recompute=1", dict(AUX, top_k=1)), ("dp=2", AUX),
       ("tp=2,sequence_parallel=1", AUX), ("fsdp=2,zero=3,prefetch=1", {}),
       ("pp=2,schedule=interleaved", {"n_layers": 4}), ("pp=2,schedule=gpipe", AUX),
       ("pp=2,schedule=gpipe,microbatches=4,recompute=1", dict(AUX, n_layers=3, top_k=1))]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw}" for lay, kw in TWO])
def test_two_rank_layouts_equal_single(layout, kw):
    check(2, layout, **kw)


FOUR = [("ep=2,dp=2", {}), ("ep=2,dp=2", {"capacity_factor": 0.75}), ("ep=4", {}),
        ("ep=2,tp=2", {}), ("ep=2,tp=2,sequence_parallel=1", {}),
        ("ep=2,pp=2,schedule=1f1b,microbatches=2", {}), ("ep=2,pp=2,schedule=zb1p", {}),
        ("ep=2,fsdp=2,zero=1", {}), ("ep=2,fsdp=2,zero=2", {}), ("ep=2,fsdp=2,zero=3", {}),
        ("ep=2,cp=2", {}), ("ep=2,cp=2,cp_kind=ulysses", {}),
        ("ep=2,dp=2", AUX), ("ep=2,tp=2", AUX), ("ep=2,tp=2,sequence_parallel=1", AUX),
        ("ep=2,fsdp=2,zero=3", AUX), ("ep=2,cp=2", AUX), ("ep=2,pp=2,schedule=gpipe", AUX),
        ("dp=2,pp=2,schedule=gpipe", AUX)]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw}" for lay, kw in FOUR])
def test_four_rank_layouts_equal_single(layout, kw):
    check(4, layout, **kw)


@pytest.mark.mpi(min_size=2)
def test_aux_under_gpipe_follows_grad_scale_and_leaves_no_aux_outside_train_step():
    """pp=2 (gpipe): train_step(grad_scale=0.5) gives half single's gradients of CE + c aux
    and the full loss; an engine.forward/backward after it carries no auxiliary gradient
    (single's forward/backward neither)."""
    model = make_mixtral(**AUX)
    params, x, t = make_case(model, 8, 8)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    want_loss, want = ref.train_step(x, t, CE, grad_scale=0.5)
    want = {k: v.copy() for k, v in want.items()}
    engine = ms.make_engine(model, "pp=2,schedule=gpipe", comm=group_comm(2))
    engine.load_checkpoint(params)
    x_local, t_local = engine.shard_batch(x), engine.shard_batch(t)
    loss, grads = engine.train_step(x_local, t_local, CE, grad_scale=0.5)
    assert_close(loss, want_loss, what="gpipe aux loss, grad_scale 0.5")
    assert_dicts_close(engine.gather_grads(grads), want, what="gpipe aux grad_scale 0.5")
    y_ref = ref.forward(x)
    ref.backward(CE(y_ref, t)[1])
    y = engine.forward(x_local)
    engine.backward(None if y is None else CE(y, t_local)[1])
    assert_dicts_close(engine.gather_grads(engine.grads), ref.grads,
                       what="gpipe forward/backward after train_step")


@pytest.mark.mpi(min_size=8)
def test_eight_ranks_dp2_ep2_tp2_equal_single():
    check(8, "dp=2,ep=2,tp=2", n_layers=1)


@pytest.mark.mpi(min_size=2)
def test_capacity_drops_equal_single_counts():
    """check compares the counts with single's; the case must drop."""
    engine = check(2, "ep=2", capacity_factor=0.5)
    assert engine.stats["moe_dropped"] > 0


# -- the GPU code path -----------------------------------------------------------------------------
DEVICE = [("single", 1, {}), ("ep=2", 2, AUX), ("ep=2", 2, {"capacity_factor": 0.75}),
          ("ep=2,tp=2,sequence_parallel=1", 4, AUX), ("pp=2,schedule=gpipe", 2, AUX)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,n,kw", DEVICE, ids=[f"{v}-{kw}" for v, _, kw in DEVICE])
def test_train_step_on_device_arrays(layout, n, kw, mode):
    """On the strict stand-in for cupy (a stray np. call on a device array raises) the step,
    its exchanges staged or CUDA-aware, equals numpy single's (rtol 1e-9). The routing
    decision itself is made on the host (top-k and capacity, as ms.MoE's)."""
    comm = group_comm(n)
    backend, xp = device_backend(comm, mode)
    model = make_mixtral(**kw)
    params, x, t = make_case(model, rows=4)
    ref, want_loss, want = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm, device=backend)
    engine.load_checkpoint(params)
    x_dev, t_dev = engine.shard_batch(x), engine.shard_batch(t)
    loss, grads = engine.train_step(x_dev, t_dev, CE)
    assert_close(loss, want_loss, what=f"Mixtral {layout} {mode} loss")
    assert_dicts_close({k: backend.to_host(v) for k, v in engine.gather_grads(grads).items()},
                       want, what=f"Mixtral {layout} {mode}")
    assert_close(backend.to_host(engine.gather_batch(engine.predict(x_dev))), ref.predict(x),
                 what=f"Mixtral {layout} {mode} logits")


# -- KV-cached generation --------------------------------------------------------------------------
def greedy(engine, params, **kw):
    engine.load_checkpoint(params)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    return engine.generate(prompts, 4, temperature=0.0, **kw)


@pytest.mark.mpi(min_size=1)
def test_cached_greedy_generation_equals_recomputation():
    model = make_mixtral()
    params = ms.Llama.init(model, 4)
    engine = ms.make_engine(model, "dp=1", comm=group_comm(1))
    ids = greedy(engine, params)
    assert ids == greedy(engine, params, kv_cache=False) and len(ids[0]) == 4


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,n", [("ep=2", 2), ("dp=2,ep=2", 4), ("ep=2,tp=2", 4)])
def test_cached_greedy_generation_under_ep_equals_single(layout, n):
    model = make_mixtral()
    params = ms.Llama.init(model, 4)
    want = greedy(ms.SingleDevice(model), params)
    assert greedy(ms.make_engine(model, layout, comm=group_comm(n)), params) == want


# -- training and checkpoints ----------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_adamw_under_ep_follows_single_and_checkpoints_reshard(tmp_path_factory):
    """Four AdamW steps under ep=2 (with the auxiliary loss) follow single's; the checkpoint
    written then (experts split over ep) reopens as the same Mixtral and loads bit for bit
    under single and fsdp=2."""
    comm = group_comm(2)
    model = make_mixtral(**AUX)
    params = model.init(seed=5)
    ref_losses, _ = adamw_steps(ms.SingleDevice(model), params)
    engine = ms.make_engine(model, "ep=2", comm=comm)
    losses, opt = adamw_steps(engine, params)
    assert ref_losses[-1] < ref_losses[0]
    assert_close(losses, ref_losses, what="ep=2 AdamW losses")
    trained = engine.gather_params()
    tmp = comm.bcast(str(tmp_path_factory.mktemp("mixtral")) if comm.Get_rank() == 0 else None)
    path = os.path.join(tmp, "ck")
    ms.checkpoint.save(path, engine, opt, step=4)
    ck = ms.checkpoint.load(path)
    assert repr(ck.model()) == repr(model)
    for other in (ms.SingleDevice(ck.model()), ms.make_engine(ck.model(), "fsdp=2", comm=comm)):
        other.load_checkpoint(ms.checkpoint.load(path))
        assert_dicts_close(other.gather_params(), trained, rtol=0, what=f"reload {other}")
    comm.Barrier()

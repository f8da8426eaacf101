"""A tied GPT (tied=True) under pp (parallel/tied.py): embed/tokens on the first and the last
stage, their gradients summed before the optimizer step. Every layout against single in
float64 (rtol 1e-9: logits, loss, every gradient), the copies equal bit for bit after AdamW
steps with clipping, one embed/tokens in gather_params and checkpoints, pp <-> single reshard.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest -m mpi tests/parallel/test_tied_pp.py`
for N in 2 and 4 (a k-rank layout runs on `group_comm(k)`).
"""
import os

import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, single_reference
from mpishard.parallel.compose import plan_params
from mpishard.costs.rank_costs import rank_memory
from test_device_double import MODES, device_backend
from test_gpt_engine import make_case, step_against_single

CE = ms.losses.CrossEntropy()


def make_gpt(vocab=16):
    return ms.GPT(vocab_size=vocab, seq_len=8, d_model=16, n_heads=4, n_layers=4, d_ff=32,
                  tied=True)


def make_llama(vocab=16):
    """The same rule with no Llama-specific code: a tied ms.Llama (GQA, 2 kv heads)."""
    return ms.Llama(vocab_size=vocab, seq_len=8, d_model=16, n_heads=4, n_layers=4,
                    n_kv_heads=2, d_ff=24, tied=True)


# -- serial: the plan -------------------------------------------------------------------------
@pytest.mark.parametrize("layout,stages", [
    ("pp=2", (0, 1)), ("pp=4", (0, 3)), ("pp=2,schedule=interleaved", (0, 1)),
    ("dp=2,pp=2", (0, 1)), ("pp=1", (0,)), ("fsdp=2", (0,))])
def test_plan_puts_a_copy_on_the_head_stage(layout, stages):
    plan = plan_params(make_gpt(), ms.parse_layout(layout))
    assert plan["embed/tokens"].placement.stages == stages
    others = {n for n, info in plan.items() if len(info.placement.stages) > 1}
    assert others <= {"embed/tokens"}
    untied = plan_params(ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=4, n_layers=4),
                         ms.parse_layout(layout))
    assert all(info.placement.stages == (info.placement.stage,) for info in untied.values())


def test_the_last_stage_holds_and_prices_its_copy():
    """rank_memory (inspect/plan) counts the copy on the last stage too."""
    model = make_gpt()
    layout = ms.parse_layout("pp=2")
    last = rank_memory(model, layout, 1)["shapes"]
    assert last["embed/tokens"] == (16, 16) and "embed/positions" not in last


# -- every layout against single ----------------------------------------------------------------
def copies_equal(engine, name="embed/tokens") -> bool:
    """Whether the first and last stage hold the same bits of `name` (collective over pp; the
    answer on every rank)."""
    pp = engine.layout.size("pp")
    stage, comm = engine.stage, engine.comm
    mine = engine.params.get(name)
    if mine is not None:
        mine = np.ascontiguousarray(mine).view(np.uint8)       # the bits (bfloat16 too)
    if stage == pp - 1:
        comm.send(0, mine, tag=7, group="pp")
    same = np.array([1.0])
    if stage == 0:
        same[0] = float(np.array_equal(comm.receive(pp - 1, tag=7, group="pp"), mine))
    return bool(comm.broadcast(same, root=0, group="pp")[0])


def check_against_single(comm, layout, make=make_gpt):
    model = make()
    what = f"tied {type(model).__name__} {layout}"
    engine, params, _, _, _ = step_against_single(model, layout, comm, what)
    full = engine.gather_params()
    assert set(full) == set(model.param_shapes()), "one embed/tokens, nothing else"
    assert_dicts_close(full, params, rtol=0, what=f"{what} params round trip")
    if engine.stage in (0, engine.layout.size("pp") - 1):
        assert "embed/tokens" in engine.local_names
    return engine


LAYOUTS = [  # (ranks, layout)
    (2, "pp=2"), (2, "pp=2,schedule=gpipe,microbatches=4"),
    (2, "pp=2,schedule=interleaved"), (2, "pp=2,schedule=zb1p"),
    (4, "pp=4"), (4, "dp=2,pp=2"), (4, "tp=2,pp=2"), (4, "tp=2,pp=2,sequence_parallel=1"),
    (4, "fsdp=2,pp=2,zero=3"), (4, "fsdp=2,pp=2,zero=2"), (4, "fsdp=2,pp=2,zero=1"),
    (4, "pp=2,tp=2,schedule=interleaved"), (2, "pp=2,recompute=1")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout", LAYOUTS, ids=[lay for _, lay in LAYOUTS])
def test_layouts_equal_single(ranks, layout):
    check_against_single(group_comm(ranks), layout)


LLAMA_LAYOUTS = [(2, "pp=2"), (4, "pp=4"), (4, "tp=2,pp=2"), (4, "fsdp=2,pp=2,zero=3")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout", LLAMA_LAYOUTS, ids=[lay for _, lay in LLAMA_LAYOUTS])
def test_llama_layouts_equal_single(ranks, layout):
    check_against_single(group_comm(ranks), layout, make_llama)


# -- training: the copies never drift ------------------------------------------------------------
TRAINED = [(2, "pp=2"), (4, "pp=4"), (4, "dp=2,pp=2"), (4, "tp=2,pp=2"),
           (4, "fsdp=2,pp=2,zero=3"), (4, "fsdp=2,pp=2,zero=1")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout", TRAINED, ids=[lay for _, lay in TRAINED])
def test_adamw_steps_keep_the_copies_equal(ranks, layout):
    """20 AdamW steps with weight decay and clipping at norm 0.5 (the global norm counts the
    tied gradient once): the losses and final parameters equal single's at rtol 1e-9 and the
    two copies of embed/tokens are equal bit for bit."""
    comm = group_comm(ranks)
    model = make_gpt()
    params = model.init(seed=3)
    rng = np.random.default_rng(3)
    data = rng.integers(0, 16, (20, 4, 9))
    curves, finals, norms = [], [], []
    for c in (None, comm):
        engine = ms.SingleDevice(model) if c is None else ms.make_engine(model, layout, comm=c)
        engine.load_checkpoint(params)
        opt = ms.optim.AdamW(engine, lr=1e-2, weight_decay=0.1)
        losses, seen = [], []
        for batch in data:
            x, t = batch[:, :-1], batch[:, 1:]
            value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
            seen.append(ms.optim.clip_grad_norm(engine, grads, max_norm=0.5))
            opt.step(grads)
            losses.append(value)
        curves.append(np.array(losses))
        norms.append(np.array(seen))
        finals.append(engine.gather_params())
    assert_close(norms[1], norms[0], what=f"{layout} gradient norms")
    assert_close(curves[1], curves[0], what=f"{layout} losses")
    assert_dicts_close(finals[1], finals[0], what=f"{layout} params")
    assert copies_equal(engine), "the two copies of embed/tokens drifted apart"


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["pp=2", "fsdp=2,pp=2,zero=1"])
def test_gradient_accumulation_sums_the_copies_once(layout):
    """Two accumulated micro-steps (sync=False, then sync=True): the sum over the copies
    happens at the sync and gives single's accumulated gradient (rtol 1e-9)."""
    ranks = 2 if layout == "pp=2" else 4
    model = make_gpt()
    params, x, t = make_case(model)
    grads = []
    for comm in (None, group_comm(ranks)):
        engine = ms.SingleDevice(model) if comm is None else \
            ms.make_engine(model, layout, comm=comm)
        engine.load_checkpoint(params)
        for i, (xs, ts) in enumerate(((x[:4], t[:4]), (x[4:], t[4:]))):
            g = engine.train_step(engine.shard_batch(xs), engine.shard_batch(ts), CE,
                                  accumulate=i > 0, sync=i == 1, grad_scale=0.5)[1]
        grads.append(engine.gather_grads(g))
    assert_dicts_close(grads[1], grads[0], what=f"{layout} accumulated")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["pp=2", "pp=2,recompute=1"])
def test_bfloat16_copies_stay_equal(layout):
    """Mixed precision (bfloat16 parameters and gradient traffic, float32 math and masters):
    after 10 clipped AdamW steps the two bfloat16 copies are still equal bit for bit."""
    model = make_gpt()
    engine = ms.make_engine(model, layout, comm=group_comm(2), dtype=np.float32,
                            param_dtype="bfloat16", comm_dtype="bfloat16")
    engine.load_checkpoint(model.init(seed=3))
    opt = ms.optim.AdamW(engine, lr=1e-2, weight_decay=0.1)
    for batch in np.random.default_rng(3).integers(0, 16, (10, 4, 9)):
        grads = engine.train_step(batch[:, :-1], batch[:, 1:], CE)[1]
        ms.optim.clip_grad_norm(engine, grads, max_norm=0.5)
        opt.step(grads)
    assert copies_equal(engine)


# -- checkpoints: one embed/tokens, resharding between pp and single -----------------------------
@pytest.mark.mpi(min_size=4)
def test_checkpoints_reshard_between_pp_and_single(tmp_path_factory):
    comm = group_comm(4)
    model = make_gpt()
    params, x, t = make_case(model)
    engine = ms.make_engine(model, "dp=2,pp=2", comm=comm)
    engine.load_checkpoint(params)
    opt = ms.optim.AdamW(engine, lr=1e-2)
    opt.step(engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)[1])
    path = comm.bcast(str(tmp_path_factory.mktemp("tied_pp")) if comm.rank == 0 else None)
    ms.checkpoint.save(f"{path}/pp", engine, opt)
    full = engine.gather_params()
    saved = ms.checkpoint.load(f"{path}/pp")
    assert set(saved.keys()) == set(model.param_shapes())
    files = sorted(os.listdir(f"{path}/pp"))
    assert [f for f in files if f.startswith("param.embed.tokens__")] == \
        ["param.embed.tokens__0-16_0-16.npy"], files            # one block, not one per copy
    single = ms.SingleDevice(model)
    single_opt = ms.optim.AdamW(single, lr=1e-2)
    ms.checkpoint.restore(f"{path}/pp", single, single_opt)
    assert_dicts_close(single.gather_params(), full, rtol=0, what="pp=2 -> single")
    single_opt.step(single.train_step(x, t, CE)[1])               # single goes on one step
    again = ms.make_engine(model, "pp=4", comm=comm)              # pp=2 -> pp=4, state too
    again.load_checkpoint(model.init(1))
    opt2 = ms.optim.AdamW(again, lr=1e-2)
    ms.checkpoint.restore(f"{path}/pp", again, opt2)
    assert_dicts_close(again.gather_params(), full, rtol=0, what="dp=2,pp=2 -> pp=4")
    opt2.step(again.train_step(x, t, CE)[1])
    assert_dicts_close(again.gather_params(), single.gather_params(), what="a step after")
    assert copies_equal(again)


# -- device arrays (the strict CPU stand-in for cupy) ---------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["pp=2", "pp=2,schedule=interleaved"])
def test_tied_pp_on_device_arrays(layout, mode):
    """The exchange moves device blocks (staged or CUDA-aware) and equals numpy single."""
    comm = group_comm(2)
    backend, _ = device_backend(comm, mode)
    model = make_gpt()
    params, x, t = make_case(model)
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm, device=backend)
    engine.load_checkpoint(params)
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
    assert_close(loss, ref_loss, what=f"{layout} {mode} loss")
    full = {k: backend.to_host(v) for k, v in engine.gather_grads(grads).items()}
    assert_dicts_close(full, ref_grads, what=f"{layout} {mode}")

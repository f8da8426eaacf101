"""GPT on the engine: single against a plain numpy reference, then every supported layout
against single in float64 (rtol 1e-9): logits, loss and every gradient; AdamW training.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/integration/test_gpt_engine.py`
for N in 1, 2, 4, 8 (a k-rank layout runs on `group_comm(k)`, several groups side by side).
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, single_reference
from mpishard.parallel.compose import plan_params
from test_gpt_nn import perturbed, reference_gpt

CE = ms.losses.CrossEntropy()


def make_gpt(n_layers=2, tied=False):
    return ms.GPT(vocab_size=13, seq_len=8, d_model=16, n_heads=2, n_layers=n_layers, tied=tied)


def make_case(model, rows=8, T=8, seed=0):
    rng = np.random.default_rng(seed)
    params = perturbed(model, seed, rng)
    x = rng.integers(0, model.vocab_size, (rows, T))
    t = rng.integers(0, model.vocab_size, (rows, T))
    return params, x, t


def step_against_single(model, layout, comm, what):
    """One train_step of `model` on `layout` against the single-device reference (loss, every
    gradient, the gathered logits); returns (engine, params, x, y, reference logits)."""
    params, x, t = make_case(model)
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
    assert_close(value, ref_loss, what=f"{what} loss")
    assert_dicts_close(engine.gather_grads(grads), ref_grads, what=what)
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    want = ref.predict(x)
    assert_close(y, want, what=f"{what} logits")
    return engine, params, x, y, want


def check_against_single(comm, layout, n_layers=2, tied=False, T=8, rows=8):
    """train_step (loss, gathered gradients) and gathered predict of `layout` equal single's."""
    model = make_gpt(n_layers, tied)
    params, x, t = make_case(model, rows, T)
    compare_with_single(comm, layout, model, params, x, t, f"GPT {layout} tied={tied} T={T}")


def compare_with_single(comm, layout, model, params, x, t, what):
    """The engine of `layout` after the check: its train_step loss and gathered gradients, and
    its gathered predict, equal single's on (x, t)."""
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    x_local = engine.shard_batch(x)
    assert x_local.dtype.kind == "i", "token ids stay integers"
    value, grads = engine.train_step(x_local, engine.shard_batch(t), CE)
    assert_close(value, ref_loss, what=f"{what} loss")
    assert_dicts_close(engine.gather_grads(grads), ref_grads, what=what)
    y = engine.gather_batch(engine.predict(x_local))
    assert_close(y, ref.predict(x), what=f"{what} logits")
    assert sum(len(layer.tape) for layer in engine.layers) == 0, "activations left stashed"
    return engine


# -- serial ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("T", [8, 5])
def test_single_matches_the_numpy_reference(tied, T):
    model = make_gpt(2, tied)
    params, x, t = make_case(model, rows=3, T=T)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    want = reference_gpt(params, x, model.n_layers, model.n_heads, tied)
    assert_close(engine.predict(x), want, rtol=1e-12, what=f"single vs numpy, T={T}")
    assert_close(engine.forward(x), want, rtol=1e-12, what="forward")
    lp = want - want.max(-1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(-1, keepdims=True))
    token_mean = -np.take_along_axis(lp, t[..., None], -1).mean()
    assert_close(engine.train_step(x, t, CE)[0], token_mean, rtol=1e-12, what="token-mean loss")


@pytest.mark.parametrize("layout,match", [
    ("ep=2", "ep=2 is not yet supported for GPT"),
    ("dp=2,ep=2", "ep=2 is not yet supported"),
])
def test_unsupported_axes_are_refused(layout, match):
    with pytest.raises(ValueError, match=match):
        plan_params(make_gpt(), ms.parse_layout(layout))


def test_tied_with_pipeline_copies_the_embedding_to_the_last_stage():
    """(parallel/tied.py; test_tied_pp.py runs it.)"""
    plan = plan_params(make_gpt(2, tied=True), ms.parse_layout("pp=2"))
    assert plan["embed/tokens"].placement.stages == (0, 1)
    assert plan_params(make_gpt(2, tied=True), ms.parse_layout("fsdp=2"))[
        "embed/tokens"].placement.stages == (0,)


def test_pipeline_places_embedding_first_and_head_last():
    # blocks 0, 1, 2, 3 on stages 0, 1, 0, 1
    plan = plan_params(make_gpt(4), ms.parse_layout("pp=2,schedule=interleaved"))
    stage = {name: info.placement.stage for name, info in plan.items()}
    assert stage["embed/tokens"] == stage["embed/positions"] == 0
    assert [stage[f"block_{i}/ln_1/scale"] for i in range(4)] == [0, 1, 0, 1]
    assert stage["ln_f/scale"] == stage["head/weights"] == 1
    plan = plan_params(make_gpt(4), ms.parse_layout("pp=2,stages=3+1"))
    assert [plan[f"block_{i}/mlp/fc/bias"].placement.stage for i in range(4)] == [0, 0, 0, 1]


def test_engine_refuses_bad_tokens_and_targets():
    model = make_gpt()
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(model.init(0))
    with pytest.raises(TypeError, match="integer token ids"):
        engine.predict(np.zeros((2, 4)))
    with pytest.raises(ValueError, match="seq_len=8"):
        engine.predict(np.zeros((2, 9), dtype=np.int64))
    x = np.zeros((2, 4), dtype=np.int64)
    with pytest.raises(ValueError, match="leading dims"):
        engine.train_step(x, np.zeros(2, dtype=np.int64), CE)
    with pytest.raises(ValueError, match="cross_entropy"):
        engine.train_step(x, np.zeros((2, 5), dtype=np.int64), CE)
    with pytest.raises(ValueError, match=r"\[0, 13\)"):
        engine.train_step(x, np.full((2, 4), 13), CE)


# -- every layout against single -------------------------------------------------------------------
TWO = [("dp=2", {}), ("dp=2", {"tied": True, "T": 6}),
       ("dp=2,overlap=1,bucket_mb=0", {}), ("dp=2,overlap=1", {"tied": True}),
       ("fsdp=2,zero=1", {}), ("fsdp=2,zero=2", {"tied": True}),
       ("fsdp=2,zero=3", {}), ("fsdp=2,zero=3", {"tied": True, "T": 5}),
       ("fsdp=2,zero=3,prefetch=1", {}),
       ("pp=2,schedule=gpipe", {}), ("pp=2,schedule=1f1b", {"T": 6}),
       ("pp=2,schedule=1f1b,microbatches=4,stages=1+3", {"n_layers": 4}),
       ("pp=2,schedule=interleaved", {"n_layers": 4})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw}" for lay, kw in TWO])
def test_two_rank_layouts_equal_single(layout, kw):
    check_against_single(group_comm(2), layout, **kw)


FOUR = [("pp=4", {"n_layers": 4}), ("pp=4,schedule=gpipe", {"n_layers": 4, "T": 7}),
        ("dp=2,pp=2", {}), ("fsdp=2,pp=2", {"T": 6}), ("fsdp=2,pp=2,zero=1", {}),
        ("dp=2,fsdp=2", {"tied": True})]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw}" for lay, kw in FOUR])
def test_four_rank_layouts_equal_single(layout, kw):
    check_against_single(group_comm(4), layout, **kw)


@pytest.mark.mpi(min_size=2)
def test_adamw_training_under_dp_follows_single():
    """Five AdamW steps: dp=2's losses and final parameters equal single's."""
    comm = group_comm(2)
    model = make_gpt()
    params = model.init(seed=5)
    rng = np.random.default_rng(5)
    x = rng.integers(0, 13, (4, 8))
    batches = [(x, np.roll(x, -1, axis=1))] * 5            # one batch, learnt step by step
    curves, finals = [], []
    for layout, c in (("single", None), ("dp=2", comm)):
        engine = ms.make_engine(model, layout, comm=c) if c is not None else \
            ms.SingleDevice(model)
        engine.load_checkpoint(params)
        opt = ms.optim.AdamW(engine, lr=1e-2, weight_decay=0.01)
        losses = []
        for x, t in batches:
            value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
            opt.step(grads)
            losses.append(value)
        curves.append(np.array(losses))
        finals.append(engine.gather_params())
    print("single losses", curves[0])
    assert curves[0][-1] < curves[0][0], "the loss goes down"
    assert_close(curves[1], curves[0], what="dp=2 AdamW losses")
    assert_dicts_close(finals[1], finals[0], what="dp=2 AdamW params")

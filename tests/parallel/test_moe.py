"""Mixture of experts: the ms.MoE spec, its single-device reference, and expert parallelism.

Serial: `pytest tests/parallel/test_moe.py -m "not mpi"` (spec, routing rules against a
from-scratch
loop, finite-difference gradients, plan errors, the example at 2 ranks).
MPI: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_moe.py`,
N in 1, 2,
4, 8: ep / dp / dp x ep against `single` with the same capacity groups, float64 rtol 1e-9.
"""
from pathlib import Path

import numpy as np
import pytest
from conftest import assert_close, assert_dicts_close, group_comm, run_mpi

import mpishard as ms
from mpishard.parallel.expert_parallel import MoELayer
from mpishard.parallel.compose import plan_params

ROOT = Path(__file__).resolve().parents[2]
D_MODEL, D_HIDDEN, N_EXPERTS, BATCH = 6, 8, 8, 32


def make_model(top_k=2, groups=None, capacity_factor=1.0, **kw):
    return ms.MoE(D_MODEL, D_HIDDEN, N_EXPERTS, top_k=top_k, capacity_factor=capacity_factor,
                  groups=groups, **kw)


def data(seed=0, shift=0.0, rows=BATCH):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, D_MODEL)) + shift, rng.normal(size=(rows, D_MODEL))


# -- a from-scratch reference of the documented rule (loops, no engine) -------------------------
def loop_reference(model, params, x, groups):
    """y per the ms.MoE docstring, token by token; returns (y, dropped assignments)."""
    b, k = x.shape[0], model.top_k
    s = b // groups
    cap = model.capacity(s)
    logits = x @ params["router/weights"]
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    y, dropped = np.zeros_like(x), 0
    act = {"relu": lambda z: np.maximum(z, 0), "tanh": np.tanh}[model.activation]
    for g in range(groups):
        used = [0] * model.n_experts
        for j in range(k):                          # first choices first, then second ...
            for t in range(g * s, (g + 1) * s):
                e = int(np.argsort(-p[t])[j])
                if used[e] >= cap:
                    dropped += 1
                    continue
                used[e] += 1
                pre = f"expert_{e}/layer_"
                h = act(x[t] @ params[pre + "0/weights"] + params[pre + "0/bias"])
                y[t] += p[t, e] * (h @ params[pre + "1/weights"] + params[pre + "1/bias"])
    return y, dropped


# -- serial: spec --------------------------------------------------------------------------------
def test_spec_names_shapes_init():
    m = make_model()
    names = m.param_names()
    assert names[0] == "router/weights" and m.param_shapes()["router/weights"] == (6, 8)
    assert m.param_shapes()["expert_7/layer_0/weights"] == (6, 8)
    assert m.param_shapes()["expert_7/layer_1/weights"] == (8, 6)
    assert m.param_shapes()["expert_7/layer_1/bias"] == (6,)
    assert len(names) == 1 + 4 * N_EXPERTS
    assert m.num_params() == 6 * 8 + N_EXPERTS * (6 * 8 + 8 + 8 * 6 + 6)
    a, b = m.init(seed=3), m.init(seed=3)
    assert all(np.array_equal(a[n], b[n]) and a[n].dtype == np.float64 for n in names)
    assert np.abs(a["expert_0/layer_1/weights"]).max() <= 1 / np.sqrt(D_HIDDEN)
    assert np.abs(a["router/weights"]).max() <= 1 / np.sqrt(D_MODEL)
    assert not np.array_equal(a["expert_0/layer_0/weights"], a["expert_1/layer_0/weights"])
    assert len(ms.MoE(4, 4, 2, bias=False).param_names()) == 1 + 2 * 2
    m.check_params(a)
    bad = dict(a)
    del bad["expert_3/layer_0/bias"]
    with pytest.raises(ValueError, match="missing.*expert_3/layer_0/bias"):
        m.check_params(bad)
    bad = dict(a, **{"router/weights": np.zeros((6, 7))})
    with pytest.raises(ValueError, match=r"router/weights.*\(6, 7\).*\(6, 8\)"):
        m.check_params(bad)


@pytest.mark.parametrize("kw, msg", [(dict(top_k=9), "top_k=9"),
                                     (dict(capacity_factor=0.0), "capacity_factor"),
                                     (dict(groups=0), "groups"),
                                     (dict(activation="swish"), "swish")])
def test_spec_rejects_bad_arguments(kw, msg):
    with pytest.raises(ValueError, match=msg):
        make_model(**kw)


def test_capacity_formula():
    assert make_model(top_k=2, capacity_factor=1.0).capacity(32) == 8       # 32*2/8
    assert make_model(top_k=1, capacity_factor=1.25).capacity(10) == 2      # ceil(1.5625)
    assert make_model(capacity_factor=None).capacity(10) == 20              # never drops


@pytest.mark.parametrize("layout, msg", [
    ("ep=2", "layout ep=2 needs an ms.MoE model"),
])
def test_plan_rejects_mlp_under_ep(layout, msg):
    with pytest.raises(ValueError, match=msg):
        plan_params(ms.MLP([6, 8, 6]), ms.parse_layout(layout))


@pytest.mark.parametrize("model, layout, msg", [
    (ms.MoE(6, 8, 6), "ep=4", "ep=4 does not divide n_experts=6"),
    (ms.MoE(6, 8, 4), "ep=2,tp=2", "tp=2 is not supported"),
    (ms.MoE(6, 8, 4), "pp=2", "pp=2 is not supported"),
    (ms.MoE(6, 8, 4), "fsdp=2", "fsdp=2 is not supported"),
    (ms.MoE(6, 8, 4, groups=3), "dp=2,ep=2", "groups=3 is not a multiple of the 4"),
])
def test_plan_rejects_bad_layouts(model, layout, msg):
    with pytest.raises(ValueError, match=msg):
        plan_params(model, ms.parse_layout(layout))


def test_plan_places_experts_on_their_ep_rank():
    plan = plan_params(ms.MoE(6, 8, 8), ms.parse_layout("dp=2,ep=4"))
    assert plan["router/weights"].placement.owner == {}
    assert plan["expert_5/layer_1/bias"].placement.owner == {"ep": 2}
    assert not plan["expert_5/layer_1/bias"].placement.is_replicated_on("ep")
    assert plan["expert_5/layer_1/bias"].placement.is_replicated_on("dp")


# -- serial: the single-device reference ---------------------------------------------------------
@pytest.mark.parametrize("top_k, groups, shift", [(1, 1, 0.0), (2, 1, 0.0), (2, 4, 0.0),
                                                  (1, 2, 1.0)])
def test_single_matches_loop_reference(top_k, groups, shift):
    model = make_model(top_k=top_k, groups=groups, capacity_factor=1.0)
    params = model.init(seed=1)
    params["router/weights"][:, 0] += shift           # shift > 0: most tokens want expert 0
    x, _ = data(seed=2, shift=shift)
    eng = ms.SingleDevice(model)
    eng.load_checkpoint(params)
    want, dropped = loop_reference(model, params, x, groups)
    assert_close(eng.predict(x), want, what=f"single vs loop k={top_k} groups={groups}")
    assert eng.stats["moe_dropped"] == dropped
    assert eng.stats["moe_groups"] == groups
    assert sum(eng.stats["moe_routed"]) == BATCH * top_k
    assert sum(eng.stats["moe_kept"]) == BATCH * top_k - dropped
    if shift:
        assert dropped > 0


@pytest.mark.parametrize("top_k", [1, 2])
def test_single_gradients_match_finite_differences(top_k):
    model = ms.MoE(4, 5, 4, top_k=top_k, capacity_factor=1.0, activation="tanh", groups=2)
    params = model.init(seed=4)
    rng = np.random.default_rng(5)
    x, t = rng.normal(size=(12, 4)), rng.normal(size=(12, 4))
    eng = ms.SingleDevice(model)
    eng.load_checkpoint(params)
    _, grads = eng.train_step(x, t, ms.losses.MSE())
    assert eng.stats["moe_dropped"] > 0                 # drops are part of what is checked
    grads = {n: g.copy() for n, g in grads.items()}
    mse, h = ms.losses.MSE(), 1e-6

    def loss_at(p):
        eng.load_checkpoint(p)
        return mse.value(eng.predict(x), t)

    for name, g in grads.items():
        fd = np.zeros_like(g)
        for i in np.ndindex(g.shape):
            plus, minus = dict(params), dict(params)
            plus[name] = params[name].copy()
            minus[name] = params[name].copy()
            plus[name][i] += h
            minus[name][i] -= h
            fd[i] = (loss_at(plus) - loss_at(minus)) / (2 * h)
        assert_close(g, fd, rtol=1e-6, atol=1e-9, what=f"finite differences {name}")


# -- MPI: expert / data parallel against single -------------------------------------------------
LAYOUTS = [("ep=2", 2), ("ep=4", 4), ("dp=2,ep=2", 4), ("dp=2", 2), ("dp=2,ep=4", 8),
           ("ep=1", 1)]


def engines(layout, n, top_k, capacity_factor=1.0, shift=0.0, seed=0):
    """(engine under layout with groups=None, single with groups = data-parallel size, params)."""
    comm = group_comm(n)
    n_data = ms.parse_layout(layout).data_parallel_size
    params = make_model().init(seed=seed)
    params["router/weights"][:, 0] += shift
    eng = ms.make_engine(make_model(top_k, None, capacity_factor), layout, comm=comm)
    ref = ms.SingleDevice(make_model(top_k, n_data, capacity_factor))
    eng.load_checkpoint(params)
    ref.load_checkpoint(params)
    return eng, ref, params


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout, n", LAYOUTS)
@pytest.mark.parametrize("top_k", [1, 2])
def test_forward_loss_grads_match_single(layout, n, top_k):
    eng, ref, _ = engines(layout, n, top_k)
    x, t = data(seed=10 + top_k)
    loss, grads = eng.train_step(eng.shard_batch(x), eng.shard_batch(t), ms.losses.MSE())
    want_loss, want = ref.train_step(x, t, ms.losses.MSE())
    assert_close(loss, want_loss, what=f"{layout} loss")
    assert eng.stats["moe_dropped"] == ref.stats["moe_dropped"] > 0
    assert eng.stats["moe_kept"] == ref.stats["moe_kept"]
    assert_dicts_close(eng.gather_grads(grads), want, what=f"{layout} k={top_k} grads")
    y = eng.gather_batch(eng.predict(eng.shard_batch(x)))
    assert_close(y, ref.predict(x), what=f"{layout} k={top_k} forward")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout, n", LAYOUTS[:3] + LAYOUTS[-1:])
def test_input_gradient_goes_back_through_the_exchanges(layout, n):
    """A MoE layer that needs dx (inside a bigger model): dx matches single."""
    eng, ref, _ = engines(layout, n, top_k=2)
    x, dy = data(seed=7)
    got_layer, ref_layer = (MoELayer(e.model, e.access, e.comm, e.stats) for e in (eng, ref))
    got_layer.forward(eng.shard_batch(x), mb=3)
    ref_layer.forward(x, mb=3)
    dx = eng.gather_batch(got_layer.backward(eng.shard_batch(dy), mb=3))
    assert_close(dx, ref_layer.backward(dy, mb=3), what=f"{layout} dx")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout, n", LAYOUTS)
def test_uneven_routing_drops_like_single(layout, n):
    eng, ref, _ = engines(layout, n, top_k=2, shift=1.0)
    x, t = data(seed=3, shift=1.0)
    loss, grads = eng.train_step(eng.shard_batch(x), eng.shard_batch(t), ms.losses.MSE())
    want_loss, want = ref.train_step(x, t, ms.losses.MSE())
    routed = eng.stats["moe_routed"]
    assert routed[0] > BATCH / 2, f"expert 0 should get most tokens, routed {routed}"
    assert eng.stats["moe_dropped"] == ref.stats["moe_dropped"] > 0
    assert eng.stats["moe_kept"] == ref.stats["moe_kept"]
    assert max(eng.stats["moe_kept"]) <= eng.stats["moe_capacity"] * eng.stats["moe_groups"]
    assert_close(loss, want_loss, what=f"{layout} uneven loss")
    assert_dicts_close(eng.gather_grads(grads), want, what=f"{layout} uneven grads")


def sgd(engine, lr):
    for _, p, g, _ in engine.optimizer_shards():
        p -= lr * g


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout, n", LAYOUTS)
def test_sgd_steps_match_single(layout, n):
    eng, ref, _ = engines(layout, n, top_k=2, capacity_factor=1.25)
    for step in range(3):
        x, t = data(seed=100 + step)
        eng.train_step(eng.shard_batch(x), eng.shard_batch(t), ms.losses.MSE())
        ref.train_step(x, t, ms.losses.MSE())
        sgd(eng, 0.5)
        sgd(ref, 0.5)
    assert_dicts_close(eng.gather_params(), ref.gather_params(), what=f"{layout} after SGD")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout, n", LAYOUTS)
def test_adamw_with_clipping_matches_single(layout, n):
    """ms.optim over engine.optimizer_shards(): each expert updated by its owner only; the
    clipping norm counts an expert once (owned on ep) and the router once (replicated)."""
    eng, ref, _ = engines(layout, n, top_k=2, capacity_factor=1.25)
    opts = [ms.optim.AdamW(e, lr=0.01, weight_decay=0.01) for e in (eng, ref)]
    for step in range(4):
        x, t = data(seed=200 + step)
        _, grads = eng.train_step(eng.shard_batch(x), eng.shard_batch(t), ms.losses.MSE())
        _, want = ref.train_step(x, t, ms.losses.MSE())
        norm = ms.optim.clip_grad_norm(eng, grads, max_norm=0.05)
        want_norm = ms.optim.clip_grad_norm(ref, want, max_norm=0.05)
        assert_close(norm, want_norm, what=f"{layout} grad norm step {step}")
        assert want_norm > 0.05                         # the clipping is active
        opts[0].step(grads)
        opts[1].step(want)
    assert_dicts_close(eng.gather_params(), ref.gather_params(), what=f"{layout} after AdamW")


@pytest.mark.mpi(min_size=2)
def test_bad_layouts_raise_the_same_error_on_every_rank():
    comm = group_comm(2)
    for model, msg in [(ms.MLP([6, 8, 6]), "layout ep=2 needs an ms.MoE model"),
                       (ms.MoE(6, 8, 3), "ep=2 does not divide n_experts=3")]:
        with pytest.raises(ValueError, match=msg) as err:
            ms.make_engine(model, "ep=2", comm=comm)
        assert len(set(comm.allgather(str(err.value)))) == 1


# -- the example, at 2 ranks (serial test: it launches mpiexec itself) ----------------------------
def test_example_runs_at_two_ranks():
    res = run_mpi(2, ROOT / "examples" / "moe_expert_parallel.py", "--steps", "4", timeout=240)
    print(res.stdout, res.stderr)
    assert res.returncode == 0
    assert "matches single" in res.stdout
    assert res.stdout.count("step") >= 4

"""Optimizers, clipping and schedules against PyTorch's formulas and the single-device reference.

    pytest -m "not mpi" tests/train/test_optim.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_optim.py

torch is not installed, so PyTorch's update rules are written out below from its
documentation (torch.optim.SGD, torch.optim.AdamW, torch.nn.utils.clip_grad_norm_).
"""
import math

import numpy as np
import pytest

import mpishard as ms
from mpishard.train.lr import constant_schedule, cosine_schedule, make_lr_schedule
from mpishard.train.optim import SGD, AdamW, clip_grad_norm, hand_over_state

from conftest import assert_close, assert_dicts_close, world

DIMS = [6, 16, 8, 3]          # the hidden 16 divides by tp = 1, 2, 4, 8
BATCH = 16                    # divides by dp = 1, 2, 4, 8


# -- PyTorch's rules, written out ----------------------------------------------------------------
def torch_sgd(p, grads, lr, momentum=0.0, weight_decay=0.0):
    """torch.optim.SGD, dampening 0, nesterov False, over a list of gradients."""
    p, buf = p.copy(), None
    for g in grads:
        d_p = g + weight_decay * p
        if momentum:
            buf = d_p.copy() if buf is None else momentum * buf + d_p
            d_p = buf
        p = p - lr * d_p
    return p


def torch_adamw(p, grads, lr, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01):
    """torch.optim.AdamW as documented: theta <- theta - lr*lambda*theta; m, v; bias-corrected
    m_hat, v_hat; theta <- theta - lr * m_hat / (sqrt(v_hat) + eps)."""
    b1, b2 = betas
    p, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t, g in enumerate(grads, start=1):
        p = p - lr * weight_decay * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat = m / (1 - b1 ** t)
        v_hat = v / (1 - b2 ** t)
        p = p - lr * m_hat / (np.sqrt(v_hat) + eps)
    return p, m, v


def single_engine(dims=DIMS, dtype=np.float64, seed=0):
    model = ms.MLP(dims, activation="tanh")
    e = ms.SingleDevice(model, dtype=dtype)
    e.load_checkpoint(model.init(seed))
    return e


def run_with_grads(opt_factory, n_steps=3, seed=0):
    """Feed the same random gradients to an optimizer; return (params before, grads, after)."""
    e = single_engine()
    opt = opt_factory(e)
    rng = np.random.default_rng(seed)
    before = {k: v.copy() for k, v in e.params.items()}
    grads = {k: [rng.standard_normal(v.shape) for _ in range(n_steps)] for k, v in e.params.items()}
    for i in range(n_steps):
        for k in e.grads:
            e.grads[k][...] = grads[k][i]
        opt.step(e.grads)
    return e, opt, before, grads


# -- update rules (serial) ----------------------------------------------------------------------
@pytest.mark.parametrize("momentum,wd", [(0.0, 0.0), (0.9, 0.0), (0.9, 0.05), (0.0, 0.1)])
def test_sgd_matches_torch_rule(momentum, wd):
    lr = 0.1
    e, opt, before, grads = run_with_grads(lambda e: SGD(e, lr, momentum, wd), n_steps=4)
    for k in before:
        assert_close(e.params[k], torch_sgd(before[k], grads[k], lr, momentum, wd), rtol=1e-13,
                     what=f"sgd {k}")
    if momentum:
        assert set(opt.state) == set(before)


def test_sgd_momentum_buffer_starts_as_the_gradient():
    e, opt, before, grads = run_with_grads(lambda e: SGD(e, 0.5, momentum=0.9), n_steps=1)
    for k in before:
        assert_close(opt.state[k]["momentum_buffer"], grads[k][0], rtol=0, what=k)
        assert_close(e.params[k], before[k] - 0.5 * grads[k][0], rtol=1e-15, what=k)


@pytest.mark.parametrize("wd,betas,eps", [(0.01, (0.9, 0.999), 1e-8), (0.0, (0.8, 0.99), 1e-3),
                                          (0.3, (0.0, 0.5), 1e-6)])
def test_adamw_matches_torch_rule(wd, betas, eps):
    lr = 0.01
    e, opt, before, grads = run_with_grads(lambda e: AdamW(e, lr, betas, eps, wd), n_steps=5)
    for k in before:
        p, m, v = torch_adamw(before[k], grads[k], lr, betas, eps, wd)
        assert_close(e.params[k], p, rtol=1e-12, what=f"adamw {k}")
        assert_close(opt.state[k]["exp_avg"], m, rtol=1e-12, what=f"exp_avg {k}")
        assert_close(opt.state[k]["exp_avg_sq"], v, rtol=1e-12, what=f"exp_avg_sq {k}")
        assert opt.state[k]["step"] == 5


def test_adamw_first_step_closed_form():
    """Step 1: m_hat = g and v_hat = g^2, so p1 = p0 (1 - lr wd) - lr g / (|g| + eps)."""
    lr, wd, eps = 0.05, 0.1, 1e-8
    e, _, before, grads = run_with_grads(lambda e: AdamW(e, lr, eps=eps, weight_decay=wd), 1)
    for k in before:
        g = grads[k][0]
        assert_close(e.params[k], before[k] * (1 - lr * wd) - lr * g / (np.abs(g) + eps),
                     rtol=1e-12, what=k)


def test_float32_update_keeps_dtype():
    e = single_engine(dtype=np.float32)
    opt = AdamW(e, 1e-2)
    for g in e.grads.values():
        g[...] = 1.0
    opt.step(e.grads)
    for k, p in e.params.items():
        assert p.dtype == np.float32 and opt.state[k]["exp_avg"].dtype == np.float32


def test_hyperparameters_are_checked():
    e = single_engine()
    with pytest.raises(ValueError, match="lr must be >= 0, got -1"):
        SGD(e, -1.0)
    with pytest.raises(ValueError, match="beta2"):
        AdamW(e, betas=(0.9, 1.0))
    with pytest.raises(TypeError, match="betas"):
        AdamW(e, betas=0.9)
    with pytest.raises(TypeError, match="lr must be a number"):
        AdamW(e, lr="fast")
    opt = AdamW(e, 1e-3)
    opt.lr = 0.5
    assert opt.lr == 0.5
    with pytest.raises(ValueError, match="lr"):
        opt.lr = float("nan")
    with pytest.raises(ValueError, match="lr must be a finite number, got inf"):
        SGD(e, float("inf"))                      # not ">= 0, got inf"
    with pytest.raises(TypeError, match="grads"):
        opt.step([1, 2])


# -- state dicts ---------------------------------------------------------------------------------
@pytest.mark.parametrize("make", [lambda e: AdamW(e, 0.01), lambda e: SGD(e, 0.1, momentum=0.9)],
                         ids=["adamw", "sgd"])
def test_state_dict_round_trip_resumes_exactly(make):
    e, opt, _, _ = run_with_grads(make, n_steps=2)
    sd = opt.state_dict()
    assert set(sd["state"]) == set(e.params)
    for name, entry in sd["state"].items():
        for k, v in entry.items():
            assert k == "step" or v.shape == e.params[name].shape
    params = {k: v.copy() for k, v in e.params.items()}
    e2 = single_engine()
    e2.load_checkpoint(params)
    opt2 = make(e2)
    opt2.load_state_dict(sd)
    rng = np.random.default_rng(9)
    for k in e.grads:
        g = rng.standard_normal(e.grads[k].shape)
        e.grads[k][...] = g
        e2.grads[k][...] = g
    opt.step(e.grads)
    opt2.step(e2.grads)
    assert_dicts_close(e2.params, e.params, rtol=0, what="resumed")


def test_load_state_dict_rejects_mismatches():
    e, opt, _, _ = run_with_grads(lambda e: AdamW(e, 0.01), n_steps=1)
    sd = opt.state_dict()
    with pytest.raises(ValueError, match="not SGD"):
        SGD(e, 0.1).load_state_dict(sd)
    sd["state"]["layer_0/weights"]["exp_avg"] = np.zeros((2, 2))
    with pytest.raises(ValueError, match=r"layer_0/weights/exp_avg has shape \(2, 2\)"):
        AdamW(e).load_state_dict(sd)


def test_restored_state_goes_to_the_optimizer_built_before_or_after():
    """hand_over_state (what ms.checkpoint.restore calls): with no optimizer given, the state
    goes to the one built on the engine, else waits for the next one built, which starts
    from it; one of another type is refused, and a reload of the engine drops the state."""
    e, opt, _, _ = run_with_grads(lambda e: AdamW(e, 0.01), n_steps=2)
    sd = opt.state_dict()
    params = {k: v.copy() for k, v in e.params.items()}

    def fresh():
        e2 = single_engine()
        e2.load_checkpoint(params)
        return e2

    before = fresh()
    built = AdamW(before, 0.01)
    hand_over_state(before, sd)                       # into the optimizer built before
    after = fresh()
    hand_over_state(after, sd)                        # kept for the next one built
    with pytest.raises(ValueError, match="holds AdamW state: build an AdamW"):
        SGD(after, 0.1)
    later = AdamW(after, 0.01)
    rng = np.random.default_rng(9)
    for k in e.grads:
        g = rng.standard_normal(e.grads[k].shape)
        for engine in (e, before, after):
            engine.grads[k][...] = g
    for o in (opt, built, later):
        o.step()
    assert_dicts_close(before.params, e.params, rtol=0, what="optimizer built before")
    assert_dicts_close(after.params, e.params, rtol=0, what="optimizer built after")

    reloaded = fresh()
    hand_over_state(reloaded, sd)
    reloaded.load_checkpoint(params)                  # other blocks: the kept state is stale
    assert AdamW(reloaded, 0.01).state == {}


def test_an_optimizer_built_after_a_restore_keeps_its_own_arguments(caplog):
    """`restore(path, engine); AdamW(engine, lr=...)`: the optimizer starts from the saved state
    (step counts, moments) but with the arguments it was built with, as any constructor does;
    each one that differs from the checkpoint's is named in a warning (review of issue 31: the
    saved values silently replaced them)."""
    e, opt, _, _ = run_with_grads(lambda e: AdamW(e, 0.01, weight_decay=0.1), n_steps=2)
    sd = opt.state_dict()
    e2 = single_engine()
    e2.load_checkpoint({k: v.copy() for k, v in e.params.items()})
    hand_over_state(e2, sd)
    with caplog.at_level("WARNING", logger="mpishard"):
        later = AdamW(e2, 0.001, weight_decay=0.1, betas=(0.8, 0.95))
    assert later.lr == 0.001 and later.betas == (0.8, 0.95) and later.weight_decay == 0.1
    assert {k: v["step"] for k, v in later.state.items()} == {k: 2 for k in sd["state"]}
    warned = " ".join(r.getMessage() for r in caplog.records)
    assert "lr=0.001 (saved 0.01)" in warned and "betas=[0.8, 0.95]" in warned
    assert "weight_decay" not in warned               # the same as saved: not named


# -- clipping (serial) ---------------------------------------------------------------------------
@pytest.mark.parametrize("factor", [0.25, 1.0, 4.0])
def test_clip_matches_torch_clip_grad_norm(factor):
    e = single_engine()
    rng = np.random.default_rng(3)
    for g in e.grads.values():
        g[...] = rng.standard_normal(g.shape)
    full = {k: v.copy() for k, v in e.grads.items()}
    total = math.sqrt(sum(float((g ** 2).sum()) for g in full.values()))
    max_norm = factor * total
    norm = clip_grad_norm(e, e.grads, max_norm)
    assert_close(norm, total, rtol=1e-13, what="norm")
    coef = min(1.0, max_norm / (total + 1e-6))             # torch: clamp(max=1.0)
    assert_dicts_close(e.grads, {k: v * coef for k, v in full.items()}, rtol=1e-14, what="clip")
    if factor < 1:
        after = math.sqrt(sum(float((g ** 2).sum()) for g in e.grads.values()))
        assert after < max_norm


def test_clip_inf_norm_and_bad_arguments():
    e = single_engine()
    for i, g in enumerate(e.grads.values()):
        g[...] = i - 0.5
    assert clip_grad_norm(e, e.grads, 100.0, norm_type=math.inf) == len(e.grads) - 1.5
    with pytest.raises(ValueError, match="max_norm"):
        clip_grad_norm(e, e.grads, 0.0)
    with pytest.raises(ValueError, match="norm_type"):
        clip_grad_norm(e, e.grads, 1.0, norm_type=1)


# -- schedules -----------------------------------------------------------------------------------
def test_cosine_schedule_with_warmup():
    s = cosine_schedule(1.0, total_steps=110, warmup_steps=10, min_lr=0.1)
    assert [s(i) for i in (0, 5, 10)] == [0.0, 0.5, 1.0]
    assert_close(s(60), 0.55, rtol=1e-15, what="half-way")        # (lr + min_lr) / 2
    assert_close(s(35), 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)), rtol=1e-15, what="q")
    assert s(110) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)
    values = [s(i) for i in range(10, 111)]
    assert all(a >= b for a, b in zip(values, values[1:]))     # decreasing after warm-up


def test_constant_schedule_and_factory():
    s = constant_schedule(0.3, warmup_steps=3)
    assert [s(i) for i in range(5)] == pytest.approx([0.0, 0.1, 0.2, 0.3, 0.3])
    assert make_lr_schedule("constant", 0.3, 100)(0) == 0.3
    assert make_lr_schedule("cosine", 0.3, 100)(0) == 0.3
    with pytest.raises(ValueError, match="unknown schedule 'linear'"):
        make_lr_schedule("linear", 0.3, 100)
    with pytest.raises(ValueError, match="min_lr"):
        cosine_schedule(0.1, 10, min_lr=0.2)


# -- under MPI: every layout against single -----------------------------------------------------
def layouts(n):
    """dp, tp and dp+tp layouts over n ranks (dp+tp needs n >= 4, even)."""
    out = [f"dp={n}", f"tp={n}"]
    if n >= 4 and n % 2 == 0:
        out.append(f"dp=2,tp={n // 2}")
    return out


def problem(seed=0, steps=1):
    model = ms.MLP(DIMS, activation="tanh")
    rng = np.random.default_rng(seed + 7)
    batches = [(rng.standard_normal((BATCH, DIMS[0])), rng.standard_normal((BATCH, DIMS[-1])))
               for _ in range(steps)]
    return model, model.init(seed), batches


def fresh(model, params, layout):
    if layout == "single":
        e = ms.SingleDevice(model)
    else:
        e = ms.make_engine(model, layout, comm=world())
    e.load_checkpoint(params)
    return e


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("factor", [0.3, 5.0])
def test_clip_norm_matches_single_on_every_layout(factor):
    model, params, [(x, t)] = problem()
    ref = fresh(model, params, "single")
    _, g_ref = ref.train_step(x, t, ms.losses.MSE())
    full = {k: v.copy() for k, v in g_ref.items()}
    total = math.sqrt(sum(float((g ** 2).sum()) for g in full.values()))
    coef = min(1.0, factor * total / (total + 1e-6))
    for layout in ["single"] + layouts(world().Get_size()):
        e = fresh(model, params, layout)
        _, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.MSE())
        norm = clip_grad_norm(e, grads, max_norm=factor * total)
        assert_close(norm, total, what=f"{layout} norm")
        norms = world().allgather(norm)
        assert all(v == norms[0] for v in norms), f"{layout}: norms differ by rank {norms}"
        assert_dicts_close(e.gather_grads(grads), {k: v * coef for k, v in full.items()},
                           what=f"{layout} clipped grads")


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_n_steps_match_single_with_sharded_state(kind):
    steps = 6
    model, params, batches = problem(seed=1, steps=steps)

    def train(layout):
        e = fresh(model, params, layout)
        opt = AdamW(e, 0.02, weight_decay=0.1) if kind == "adamw" else \
            SGD(e, 0.1, momentum=0.9, weight_decay=0.01)
        for x, t in batches:
            _, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.MSE())
            clip_grad_norm(e, grads, max_norm=0.5)
            opt.step(grads)
        return e, opt

    ref, ref_opt = train("single")
    key = "exp_avg_sq" if kind == "adamw" else "momentum_buffer"
    for layout in layouts(world().Get_size()):
        e, opt = train(layout)
        assert_dicts_close(e.gather_params(), ref.params, what=f"{layout} {kind} params")
        for name, p, _, _ in e.optimizer_shards():      # state shaped like the local block
            assert opt.state[name][key].shape == p.shape, (layout, name)
        state = e.gather_grads({n: opt.state[n][key] for n in e.params})   # gathered like params
        assert_dicts_close(state, {n: ref_opt.state[n][key] for n in ref.params},
                           what=f"{layout} {key}")

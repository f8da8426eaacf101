"""The loss on the answers only: targets masked with ignore_index (-100) on every layout, the
mean taken over the counted targets of the whole global batch (train_step's `count`), in
float64 (rtol 1e-9) against the single-device reference: loss and every gradient.

The mask is uneven on purpose: some rows count nothing at all, so the data-parallel and cp
ranks count different numbers of targets and a mean of per-rank means would differ from
single (test_count_none_is_a_mean_of_rank_means shows it does). Gradient accumulation with
one count for both micro-steps equals the whole batch at once.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/parallel/test_masked_loss.py` for N in 1, 2, 4, 8.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, single_reference
from test_gpt_engine import make_case

CE = ms.losses.CrossEntropy()


def gpt(n_layers=2, tied=False):
    return ms.GPT(vocab_size=17, seq_len=8, d_model=16, n_heads=4, n_layers=n_layers, d_ff=32,
                  tied=tied)


def llama(n_layers=2, tied=False):
    return ms.Llama(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=n_layers,
                    n_kv_heads=2, d_ff=24, rope_theta=500.0, tied=tied)


def mixtral():
    return ms.Llama(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=2, n_kv_heads=2,
                    d_ff=24, n_experts=4, top_k=2, capacity_factor=None)


MODELS = {"gpt": gpt, "llama": llama, "mixtral": mixtral}


def masked_case(model, rows=8, T=8, seed=3):
    """(params, x, t) with about 40% of the targets -100, rows 1 and 6 wholly masked, and the
    first half of every row (a 'prompt') masked in rows 0-3."""
    params, x, t = make_case(model, rows, T, seed)
    rng = np.random.default_rng(seed + 1)
    t = np.where(rng.random(t.shape) < 0.4, -100, t)
    t[[1, 6]] = -100
    t[:4, :T // 2] = -100
    return params, x, t


def check_masked(comm, layout, kind="gpt", **kw):
    model = MODELS[kind](**kw)
    params, x, t = masked_case(model)
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    t_local = engine.shard_batch(t)
    count = engine.count_targets(t_local)
    assert count == int((t != -100).sum())
    value, grads = engine.train_step(engine.shard_batch(x), t_local, CE, count=count)
    what = f"{kind} {layout} {kw}"
    assert_close(value, ref_loss, what=f"{what} loss")
    assert_dicts_close(engine.gather_grads(grads), ref_grads, what=what)


LAYOUTS = [  # (ranks, layout, model, kw)
    (1, "single", "gpt", {}),
    (2, "dp=2", "gpt", {}), (2, "tp=2", "gpt", {}), (2, "tp=2,sequence_parallel=1", "gpt", {}),
    (2, "tp=2", "gpt", {"tied": True}), (2, "cp=2", "gpt", {}),
    (2, "cp=2,cp_kind=ulysses", "gpt", {}), (2, "pp=2", "gpt", {}),
    (2, "pp=2,schedule=1f1b,microbatches=4", "gpt", {}), (2, "fsdp=2,zero=3", "gpt", {}),
    (2, "dp=2", "llama", {}), (2, "tp=2", "llama", {}), (2, "cp=2", "llama", {}),
    (2, "cp=2,cp_kind=ulysses", "llama", {}), (2, "pp=2,schedule=1f1b", "llama", {}),
    (2, "ep=2", "mixtral", {}), (2, "dp=2", "mixtral", {}),
    (4, "dp=2,tp=2", "gpt", {}), (4, "dp=2,cp=2", "gpt", {}), (4, "dp=2,pp=2", "llama", {}),
    (4, "tp=2,pp=2,schedule=1f1b", "gpt", {}), (4, "cp=2,tp=2", "llama", {}),
    (4, "fsdp=2,tp=2,zero=3,sequence_parallel=1", "gpt", {}),
    (8, "dp=2,tp=2,pp=2,sequence_parallel=1", "gpt", {}), (8, "dp=2,cp=2,tp=2", "llama", {})]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("ranks,layout,kind,kw", LAYOUTS,
                         ids=[f"{n}-{lay}-{k}-{kw}" for n, lay, k, kw in LAYOUTS])
def test_masked_loss_equals_single(ranks, layout, kind, kw):
    check_masked(group_comm(ranks), layout, kind, **kw)


@pytest.mark.mpi(min_size=2)
def test_count_none_is_a_mean_of_rank_means():
    """Without count each dp rank averages its own counted targets: not the global mean."""
    model = gpt()
    params, x, t = masked_case(model)
    engine = ms.make_engine(model, "dp=2", comm=group_comm(2))
    engine.load_checkpoint(params)
    value, _ = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
    _, ref_loss, _ = single_reference(model, params, x, t, CE)
    assert abs(value - ref_loss) > 1e-6 * abs(ref_loss)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["dp=2", "pp=2,schedule=1f1b"])
def test_accumulation_with_one_count(layout):
    """Two micro-steps, one count for both, grad_scale 1: the whole batch's mean."""
    model = gpt()
    params, x, t = masked_case(model)
    _, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=group_comm(2))
    engine.load_checkpoint(params)
    halves = [(engine.shard_batch(x[i:i + 4]), engine.shard_batch(t[i:i + 4])) for i in (0, 4)]
    count = sum(engine.count_targets(tl) for _, tl in halves)
    total = 0.0
    for i, (xl, tl) in enumerate(halves):
        value, grads = engine.train_step(xl, tl, CE, accumulate=i > 0, sync=i == 1, count=count)
        total += engine.global_mean(value) if i == 0 else value
    assert_close(total, ref_loss, what=f"{layout} accumulated loss")
    assert_dicts_close(engine.gather_grads(grads), ref_grads, what=f"{layout} accumulated")


def test_bad_count_is_refused_before_communication():
    engine = ms.make_engine(gpt(), "single")
    params, x, t = masked_case(gpt())
    engine.load_checkpoint(params)
    for bad in (-1, 2.5, True):
        with pytest.raises(ValueError, match="count must be"):
            engine.train_step(x, t, CE, count=bad)

"""FSDP gradient buckets (parallel/fsdp_buckets.py): fewer reduce-scatters, the same gradients.

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_fsdp_buckets.py

ZeRO-2/3 with bucket_mb=0 reduce-scatter one gradient per call and microbatch; with a small
bucket (524 bytes: two to four of these padded float64 gradients) and with the default 25 MiB
(a whole step's gradients) fewer calls carry the same bytes, and the gradients equal
bucket_mb=0's and single's (float64, rtol 1e-9). The calls equal the cost model's
(fsdp.step_calls), and no rank ever queues more than a bucket (or one larger tensor).
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.costs import rank_costs as costs
from mpishard.parallel import fsdp
from mpishard.parallel.fsdp_buckets import bucket_calls

from conftest import RTOL32, assert_close, assert_dicts_close, group_comm

BATCH = 16
SMALL = 0.0005                   # MiB
CASES = [("fsdp=2", 2, [5, 7, 6, 3]), ("fsdp=4", 4, [5, 7, 6, 3]),
         ("fsdp=8", 8, [5, 7, 6, 3]), ("fsdp=2,tp=2", 4, [5, 6, 4, 3]),
         ("dp=2,fsdp=2", 4, [5, 7, 6, 3]),
         ("fsdp=2,pp=2,microbatches=2,schedule=1f1b", 4, [5, 7, 6, 4, 3]),
         ("dp=2,fsdp=2,pp=2,microbatches=2,schedule=gpipe", 8, [5, 7, 6, 4, 3])]


def problem(dims, seed=0):
    model = ms.MLP(dims, activation="tanh")
    rng = np.random.default_rng(seed + 1)
    return (model, model.init(seed), rng.standard_normal((BATCH, dims[0])),
            rng.standard_normal((BATCH, dims[-1])))


def engine(model, params, layout, n, **options):
    e = ms.make_engine(model, layout, comm=group_comm(n), **options)
    e.load_checkpoint(params)
    return e


def single_grads(model, params, x, t, loss="mse"):
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    return ref.train_step(x, t, loss)[1]


def step(e, x, t, loss="mse"):
    """One train_step: (this rank's gradient copies, calls, bytes)."""
    e.reset_comm_stats()
    _, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), loss)
    return ({k: v.copy() for k, v in grads.items()}, dict(e.comm_calls), dict(e.comm_bytes))


def microbatches(e) -> int:
    return e.layout.option("microbatches", e.layout.size("pp")) if e.layout.size("pp") > 1 else 1


def planned_calls(model, layout, n) -> dict:
    """fsdp's calls per train_step in the cost model, for this rank of the n-rank group."""
    view = costs.rank_view(model, ms.parse_layout(layout), group_comm(n).Get_rank(), 8, BATCH)
    return fsdp.step_calls(view)["train_step"]


def check_buckets(model, params, x, t, base, n, g_ref, loss="mse", rtol=1e-9):
    """bucket_mb=0, SMALL and the default: gradients, calls against the plan and each other."""
    runs = {}
    for mb in (0, SMALL, None):
        layout = base + ("" if mb is None else f",bucket_mb={mb}")
        e = engine(model, params, layout, n)
        grads, calls, sent = step(e, x, t, loss)
        assert_dicts_close(e.gather_grads(grads), g_ref, rtol=rtol, what=f"{layout} vs single")
        plan = planned_calls(model, layout, n)
        assert calls.get("reduce_scatter", 0) == plan["reduce_scatter"], (layout, calls, plan)
        assert calls.get("all_gather", 0) == plan["all_gather"], (layout, calls, plan)
        limit = e.access.bucket_bytes
        largest = max(e.layout.size("fsdp") * g.nbytes for g in grads.values())
        assert e.access.buckets.peak_bytes <= max(limit, largest)      # ZeRO-2's promise
        assert not e.access.buckets.queue
        runs[mb] = (grads, calls, sent, e)
    grads0, calls0, sent0, e0 = runs[0]
    # every gradient once per microbatch (a tied GPT's embed/tokens twice)
    tensors = microbatches(e0) * len(model.grad_order(list(e0.params)))
    rs = {mb: r[1]["reduce_scatter"] for mb, r in runs.items()}
    if e0.comm.mesh.coords["fsdp"] == 0:
        print(f"{base}: reduce_scatter calls per step ({tensors} gradients over "
              f"{microbatches(e0)} microbatch(es)): bucket_mb=0 {rs[0]}, {SMALL} {rs[SMALL]}, "
              f"default {rs[None]}")
    assert rs[0] == tensors and rs[SMALL] < tensors and rs[None] == 1, rs
    for mb, (grads, calls, sent, _) in runs.items():
        assert sent["reduce_scatter"] == pytest.approx(sent0["reduce_scatter"], rel=1e-12)
        for name in grads0:
            assert_close(grads[name], grads0[name], rtol=1e-12,
                         what=f"{base} bucket_mb={mb} vs 0 {name}")
    return runs


# -- (a) buckets: fewer calls, the same gradients ------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("base,n,dims", CASES)
def test_buckets_fewer_calls_same_gradients(base, n, dims, zero):
    model, params, x, t = problem(dims)
    check_buckets(model, params, x, t, f"{base},zero={zero}", n, single_grads(model, params, x, t))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,tied", [("fsdp=2,zero=3", False), ("fsdp=2,zero=3", True),
                                         ("fsdp=2,zero=2", True),
                                         ("fsdp=2,zero=3,recompute=1", False)])
def test_gpt_buckets(layout, tied):
    """A GPT's gradients bucket the same way (a tied head adds embed/tokens twice); its first
    unit, the embedding, gets nothing in its backward, and the all_gather calls equal the plan's
    gets (no gather wasted)."""
    model = ms.GPT(vocab_size=13, seq_len=8, d_model=6, n_heads=2, n_layers=2, tied=tied)
    rng = np.random.default_rng(5)
    x, t = (rng.integers(0, 13, (BATCH, 8)) for _ in range(2))
    params = model.init(seed=1)
    check_buckets(model, params, x, t, layout, 2,
                  single_grads(model, params, x, t, "cross_entropy"), loss="cross_entropy")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [2, 3])
@pytest.mark.parametrize("base,n", [("fsdp=2", 2), ("dp=2,fsdp=2", 4),
                                    ("fsdp=2,pp=2,microbatches=2", 4)])
def test_bucketed_accumulation(base, n, zero):
    """Two micro-steps (sync=False, then accumulate=True): each backward sends its last bucket
    (nothing left queued, no dp all-reduce before the sync); the sum equals single's."""
    dims = [5, 7, 6, 4, 3]
    model, params, x, t = problem(dims)
    g_ref = single_grads(model, params, x, t)
    e = engine(model, params, f"{base},zero={zero},bucket_mb={SMALL}", n)
    xl, tl = e.shard_batch(x), e.shard_batch(t)
    half = xl.shape[0] // 2
    e.reset_comm_stats()
    e.train_step(xl[:half], tl[:half], "mse", grad_scale=0.5, sync=False)
    assert not e.access.buckets.queue
    assert e.comm_calls["reduce_scatter"] > 0 and e.comm_bytes["all_reduce"] == 0
    _, grads = e.train_step(xl[half:], tl[half:], "mse", grad_scale=0.5, accumulate=True)
    assert_dicts_close(e.gather_grads(grads), g_ref, what=f"{base},zero={zero} accumulated")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("zero", [2, 3])
def test_buckets_under_bfloat16_comm(zero):
    """comm_dtype=bfloat16: a bucket travels as one all_to_all of 16-bit words with the fp32
    sum element by element, so its slices are bitwise bucket_mb=0's, in fewer calls."""
    model, params, x, t = problem([5, 7, 6, 3])
    got = {}
    for mb in (0, SMALL):
        e = engine(model, params, f"fsdp=2,zero={zero},bucket_mb={mb}", 2, dtype=np.float32,
                   comm_dtype="bfloat16")
        got[mb] = step(e, x, t)
    (g0, c0, b0), (g1, c1, b1) = got[0], got[SMALL]
    assert c1["all_to_all"] < c0["all_to_all"] == len(g0) and b1 == b0
    for name in g0:
        assert np.array_equal(g1[name], g0[name]), name
    assert_dicts_close(g1, g0, rtol=RTOL32, what="bfloat16 buckets")


def test_bucket_calls_rule():
    """The cost model's count: the queue goes first when the next does not fit; full flushes."""
    assert bucket_calls([], 10) == 0
    assert bucket_calls([4, 4, 4], 1) == 3                     # bucket_mb=0: one per tensor
    assert bucket_calls([4, 4, 4], 8) == 2                     # [4 4] full, [4] at the end
    assert bucket_calls([4, 5, 4], 8) == 3
    assert bucket_calls([20, 1, 1], 8) == 2                    # a large one alone, then [1 1]
    assert bucket_calls([4, 4, 4] * 2, 100) == 1

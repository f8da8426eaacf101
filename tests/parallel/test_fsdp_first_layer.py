"""ZeRO-3 gathers no weight in the backward of the model's first layer (no dx is needed there).

    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi \
        tests/parallel/test_fsdp_first_layer.py

dW = x^T dy needs x and dy, not W, and nothing uses the gradient of the model input, so layer 0
(on pipeline stage 0) gets its weight only for the forward. Against the same engine made to
compute that dx (what it did before: gather W0 in the backward), a step all-gathers exactly
layer 0's gathered weight bytes less per microbatch and one call less, with bitwise the same
gradients (and single's within float64 rtol 1e-9); the bytes equal costs.step_comm's, and
prefetch=1 prefetches nothing it then drops.
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.costs import rank_costs as costs

from conftest import assert_dicts_close, group_comm

BATCH = 16


def problem(dims, seed=0):
    model = ms.MLP(dims, activation="tanh")
    rng = np.random.default_rng(seed + 1)
    return (model, model.init(seed), rng.standard_normal((BATCH, dims[0])),
            rng.standard_normal((BATCH, dims[-1])))


def engine(model, params, layout, n):
    e = ms.make_engine(model, layout, comm=group_comm(n))
    e.load_checkpoint(params)
    return e


def step(e, x, t):
    """One train_step: (this rank's gradient copies, calls, bytes)."""
    e.reset_comm_stats()
    _, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), "mse")
    return ({k: v.copy() for k, v in grads.items()}, dict(e.comm_calls), dict(e.comm_bytes))


SKIP_CASES = [("fsdp=2", 2, [5, 7, 6, 3]), ("fsdp=4", 4, [5, 7, 6, 3]),
              ("fsdp=2,tp=2", 4, [5, 6, 4, 3]), ("dp=2,fsdp=2", 4, [5, 7, 6, 3]),
              ("fsdp=2,prefetch=1", 2, [5, 7, 6, 3]),
              ("fsdp=2,pp=2,microbatches=2,schedule=1f1b", 4, [5, 7, 6, 4, 3])]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("base,n,dims", SKIP_CASES)
def test_zero3_skips_layer0_backward_gather(base, n, dims):
    model, params, x, t = problem(dims)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    g_ref = ref.train_step(x, t, "mse")[1]
    new, old = engine(model, params, base, n), engine(model, params, base, n)
    first = [layer for layer in old.layers if getattr(layer, "w_name", "") == "layer_0/weights"]
    for layer in first:
        layer.need_dx = True              # as before: gather W0 for a dx nobody uses
    for _ in range(2):                    # (prefetch=1 learns its plans in the first step)
        g_new, c_new, b_new = step(new, x, t)
        g_old, c_old, b_old = step(old, x, t)
    m = new.layout.option("microbatches", 2) if new.layout.size("pp") > 1 else 1
    holds = "layer_0/weights" in new.params
    shard = new.params["layer_0/weights"].nbytes if holds else 0
    fsdp_n = new.layout.size("fsdp")
    saved = b_old["all_gather"] - b_new["all_gather"]
    print(f"{base} rank {new.device_id}: all_gather per step {b_old['all_gather']:g} -> "
          f"{b_new['all_gather']:g} bytes, {c_old['all_gather']} -> {c_new['all_gather']} "
          f"calls (layer 0 held: {holds})")
    assert saved == m * (fsdp_n - 1) * shard                 # exactly W0's gathered bytes
    assert c_old["all_gather"] - c_new["all_gather"] == (m if holds else 0)
    assert b_new.get("reduce_scatter") == b_old.get("reduce_scatter")
    for name in g_new:
        assert np.array_equal(g_new[name], g_old[name]), name
    assert_dicts_close(new.gather_grads(), g_ref, what=f"{base} layer-0 skip")
    want = costs.step_comm(model, ms.parse_layout(base), group_comm(n).Get_rank(),
                           BATCH)["train_step"]
    assert b_new["all_gather"] == want["all_gather"]
    if new.access.prefetcher is not None:
        counts = new.access.prefetcher.counts
        assert counts["issued"] == counts["used"] and counts["wasted"] == 0, counts


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tied", [False, True])
def test_gpt_first_unit_gathers_nothing_in_backward(tied):
    """A GPT's first unit is the embedding, whose backward (a scatter-add of dy) needs no
    table: in one ZeRO-3 step embed/positions is gathered once (forward), embed/tokens once
    (twice more when tied: the head's forward and backward), every other weight twice."""
    model = ms.GPT(vocab_size=13, seq_len=8, d_model=6, n_heads=2, n_layers=2, tied=tied)
    e = engine(model, model.init(seed=1), "fsdp=2,zero=3", 2)
    rng = np.random.default_rng(5)
    x, t = (rng.integers(0, 13, (BATCH, 8)) for _ in range(2))
    gets = {}
    inner = e.access.get

    def counting(name, mb=0):
        gets[name] = gets.get(name, 0) + 1
        return inner(name, mb)
    e.access.get = counting
    e.reset_comm_stats()
    e.train_step(e.shard_batch(x), e.shard_batch(t), "cross_entropy")
    assert gets["embed/positions"] == 1 and gets["embed/tokens"] == (3 if tied else 1)
    assert gets["block_0/attn/qkv/weights"] == 2 and gets["block_0/ln_1/scale"] == 2
    assert e.comm_calls["all_gather"] == sum(gets.values())

"""Padding takes no expert capacity: a Mixtral's prompt gives the same logits and greedy ids
alone and in a batch of longer prompts (left padding of the cached prefill, right padding of a
recomputed window), on single and on ep, tp, pp and dp layouts; an ms.MoE's real rows give the
same output with and without an evaluation chunk's filler rows (nn/moe_routing.valid_tokens).
Every case is chosen so that capacity binds (checked), in float64.

Serial: `pytest tests/integration/test_moe_padding.py -m "not mpi"`.
MPI, N in 1, 2, 4, 8: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi \
    tests/integration/test_moe_padding.py`
"""
from types import SimpleNamespace

import numpy as np
import pytest
from conftest import assert_close, group_comm

import mpishard as ms
from mpishard.nn.layers import LocalAccess
from mpishard.models.llama.moe_units import SparseMoE
from mpishard.nn.moe_routing import group_capacity, route, valid_tokens
from mpishard.parallel.decode import Decoder, _cached_logits, _recomputed_logits
from test_device_double import MODES, device_backend

SHORT = [1, 2, 3]
BATCH = [[4, 5, 6, 7, 8, 9, 10, 11], SHORT, [5, 6, 7, 8, 9, 10], [12, 0, 7, 3, 3, 9, 1]]
ROW = 1                                  # SHORT's row in BATCH
EXACT = 1e-12                            # one layout, other batch shapes: round-off only


def make_mixtral(capacity_factor=0.5):
    return ms.Llama(vocab_size=13, seq_len=16, d_model=16, n_heads=4, n_layers=2, n_kv_heads=2,
                    d_ff=12, rope_theta=500.0, n_experts=4, top_k=2,
                    capacity_factor=capacity_factor)


def mixtral_params(model):
    """Weights 3x init (the norms' scales kept): logits large enough that the drops change
    greedy ids."""
    return {k: v if "ln_" in k else 3.0 * v for k, v in model.init(seed=3).items()}


def logits(engine, rows, cached):
    """(B, V) next-token logits of `rows` as generate computes them, every rank the same."""
    decoder, n = Decoder.of(engine), engine.model.seq_len
    rows = [list(r) for r in rows]
    step = _cached_logits(decoder, rows, n, n, 4) if cached else \
        _recomputed_logits(decoder, rows, n)
    return step(engine.model.vocab_size)


def greedy(engine, rows, **kw):
    return engine.generate([list(r) for r in rows], 6, temperature=0.0, **kw)


def single(model, params):
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    return engine


def close(got, want, rtol, what):
    scale = np.abs(want).max()
    err = np.abs(got - want).max()
    print(f"{what}: max |diff| {err:.3g} (logits up to {scale:.3g})")
    assert err <= rtol * scale, f"{what}: max |diff| {err:.3g} > {rtol} x {scale:.3g}"


# -- routing ---------------------------------------------------------------------------------------
def test_padding_has_no_place_in_the_queue_and_the_capacity_is_the_real_tokens():
    """A group of 8 slots, 3 of them padding, routes its 5 real tokens as the 5 alone do."""
    rng = np.random.default_rng(0)
    probs = rng.dirichlet(np.ones(4), size=16)
    valid = np.ones(16, dtype=bool)
    valid[[0, 1, 5, 8]] = False                    # group 0: 3 padded slots, group 1: 1

    def capacity_of(n):
        return int(np.ceil(0.5 * n * 2 / 4))
    capacity = group_capacity(capacity_of, valid, 2, 16)
    assert capacity.tolist() == [capacity_of(5), capacity_of(7)]
    experts, keep = route(probs, 2, 2, capacity, valid)
    assert not keep[~valid].any()
    for g in range(2):
        real = np.flatnonzero(valid[8 * g:8 * g + 8]) + 8 * g
        want_e, want_k = route(probs[real], 2, 1, capacity_of(len(real)))
        np.testing.assert_array_equal(experts[real], want_e)
        np.testing.assert_array_equal(keep[real], want_k)
    assert group_capacity(capacity_of, None, 2, 16) == capacity_of(8)


def test_padding_counts_neither_in_the_statistics_nor_in_the_aux_loss():
    model = make_mixtral()
    rng = np.random.default_rng(1)
    params = {k: rng.standard_normal(v) for k, v in model.mlp_param_shapes(0).items()}
    access = LocalAccess(SimpleNamespace(params=params, grads={}))
    seen = {}
    unit = SparseMoE(model, access, 0, record=lambda i, e, k, c: seen.update(record=(e, k, c)))
    unit.aux = _Aux(seen)
    x = rng.standard_normal((2, 5, 16))
    valid = np.array([[False, False, True, True, True], [True] * 5])
    with valid_tokens([[unit]], valid):
        unit.forward(x)
    experts, kept, capacity = seen["record"]
    assert experts.shape == kept.shape == (8, 2) and capacity == 2     # ceil(0.5 * 5 * 2 / 4)
    assert seen["aux"][0].shape == (8, 2) and seen["aux"][1].shape == (8, 4)
    assert unit.valid is None, "valid_tokens restores the unit"
    with pytest.raises(ValueError, match=r"valid tokens of shape \(2, 4\).*\(2, 5\)"):
        with valid_tokens([[unit]], valid[:, :4]):
            unit.forward(x, record=False)


class _Aux:
    def __init__(self, seen):
        self.seen = seen

    def add(self, mb, index, experts, probs):
        self.seen["aux"] = (experts, probs)


# -- a Mixtral prompt alone and in a batch ---------------------------------------------------------
@pytest.mark.parametrize("cached", [True, False], ids=["cached", "recomputed"])
def test_a_prompt_gives_the_same_logits_alone_and_in_a_batch(cached):
    model = make_mixtral()
    params = mixtral_params(model)
    engine = single(model, params)
    alone = logits(engine, [SHORT], cached)[0]
    close(logits(engine, BATCH, cached)[ROW], alone, EXACT, f"single cached={cached}")
    free = single(make_mixtral(None), params)
    assert np.abs(logits(free, [SHORT], cached)[0] - alone).max() > 1e-2, \
        "capacity must bind in this case"


def test_a_prompt_gives_the_same_greedy_ids_alone_and_in_a_batch():
    engine = single(make_mixtral(), mixtral_params(make_mixtral()))
    for kw in ({}, {"kv_cache": False}):
        assert greedy(engine, BATCH, **kw)[ROW] == greedy(engine, [SHORT], **kw)[0], kw


MIXTRAL_LAYOUTS = [("ep=2", 2), ("tp=2", 2), ("pp=2", 2), ("ep=2,tp=2", 4), ("dp=2,ep=2", 4)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,n", MIXTRAL_LAYOUTS, ids=[lay for lay, _ in MIXTRAL_LAYOUTS])
def test_a_prompt_in_a_batch_on_a_layout_equals_single_alone(layout, n):
    model = make_mixtral()
    params = mixtral_params(model)
    ref = single(model, params)
    engine = ms.make_engine(model, layout, comm=group_comm(n))
    engine.load_checkpoint(params)
    for cached in (True, False):
        close(logits(engine, BATCH, cached)[ROW], logits(ref, [SHORT], cached)[0], 1e-9,
              f"{layout} cached={cached}")
    assert greedy(engine, BATCH)[ROW] == greedy(ref, [SHORT])[0]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
def test_padding_masks_on_device_arrays(mode):
    """On the strict stand-in for cupy (a stray np. call on a device array raises): the masks
    reach the host routing from device arrays; the numbers are numpy single's."""
    comm = group_comm(1)
    model = make_mixtral()
    params = mixtral_params(model)
    backend, _ = device_backend(comm, mode)
    engine = ms.make_engine(model, "single", comm=comm, device=backend)
    engine.load_checkpoint(params)
    ref = single(model, params)
    for cached in (True, False):
        close(logits(engine, BATCH, cached)[ROW], logits(ref, [SHORT], cached)[0], EXACT,
              f"device {mode} cached={cached}")
    moe = make_moe()
    moe_params, _, chunk, valid = moe_case(moe)
    engine = ms.make_engine(moe, "single", comm=comm, device=backend)
    engine.load_checkpoint(moe_params)
    with valid_tokens(engine.chunks, engine.shard_batch(valid)):
        got = backend.to_host(engine.predict(engine.shard_batch(chunk)))
    ref = single(moe, moe_params)
    with valid_tokens(ref.chunks, valid):
        want = ref.predict(chunk)
    close(got, want, EXACT, f"ms.MoE device {mode}")


# -- an ms.MoE evaluation chunk ----------------------------------------------------------------
def make_moe(groups=None):
    return ms.MoE(6, 8, 4, top_k=2, capacity_factor=1.0, groups=groups)


def moe_case(model):
    """Parameters favouring expert 0 (capacity binds), 6 real rows and the chunk of 8 that
    data.eval_chunks makes of them (rows 0 and 1 repeated), with its mask."""
    params = model.init(seed=1)
    params["router/weights"][:, 0] += 1.0
    x = np.random.default_rng(2).normal(size=(6, 6)) + 1.0
    chunk = x[np.arange(8) % 6]
    return params, x, chunk, np.arange(8) < 6


def test_moe_filler_rows_take_no_capacity():
    model = make_moe()
    params, x, chunk, valid = moe_case(model)
    engine = single(model, params)
    alone = engine.predict(x)
    unmasked = engine.predict(chunk)
    with valid_tokens(engine.chunks, valid):
        padded = engine.predict(chunk)
    assert engine.stats["moe_dropped"] > 0 and sum(engine.stats["moe_routed"]) == 6 * 2
    close(padded[:6], alone, EXACT, "ms.MoE real rows")
    assert not padded[6:].any(), "padding routes to no expert"
    assert np.abs(unmasked[:6] - alone).max() > 1e-2, "capacity must bind in this case"


MOE_LAYOUTS = [("ep=2", 2), ("dp=2", 2), ("dp=2,ep=2", 4)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,n", MOE_LAYOUTS, ids=[lay for lay, _ in MOE_LAYOUTS])
def test_moe_filler_rows_on_a_layout_equal_single(layout, n):
    """Each rank masks its own rows of the chunk; `groups` = the data ranks, so single cuts
    the same capacity groups."""
    model = make_moe(groups=n)
    params, _, chunk, valid = moe_case(model)
    ref = single(model, params)
    with valid_tokens(ref.chunks, valid):
        want = ref.predict(chunk)
    engine = ms.make_engine(model, layout, comm=group_comm(n))
    engine.load_checkpoint(params)
    with valid_tokens(engine.chunks, engine.shard_batch(valid)):
        got = engine.gather_batch(engine.predict(engine.shard_batch(chunk)))
    assert_close(got, want, what=f"ms.MoE {layout} padded chunk")
    assert engine.stats["moe_routed"] == ref.stats["moe_routed"]
    assert sum(engine.stats["moe_routed"]) == 6 * 2

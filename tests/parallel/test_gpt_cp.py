"""Context parallelism for GPT (parallel/context_parallel.py): ring attention and Ulysses.

Serial: the balanced chunk split and its inverse, the ring's chunk pairs, the refusals. MPI:
every cp layout equals single in float64 (rtol 1e-9): logits via gather_batch(predict), the
loss and every gradient; the attention-score memory and the ring's bytes at cp=4, measured.

`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_gpt_cp.py`,
N in 1, 2,
4, 8 (a k-rank layout runs on `group_comm(k)`, several groups side by side).
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import group_comm
from mpishard.comm.mesh import coordinates, parse_layout
from mpishard.parallel.compose import plan_params
from mpishard.parallel.context_parallel import RingAttention, ring_bytes, visible_pairs
from mpishard.parallel.sequence_split import (chunk_ids, sequence_part, to_global_order,
                                              to_rank_order)
from test_gpt_engine import compare_with_single
from test_gpt_nn import perturbed

CE = ms.losses.CrossEntropy()


def make_gpt(n_heads=2, n_layers=2, tied=False, seq_len=16):
    return ms.GPT(vocab_size=12, seq_len=seq_len, d_model=16, n_heads=n_heads,
                  n_layers=n_layers, tied=tied)


def check_against_single(comm, layout, n_heads=2, n_layers=2, tied=False, T=16, rows=4):
    """test_gpt_engine.compare_with_single on a (rows, T) batch; returns the engine."""
    model = make_gpt(n_heads, n_layers, tied)
    rng = np.random.default_rng(3)
    params = perturbed(model, 3, rng)
    x = rng.integers(0, model.vocab_size, (rows, T))
    t = rng.integers(0, model.vocab_size, (rows, T))
    engine = compare_with_single(comm, layout, model, params, x, t,
                                 f"GPT {layout} tied={tied} T={T}")
    c = engine.layout.size("cp")
    assert engine.shard_batch(x).shape == (rows // engine.data_parallel_size, T // c)
    return engine


# -- serial: the split, the pairs, the refusals ----------------------------------------------------
@pytest.mark.parametrize("c", [1, 2, 3, 4])
def test_balanced_split_and_its_inverse(c):
    x = np.arange(3 * 8 * c).reshape(3, 8 * c)
    parts = [sequence_part(x, c, r) for r in range(c)]
    n = 4
    for r, part in enumerate(parts):            # rank r: chunks r and 2c-1-r, in that order
        want = np.concatenate([x[:, g * n:(g + 1) * n] for g in (r, 2 * c - 1 - r)], axis=1)
        np.testing.assert_array_equal(part, want)
    rank_order = np.concatenate(parts, axis=1)  # what an all_gather over cp returns
    np.testing.assert_array_equal(to_global_order(rank_order, 1, c), x)
    np.testing.assert_array_equal(to_rank_order(x, 1, c), rank_order)


def test_sequence_part_refuses_lengths_that_do_not_split():
    with pytest.raises(ValueError, match="T=12 does not divide by 8"):
        sequence_part(np.zeros((2, 12), dtype=np.int64), 4, 0)
    with pytest.raises(ValueError, match=r"\(batch, T, \.\.\.\)"):
        sequence_part(np.zeros(8), 2, 0)


@pytest.mark.parametrize("c", [2, 3, 4])
def test_ring_pairs_cover_the_causal_mask_once(c):
    """Over the c blocks of the ring, rank r's pairs see each key position <= each of its
    query positions exactly once, and no future key."""
    n = 3
    for r in range(c):
        seen = np.zeros((2 * n, 2 * c * n), dtype=int)         # local query x global key
        for s in range(c):
            for qi, ki, offset in visible_pairs(r, s, c, n):
                q0, k0 = chunk_ids(r, c)[qi] * n, chunk_ids(s, c)[ki] * n
                qpos = q0 + np.arange(n)[:, None]
                kpos = k0 + np.arange(n)[None, :]
                mask = np.ones((n, n), bool) if offset is None else kpos - k0 <= qpos - q0 + \
                    offset
                assert offset is None or offset == 0, "balanced chunks: diagonal or none"
                seen[qi * n:(qi + 1) * n, k0:k0 + n] += mask
        qpos = np.concatenate([g * n + np.arange(n) for g in chunk_ids(r, c)])
        want = (np.arange(2 * c * n)[None, :] <= qpos[:, None]).astype(int)
        np.testing.assert_array_equal(seen, want)


def test_cp_axis_sits_between_pp_and_tp():
    lay = parse_layout("dp=2,pp=2,cp=2,tp=2")
    assert [coordinates(lay, r)["tp"] for r in range(4)] == [0, 1, 0, 1]
    assert [coordinates(lay, r)["cp"] for r in range(4)] == [0, 0, 1, 1]
    assert coordinates(lay, 4)["pp"] == 1


@pytest.mark.parametrize("layout,model,match", [
    ("cp=2,cp_kind=ulysses", make_gpt(n_heads=1), "1 heads per tp rank over cp=2"),
    ("cp=4,cp_kind=ulysses", make_gpt(n_heads=2), "2 heads per tp rank over cp=4"),
    ("cp=2", ms.MLP([4, 8, 2]), "only a decoder"),
    ("tp=2,cp=2,cp_kind=ulysses", make_gpt(n_heads=2), "1 heads per tp rank over cp=2"),
])
def test_layouts_that_do_not_fit_are_refused(layout, model, match):
    with pytest.raises(ValueError, match=match):
        plan_params(model, ms.parse_layout(layout))


def test_cp_kind_needs_cp():
    with pytest.raises(ValueError, match="cp_kind"):
        parse_layout("dp=2,cp_kind=ring")
    with pytest.raises(ValueError, match="not one of"):
        parse_layout("cp=2,cp_kind=star")


# -- every cp layout against single ----------------------------------------------------------------
TWO = [("cp=2", {}), ("cp=2", {"tied": True}), ("cp=2", {"T": 8}),
       ("cp=2,cp_kind=ring", {"n_heads": 4, "T": 12}),
       ("cp=2,cp_kind=ulysses", {}), ("cp=2,cp_kind=ulysses", {"tied": True, "T": 4}),
       ("cp=2,cp_kind=ulysses", {"n_heads": 4})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw}" for lay, kw in TWO])
def test_two_rank_cp_layouts_equal_single(layout, kw):
    check_against_single(group_comm(2), layout, **kw)


FOUR = [("cp=4", {}), ("cp=4", {"tied": True, "T": 8}),
        ("cp=4,cp_kind=ulysses", {"n_heads": 4}),
        ("cp=4,cp_kind=ulysses", {"n_heads": 4, "tied": True}),
        ("dp=2,cp=2", {}), ("dp=2,cp=2", {"tied": True}),
        ("dp=2,cp=2,cp_kind=ulysses", {}), ("dp=2,cp=2,overlap=1", {}),
        ("cp=2,pp=2", {}), ("cp=2,pp=2,schedule=1f1b,microbatches=2", {}),
        ("cp=2,pp=2,schedule=interleaved,cp_kind=ulysses", {"n_layers": 4}),
        ("fsdp=2,cp=2", {}), ("fsdp=2,cp=2", {"tied": True}),
        ("fsdp=2,cp=2,zero=1", {}), ("fsdp=2,cp=2,zero=3,prefetch=1,cp_kind=ulysses", {}),
        ("tp=2,cp=2", {}), ("tp=2,cp=2", {"tied": True}),
        ("tp=2,cp=2,cp_kind=ulysses", {"n_heads": 4}),
        ("tp=2,cp=2,sequence_parallel=1", {}), ("tp=2,cp=2,pp=1", {"T": 8})]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw}" for lay, kw in FOUR])
def test_four_rank_cp_layouts_equal_single(layout, kw):
    check_against_single(group_comm(4), layout, **kw)


EIGHT = [("cp=8", {}), ("dp=2,cp=4", {"tied": True}), ("dp=2,fsdp=2,cp=2", {}),
         ("dp=2,cp=2,pp=2,schedule=1f1b", {}), ("fsdp=2,cp=4,cp_kind=ulysses", {"n_heads": 4}),
         ("dp=2,tp=2,cp=2", {}), ("dp=2,tp=2,cp=2", {"tied": True}),
         ("fsdp=2,cp=2,tp=2", {}), ("fsdp=2,cp=2,tp=2,cp_kind=ulysses", {"n_heads": 4}),
         ("tp=2,cp=2,pp=2,sequence_parallel=1", {})]


@pytest.mark.mpi(min_size=8)
@pytest.mark.parametrize("layout,kw", EIGHT, ids=[f"{lay}-{kw}" for lay, kw in EIGHT])
def test_eight_rank_cp_layouts_equal_single(layout, kw):
    check_against_single(group_comm(8), layout, **kw)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["cp=4", "dp=2,cp=2"])
def test_shard_and_gather_batch_round_trip(layout):
    engine = ms.make_engine(make_gpt(), layout, comm=group_comm(4))
    x = np.arange(4 * 16).reshape(4, 16)
    np.testing.assert_array_equal(engine.gather_batch(engine.shard_batch(x)), x)
    with pytest.raises(ValueError, match="T=6 does not divide"):
        engine.shard_batch(np.zeros((4, 6), dtype=np.int64))


@pytest.mark.mpi(min_size=4)
def test_ring_memory_and_bytes_at_cp4():
    """cp=4: the largest attention-score block a rank builds is (B, H, T/8, T/8), 1/64 of
    single's (B, H, T, T) (at most 1/4 required); the ring sends what ring_bytes says."""
    rows, T, heads, layers = 4, 16, 2, 2
    engine = check_against_single(group_comm(4), "cp=4", n_heads=heads, n_layers=layers, T=T,
                                  rows=rows)
    rings = [u for layer in engine.layers for u in walk(layer) if isinstance(u, RingAttention)]
    assert len(rings) == layers
    single_scores = rows * heads * T * T
    peak = max(u.peak_scores for u in rings)
    print(f"cp=4 largest score block {peak} elements vs single's {single_scores} "
          f"(ratio {peak / single_scores:.4f})")
    assert peak * 4 <= single_scores and peak == rows * heads * (T // 8) ** 2
    rng = np.random.default_rng(0)
    x = rng.integers(0, 12, (rows, T))
    engine.reset_comm_stats()
    engine.train_step(engine.shard_batch(x), engine.shard_batch(np.roll(x, -1, 1)), CE)
    sent = engine.comm_bytes.get("send", 0)
    want = ring_bytes(rows, T, 16, 4, 8)
    print(f"cp=4 ring bytes sent per train_step per rank: {sent} "
          f"(forward {want['forward'] * layers}, backward {want['backward'] * layers})")
    assert sent == (want["forward"] + want["backward"]) * layers


def walk(layer):
    yield layer
    for u in getattr(layer, "units", ()):
        yield from walk(u)

"""ms.Llama under context parallelism: ring attention (rotary angles from each chunk's global
positions, the zigzag chunks of sequence_split.py) and Ulysses, alone and with dp, tp
(kv heads split and replicated), pp, recompute and a tied head, against single in float64
(rtol 1e-9): loss, every gathered gradient, gathered logits and parameters.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_llama_cp.py`
for N in 1, 2, 4 (a k-rank layout runs on `group_comm(k)`).
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import group_comm
from mpishard.models.llama.attention import Rotary, rope_angles
from mpishard.parallel.sequence_split import TokenPositions
from test_llama_layouts import compare_with_single, make_llama


def test_rotary_under_cp_takes_each_chunks_global_positions():
    """cp=2, T=8: rank 1 holds chunks 1 and 2 (positions 2, 3, 4, 5); its angles are single's
    rows 2..5."""
    full, _ = rope_angles(np, slice(0, 8), 4, 500.0)
    unit = Rotary(1, 1, 4, 500.0, token_positions=TokenPositions(2, 1, 8))
    got, _ = rope_angles(np, unit.token_positions(4), 4, 500.0)
    np.testing.assert_array_equal(got, full[2:6])


TWO = [("cp=2", {}), ("cp=2,cp_kind=ulysses", {}), ("cp=2", {"tied": True, "n_kv_heads": 1}),
       ("cp=2,cp_kind=ulysses,recompute=attn", {"n_kv_heads": 4}), ("cp=2,recompute=1", {})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw}" for lay, kw in TWO])
def test_two_rank_cp_layouts_equal_single(layout, kw):
    compare_with_single(group_comm(2), layout, make_llama(**kw))


FOUR = [("cp=4", {}), ("cp=4,cp_kind=ulysses", {"n_kv_heads": 1}), ("dp=2,cp=2", {}),
        ("tp=2,cp=2", {"n_kv_heads": 1}), ("tp=2,cp=2,cp_kind=ulysses", {}),
        ("cp=2,pp=2", {"tied": True}), ("cp=2,fsdp=2", {})]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw}" for lay, kw in FOUR])
def test_four_rank_cp_layouts_equal_single(layout, kw):
    compare_with_single(group_comm(4), layout, make_llama(**kw))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["cp=2", "cp=2,cp_kind=ulysses", "tp=2,sequence_parallel=1"])
def test_generation_recomputed_under_cp_and_sp_equals_single(layout):
    """No KV cache under cp or sequence_parallel: each step recomputes the window (rotary from
    the chunks' global positions) and the greedy ids equal single's."""
    model = make_llama(seq_len=12)
    params = {k: 6 * v for k, v in model.init(4).items()}
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10]]
    single = ms.SingleDevice(model)
    single.load_checkpoint(params)
    engine = ms.make_engine(model, layout, comm=group_comm(2))
    engine.load_checkpoint(params)
    got = engine.generate(prompts, 8, temperature=0)
    print(f"{layout}: {got}")
    assert got == single.generate(prompts, 8, temperature=0)

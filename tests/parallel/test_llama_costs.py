"""plan/inspect pricing of ms.Llama: the bytes (costs.step_comm) and calls
(comm_calls.step_calls) of one train_step and AdamW step equal what the engine counts on every
rank, under tp with kv heads split and replicated (their gradients' all_reduce), sequence
parallel, cp, pp, fsdp and tied heads.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_llama_costs.py`
for N in 2, 4.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import group_comm
from mpishard.parallel.comm_calls import step_calls
from mpishard.parallel.costs import rank_view
from test_llama_layouts import make_llama
from test_plan_bench import BATCH, check_step_bytes

CASES = [(2, "tp=2", {"n_kv_heads": 1}), (2, "tp=2", {"tied": True}),
         (2, "tp=2,sequence_parallel=1", {"n_kv_heads": 1}), (2, "cp=2", {}),
         (2, "cp=2,cp_kind=ulysses", {"tied": True}), (2, "fsdp=2,zero=3", {"tied": True}),
         (2, "pp=2,recompute=1", {}),
         (4, "tp=4", {}), (4, "tp=2,pp=2", {"n_kv_heads": 1}), (4, "dp=2,tp=2", {}),
         (4, "fsdp=2,tp=2,zero=3", {"n_kv_heads": 1}), (4, "tp=2,cp=2", {"n_kv_heads": 1}),
         (4, "fsdp=2,pp=2,zero=2", {})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout,kw", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_llama_comm_bytes_and_calls_match_the_plan(n, layout, kw):
    comm = group_comm(n)
    model = make_llama(**kw)
    rng = np.random.default_rng(3)
    x, t = (rng.integers(0, model.vocab_size, (BATCH, 8)) for _ in range(2))
    check_step_bytes(comm, model, layout, model.init(seed=1), x, t, "cross_entropy")
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(model.init(seed=1))
    opt = ms.optim.AdamW(engine, lr=1e-3)
    engine.reset_comm_stats()
    opt.step(engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                               "cross_entropy")[1])
    got = {k: v for k, v in engine.comm_calls.items() if v}
    want = step_calls(rank_view(model, engine.layout, comm.Get_rank(), 8, BATCH))
    print(f"{layout} {kw} rank {comm.Get_rank()}: calls {got} (plan {want})")
    assert got == want

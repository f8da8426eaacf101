"""Pricing a Mixtral (ms.Llama with n_experts; models/llama/costs.py): on a balanced batch,
where every rank's tokens split evenly over the experts as uniform routing expects, the plan's
bytes (costs.step_comm: the ep exchange at n k (P-1)/P rows each way, the counts, the routing
statistics, the gradients averaged over ep) and calls (call_counts.step_calls) of one
train_step and AdamW step equal what the engine counts on every rank; rank_memory holds E/ep
experts per rank; step_time prices the experts' GEMMs at P n k / E rows each.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/costs/test_moe_costs.py` for N in 2, 4.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import group_comm
from mpishard.costs.call_counts import step_calls
from mpishard.costs.rank_costs import rank_memory, rank_view
from mpishard.costs.step_time import gemms
from test_plan_bench import BATCH, check_step_bytes

E, T, D = 4, 8, 16


def balanced():
    """(model, params, tokens): token v routes to experts v % E and (v+1) % E in every block
    (attention and the experts' down matrices zero, so the router sees the embedding; the
    embedding's row v is 2 at v % E, 1 at (v+1) % E; the router is the identity on those
    columns), and every row of the batch is 0, 1, ..., E-1 repeated: each rank's n tokens send
    n k / E rows to each expert."""
    model = ms.Llama(vocab_size=13, seq_len=T, d_model=D, n_heads=4, n_layers=2, n_kv_heads=2,
                     d_ff=24, n_experts=E, top_k=2)
    params = model.init(seed=1)
    emb = np.zeros((13, D))
    for v in range(13):
        emb[v, v % E], emb[v, (v + 1) % E] = 2.0, 1.0
    params["embed/tokens"] = emb
    for i in range(2):
        params[f"block_{i}/attn/proj/weights"][:] = 0.0
        params[f"block_{i}/moe/experts/down/weights"][:] = 0.0
        params[f"block_{i}/moe/router/weights"] = np.eye(D, E)
    x = np.tile(np.arange(T) % E, (BATCH, 1))
    return model, params, x


CASES = [(2, "ep=2"), (2, "ep=2,recompute=1"),
         (4, "ep=4"), (4, "dp=2,ep=2"), (4, "ep=2,tp=2"), (4, "ep=2,tp=2,sequence_parallel=1"),
         (4, "ep=2,pp=2"), (4, "fsdp=2,ep=2,zero=3"), (4, "ep=2,cp=2")]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout", CASES, ids=[c[1] for c in CASES])
def test_mixtral_comm_bytes_and_calls_match_the_plan(n, layout):
    comm = group_comm(n)
    model, params, x = balanced()
    t = np.roll(x, -1, axis=1)
    check_step_bytes(comm, model, layout, params, x, t, "cross_entropy")
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    opt = ms.optim.AdamW(engine, lr=1e-3)
    engine.reset_comm_stats()
    opt.step(engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                               "cross_entropy")[1])
    routed = engine.stats["moe_blocks"]
    assert all(len(set(r)) == 1 for r, _ in routed.values()), f"unbalanced: {routed}"
    got = {k: v for k, v in engine.comm_calls.items() if v}
    want = step_calls(rank_view(model, engine.layout, comm.Get_rank(), 8, BATCH))
    print(f"{layout} rank {comm.Get_rank()}: calls {got} (plan {want})")
    assert got == want
    engine.close()


def test_memory_holds_a_rank_s_experts_and_gemms_price_them():
    model, _, _ = balanced()
    one = rank_memory(model, ms.parse_layout("single"), 0)
    two = rank_memory(model, ms.parse_layout("ep=2"), 1)
    assert two["shapes"]["block_0/moe/experts/down/weights"] == (E // 2, 24, D)
    experts = 2 * 3 * E * D * 24 * 8                     # blocks x matrices x E D F x 8 bytes
    assert one["parameters"] - two["parameters"] == experts // 2
    view = rank_view(model, ms.parse_layout("ep=2"), 0, 8, BATCH)
    rows = 2 * (BATCH // 2 * T) * 2 / E              # P n k / E per expert
    assert (2 * rows * D * 24, 3 * (E // 2) * 2 * 3, "gemm") in gemms(view)
    single = rank_view(model, ms.parse_layout("single"), 0, 8, BATCH)
    assert (2 * BATCH * T * 2 / E * D * 24, 3 * E * 2 * 3, "gemm") in gemms(single)


@pytest.mark.mpi(min_size=2)
def test_memory_report_counts_the_dispatch_buffers():
    """The MoE blocks' tapes (received rows, combined slots, the experts' SwiGLU internals,
    n k rows each on the balanced batch) are in activations_peak: top_k=2 holds at least
    blocks x n x (2 D + 4 F) x 8 bytes more than top_k=1 on the same tokens."""
    comm = group_comm(2)
    peaks = []
    for k in (1, 2):
        model, params, x = balanced()
        model = ms.Llama(**{**{a: getattr(model, a) for a in (
            "vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "n_kv_heads", "d_ff",
            "n_experts")}, "top_k": k})
        engine = ms.make_engine(model, "ep=2", comm=comm)
        engine.load_checkpoint(params)
        engine.train_step(engine.shard_batch(x), engine.shard_batch(np.roll(x, -1, 1)),
                          "cross_entropy")
        peaks.append(engine.memory_report()["activations_peak"])
        engine.close()
    n = BATCH // 2 * T
    print(f"activations_peak top_k=1 {peaks[0]}, top_k=2 {peaks[1]}")
    assert peaks[1] - peaks[0] >= 2 * n * (2 * D + 4 * 24) * 8


def test_plan_lists_expert_parallel_layouts_for_a_mixtral():
    from mpishard.cli.plan import candidate_layouts, plan_layouts

    model, _, _ = balanced()
    assert "dp=2,ep=2" in candidate_layouts(4, seq_len=T, n_experts=E)
    assert not any("ep=" in c for c in candidate_layouts(4, seq_len=T))
    assert "ep=3" not in ",".join(candidate_layouts(6, seq_len=T, n_experts=E))
    rows, _ = plan_layouts(model, 4, BATCH)
    by = {r["layout"]: r for r in rows}
    n = BATCH // 4 * T                                      # dp=2,ep=2: 4 data ranks
    assert by["dp=2,ep=2"]["kinds"]["all_to_all"] == \
        2 * (4 * n * 2 / 2 * D * 4 + 1 / 2 * 8 * E)         # blocks x (4 passes + counts)
    assert "all_to_all" not in by["dp=4"]["kinds"]

"""Packed rows under context parallelism: ring and Ulysses attention kept inside each example,
positions restarting per example on the rank's two chunks, for the GPT (learned positions), the
Llama (rotary, grouped kv heads) and the Qwen2 (the Llama's units), with tp, dp, pp, recompute
and cp=4 beside them.

Each layout runs test_packing.check_packed: the packed rows' loss, every gradient and the
logits equal the examples run alone on single, one example per row, in float64 (rtol 1e-9),
both with the masked count= mean. cp=4 needs T divisible by 8: it runs the same check on rows
of 16 tokens. The ring skips the pairs of chunks wholly in the future, and in packed rows also
those whose queries and keys share no document (exact: such a block adds nothing); the number
of blocks it attends is counted against an independent count from the ids.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/parallel/test_cp_packing.py` for N in 2, 4.
"""
import numpy as np
import pytest

import mpishard as ms
import test_packing
from conftest import group_comm
from mpishard.parallel import context_parallel
from mpishard.parallel.sequence_split import chunk_ids
from test_packing import case, check_packed, packed_batch

CE = ms.losses.CrossEntropy()

LAYOUTS = [  # (ranks, layout, model, kw)
    (2, "cp=2,recompute=attn", "gpt", {}), (2, "cp=2,cp_kind=ulysses,recompute=1", "gpt", {}),
    (2, "cp=2", "gpt", {"tied": True}), (2, "cp=2,recompute=attn", "llama", {}),
    (2, "cp=2,recompute=1", "llama", {}), (2, "cp=2,cp_kind=ulysses,recompute=attn", "llama", {}),
    (2, "cp=2", "llama", {"tied": True}), (4, "cp=2,tp=2", "gpt", {}),
    (4, "cp=2,tp=2", "llama", {}), (4, "cp=2,tp=2,cp_kind=ulysses", "llama", {}),
    (4, "cp=2,tp=2,cp_kind=ulysses", "gpt", {}), (4, "dp=2,cp=2", "gpt", {}),
    (4, "dp=2,cp=2", "llama", {}), (4, "dp=2,cp=2,cp_kind=ulysses", "llama", {}),
    (4, "cp=2,pp=2,microbatches=2", "gpt", {}),
    (4, "cp=2,pp=2,schedule=1f1b,microbatches=4", "llama", {"tied": True})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout,kind,kw", LAYOUTS,
                         ids=[f"{n}-{lay}-{k}-{kw}" for n, lay, k, kw in LAYOUTS])
def test_cp_packed_rows_equal_separate_examples(ranks, layout, kind, kw):
    check_packed(group_comm(ranks), layout, kind, **kw)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["cp=4", "cp=4,cp_kind=ulysses"])
@pytest.mark.parametrize("kind", ["gpt", "llama"])
def test_cp4_packed_rows_equal_separate_examples(layout, kind, monkeypatch):
    """Rows of 16 tokens in 8 chunks of 2: examples span several chunks and ranks."""
    monkeypatch.setattr(test_packing, "T", 16)
    monkeypatch.setattr(test_packing, "PACKS", [[3, 4, 5, 4], [2, 6, 2, 5], [7, 5, 3],
                                                [3, 3, 3, 6]])
    check_packed(group_comm(4), layout, kind)


def qwen2(tied=False):
    """A Qwen2 (the Llama's rotary and attention units, biased q | k | v) of test_packing's
    sizes."""
    return ms.Qwen2(vocab_size=13, seq_len=test_packing.T, d_model=16, n_heads=4, n_layers=2,
                    n_kv_heads=2, d_ff=24, rope_theta=500.0, tied=tied)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("ranks,layout", [(1, "single"), (2, "cp=2"),
                                          (2, "cp=2,cp_kind=ulysses"), (4, "dp=2,cp=2")])
def test_qwen2_packed_rows_equal_separate_examples(ranks, layout, monkeypatch):
    monkeypatch.setitem(test_packing.MODELS, "qwen2", qwen2)
    check_packed(group_comm(ranks), layout, "qwen2")


def expected_blocks(docs, r, c):
    """Chunk pairs rank r's ring attends, from the ids alone: every rank's key chunks against
    r's query chunks, less those after them and (docs given) those sharing no document."""
    n, count = docs.shape[1] // (2 * c), 0
    for s in range(c):
        for qg in chunk_ids(r, c):
            for kg in chunk_ids(s, c):
                shared = any(set(row[qg * n:(qg + 1) * n]) & set(row[kg * n:(kg + 1) * n])
                             for row in docs)
                count += kg <= qg and shared
    return count


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("packed", [False, True])
def test_ring_skips_future_pairs_and_pairs_in_other_documents(packed, monkeypatch):
    """The ring's forward attends exactly the chunk pairs expected_blocks counts (per layer):
    never a future pair, and in these packed rows fewer pairs on rank 0 (its last chunk
    shares no document with chunks 0 and 1)."""
    model, params, exs = case("llama")
    x, t, docs, _ = packed_batch(exs)
    calls = []
    block = context_parallel.att.attention_block

    def counting(*args, **kwargs):
        calls.append(1)
        return block(*args, **kwargs)
    monkeypatch.setattr(context_parallel.att, "attention_block", counting)
    engine = ms.make_engine(model, "cp=2", comm=group_comm(2))
    engine.load_checkpoint(params)
    engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE,
                      documents=docs if packed else None)
    r = engine.mesh.coords["cp"]
    want = expected_blocks(docs if packed else np.zeros_like(docs), r, 2)
    print(f"rank {r} packed={packed}: {len(calls)} blocks, {want} per layer")
    assert len(calls) == model.n_layers * want
    assert want == (3 if packed and r == 0 else 5)

"""A Mixtral's training step leaves padding out: padded fine-tune rows (document id -1, label
-100) take no expert capacity and count nowhere in the load-balancing loss, in forward and
backward, so a padded batch's loss and every gradient equal those of its examples without the
padding, in float64 (rtol 1e-9), padded or packed, on single and on the layouts that train
a Mixtral.

    unpadded   rows of examples of one length L, padded to T > L with junk tokens, against
               the same rows of length L without padding (single, no padding anywhere)
    junk       rows of different lengths: their padding's tokens and its amount (T) changed
               arbitrarily change nothing
    layouts    both checks on ep, pp (gpipe), dp with recompute, tp with sequence_parallel and
               cp (the padding mask cut to each rank's tokens), against single; ep on the
               strict CPU stand-in for cupy (tests/device_double.py) too

The capacity factor binds (drops are checked) where the layout allows one; cp and
sequence_parallel refuse it (a capacity counts per whole sequence) and run without.

Serial: `pytest tests/models/llama/test_moe_llama_padding.py -m "not mpi"`.
MPI: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/models/llama/test_moe_llama_padding.py`, N in 1, 2, 4, 8.
"""
import numpy as np
import pytest
from conftest import assert_close, assert_dicts_close, group_comm

import mpishard as ms
from mpishard.nn.documents import Documents
from test_device_double import device_backend

CE = ms.losses.CrossEntropy()
ROWS = 4
EQUAL = [4] * ROWS                       # one length: comparable with unpadded rows
MIXED = [8, 3, 5, 1]                     # a full row, uneven padding, an almost empty row


def mixtral(capacity_factor=1.0):
    return ms.Llama(vocab_size=13, seq_len=16, d_model=16, n_heads=4, n_layers=2, n_kv_heads=2,
                    d_ff=12, rope_theta=500.0, n_experts=4, top_k=2,
                    capacity_factor=capacity_factor, router_aux_loss_coef=0.05)


def mixtral_params(model):
    """Weights 3x init (the norms' scales kept): the routing is uneven, so capacity binds."""
    return {k: v if "ln_" in k else 3.0 * v for k, v in model.init(seed=3).items()}


def examples(lengths, pack, seed=0):
    """Per row, the examples it holds (one, or two that share the row's length when packed):
    token id lists, as ExampleRows lays them."""
    rng = np.random.default_rng(seed)
    rows = []
    for n in lengths:
        parts = [n // 2, n - n // 2] if pack and n > 1 else [n]
        rows.append([list(rng.integers(1, 13, size=k)) for k in parts])
    return rows


def batch(rows, T, junk_seed=None):
    """(x, t, documents) (B, T): each row's examples, then padding: junk tokens (junk_seed;
    None: no padding, T must fit), label -100, document -1. An example's tokens are scored on
    the next token of the same example (its last token on nothing), as in sft_rows."""
    junk = np.random.default_rng(junk_seed)
    x = junk.integers(0, 13, size=(len(rows), T))
    t = np.full((len(rows), T), -100)
    d = np.full((len(rows), T), -1)
    for r, parts in enumerate(rows):
        col = 0
        for i, ids in enumerate(parts):
            n = len(ids)
            x[r, col:col + n], d[r, col:col + n] = ids, i
            t[r, col:col + n - 1] = ids[1:]
            col += n
        assert junk_seed is not None or col == T
    return x, t, d


def step(model, params, layout, x, t, d, comm=None, device="cpu"):
    """(loss, full gradients on the host, the engine) of one train_step on the global batch
    (x, t, d) with the global count (d None: no document ids)."""
    engine = ms.SingleDevice(model) if layout == "single" else \
        ms.make_engine(model, layout, comm=comm, device=device)
    engine.load_checkpoint(params)
    t_local = engine.shard_batch(t)
    count = engine.count_targets(t_local)
    assert count == int((t != -100).sum())
    n, i = engine.data_parallel_size, engine.data_parallel_rank
    docs = None if d is None else d[len(d) // n * i:len(d) // n * (i + 1)]  # rows, not cut by cp
    value, grads = engine.train_step(engine.shard_batch(x), t_local, CE, count=count,
                                     documents=docs)
    grads = {k: engine.backend.to_host(g) for k, g in engine.gather_grads(grads).items()}
    return value, grads, engine


def unpadded_reference(model, params, pack):
    """Single on EQUAL's rows without padding (T = their length): loss and gradients."""
    x, t, d = batch(examples(EQUAL, pack), EQUAL[0])
    value, grads, engine = step(model, params, "single", x, t, d if pack else None)
    return value, grads, engine.stats


def check(got, want, what):
    assert_close(got[0], want[0], what=f"{what} loss")
    assert_dicts_close(got[1], want[1], what=what)


# -- the document ids' padding mask -----------------------------------------------------------
def test_rows_of_one_document_need_no_attention_mask_but_mark_their_padding():
    """Padded rows (one document from the first token): no ids for attention and positions,
    the padding mask for the experts; packed rows: both."""
    padded = np.array([[0, 0, 0, -1], [3, 3, 3, 3], [-1, -1, -1, -1]])
    packed = np.array([[0, 0, 1, -1], [0, 0, 0, 0], [0, 0, 0, 0]])
    documents = Documents()
    documents.set(np.concatenate([padded, packed]), microbatches=2)
    assert documents.rows(0) is None and documents.positions(0) is None
    np.testing.assert_array_equal(documents.ids(0), padded)
    np.testing.assert_array_equal(documents.real(0), padded != -1)
    np.testing.assert_array_equal(documents.rows(1), packed)
    np.testing.assert_array_equal(documents.real(1), packed != -1)
    documents.set(np.zeros((2, 4), dtype=np.int64))
    assert documents.rows(0) is None and documents.real(0) is None
    with documents.holding(0, packed):                     # recompute's: the ids as saved
        np.testing.assert_array_equal(documents.rows(0), packed)
    assert documents.rows(0) is None


# -- single ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("layout", ["single", "recompute=1"])
def test_padded_rows_train_as_the_unpadded_rows(layout, pack):
    model = mixtral()
    params = mixtral_params(model)
    want_loss, want_grads, stats = unpadded_reference(model, params, pack)
    assert stats["moe_dropped"] > 0, "capacity must bind for the check to mean anything"
    x, t, d = batch(examples(EQUAL, pack), 8, junk_seed=1)
    got = step(model, params, layout, x, t, d)
    check(got, (want_loss, want_grads), f"{layout} {'packed' if pack else 'padded'}")
    assert got[2].stats["moe_dropped"] == stats["moe_dropped"]
    assert got[2].stats["moe_routed"] == stats["moe_routed"]


def test_the_check_can_fail_without_document_ids():
    """Without the ids the padding routes like tokens: another loss."""
    model = mixtral()
    params = mixtral_params(model)
    want_loss, _, _ = unpadded_reference(model, params, False)
    x, t, _ = batch(examples(EQUAL, False), 8, junk_seed=1)
    value, _, _ = step(model, params, "single", x, t, None)
    assert abs(value - want_loss) > 1e-6 * abs(want_loss)


@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_junk_and_amount_of_padding_change_nothing(pack):
    model = mixtral()
    params = mixtral_params(model)
    rows = examples(MIXED, pack)
    want = step(model, params, "single", *batch(rows, 8, junk_seed=1))
    assert want[2].stats["moe_dropped"] > 0
    for T, junk_seed in ((8, 2), (12, 3)):
        got = step(model, params, "single", *batch(rows, T, junk_seed))
        check(got, want, f"{'packed' if pack else 'padded'} T={T} junk {junk_seed}")


# -- layouts --------------------------------------------------------------------------------------
LAYOUTS = [  # (layout, capacity_factor: None where a sequence is split)
    ("ep=2", 1.0), ("pp=2,schedule=gpipe,microbatches=2", 1.0), ("dp=2,recompute=1", 1.0),
    ("tp=2,sequence_parallel=1", None), ("cp=2", None)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("layout,capacity", LAYOUTS, ids=[lay for lay, _ in LAYOUTS])
def test_padding_counts_nowhere_on_the_layouts(layout, capacity, pack):
    check_layout(layout, capacity, pack, group_comm(2))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("pack", [False, True], ids=["padded", "packed"])
def test_padding_counts_nowhere_under_cp_with_sequence_parallel(pack):
    """LocalTokens' two cuts together: cp's chunks, then each tp rank's part of them."""
    check_layout("cp=2,tp=2,sequence_parallel=1", None, pack, group_comm(4))


def check_layout(layout, capacity, pack, comm):
    """A padded (and an unevenly padded) batch on `layout` against the unpadded rows and
    against single."""
    model = mixtral(capacity)
    params = mixtral_params(model)
    what = f"{layout} {'packed' if pack else 'padded'}"
    want_loss, want_grads, _ = unpadded_reference(model, params, pack)
    x, t, d = batch(examples(EQUAL, pack), 8, junk_seed=1)
    check(step(model, params, layout, x, t, d, comm), (want_loss, want_grads),
          f"{what} against unpadded")
    rows = examples(MIXED, pack)
    want = step(model, params, "single", *batch(rows, 12, junk_seed=5))
    got = step(model, params, layout, *batch(rows, 8, junk_seed=1), comm)
    check(got, want, f"{what} uneven padding against single")


@pytest.mark.mpi(min_size=2)
def test_padding_counts_nowhere_on_device_arrays():
    comm = group_comm(2)
    model = mixtral()
    params = mixtral_params(model)
    want_loss, want_grads, _ = unpadded_reference(model, params, False)
    x, t, d = batch(examples(EQUAL, False), 8, junk_seed=1)
    got = step(model, params, "ep=2", x, t, d, comm, device_backend(comm, "staged")[0])
    check(got, (want_loss, want_grads), "ep=2 on device arrays")

"""Packed rows: a packed row's loss and gradients equal each of its examples run alone.

Eleven examples of 2 to 7 tokens, each labelled with its own next tokens (-100 at its last
token, and at a 'prompt' in two of them), are run two ways:

    separate   one example per row, padded to T (token 0, label -100), no documents: single
    packed     four rows of T tokens, several examples each, two rows ending in padding
               (document id -1, label -100), with the document ids (nn/documents.py)

Both with train_step's `count` = the examples' counted targets (the same tokens either way),
so both are the mean over the same token losses. In float64 (rtol 1e-9) the packed run on
every layout gives the separate run's loss and every gradient, the GPT's learned positions and
the Llama's rotary restarting at each example, attention kept inside it. predict's logits of
the packed rows equal the separate rows' at the same tokens. The same on the strict CPU
stand-in for cupy (tests/device_double.py: no host array meets a device one on the packed
paths). Documents that are not contiguous runs are refused on every rank before any
communication; under cp, T still divides by 2 cp.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/parallel/test_packing.py` for N in 1, 2, 4.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm
from test_device_double import device_backend
from test_gpt_engine import make_case

CE = ms.losses.CrossEntropy()
T = 12
PACKS = [[3, 4, 5], [2, 6, 2], [7, 5], [3, 3, 3]]      # example lengths per packed row
PROMPTS = {1: 2, 6: 3}                                 # example -> its first labels masked


def gpt(tied=False):
    return ms.GPT(vocab_size=17, seq_len=T, d_model=16, n_heads=4, n_layers=2, d_ff=32,
                  tied=tied)


def llama(tied=False):
    return ms.Llama(vocab_size=13, seq_len=T, d_model=16, n_heads=4, n_layers=2,
                    n_kv_heads=2, d_ff=24, rope_theta=500.0, tied=tied)


MODELS = {"gpt": gpt, "llama": llama}


def examples(vocab, seed=5):
    """[(tokens, labels)] of every example: labels the next tokens, -100 at the last one and
    at the prompt of the examples in PROMPTS."""
    rng = np.random.default_rng(seed)
    out = []
    for n in (n for row in PACKS for n in row):
        ids = rng.integers(1, vocab, n)
        labels = np.append(ids[1:], -100)
        labels[:PROMPTS.get(len(out), 0)] = -100
        out.append((ids, labels))
    return out


def separate_batch(exs):
    """(x, t): one example per row, padded to T with token 0 and label -100."""
    x, t = np.zeros((len(exs), T), np.int64), np.full((len(exs), T), -100)
    for i, (ids, labels) in enumerate(exs):
        x[i, :len(ids)], t[i, :len(ids)] = ids, labels
    return x, t


def packed_batch(exs):
    """(x, t, documents, where): PACKS rows of T, padding (document -1) at the end of the short
    ones; where[i] = (row, first column) of example i."""
    x, t = np.zeros((len(PACKS), T), np.int64), np.full((len(PACKS), T), -100)
    docs, where, i = np.full((len(PACKS), T), -1), [], 0
    for r, row in enumerate(PACKS):
        col = 0
        for doc, _ in enumerate(row):
            ids, labels = exs[i]
            x[r, col:col + len(ids)], t[r, col:col + len(ids)] = ids, labels
            docs[r, col:col + len(ids)] = doc
            where.append((r, col))
            col, i = col + len(ids), i + 1
    return x, t, docs, where


def case(kind, **kw):
    model = MODELS[kind](**kw)
    params = make_case(model, seed=3)[0]
    exs = examples(model.vocab_size)
    return model, params, exs


def separate_reference(model, params, exs):
    """(loss, gradients, logits) of the separate rows on single, with count."""
    x, t = separate_batch(exs)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    value, grads = ref.train_step(x, t, CE, count=int((t != -100).sum()))
    return value, {k: g.copy() for k, g in grads.items()}, ref.predict(x)


def data_rows(engine, arr):
    """This rank's rows of `arr` (the data-parallel split, not cut by cp): documents' form."""
    n, i = engine.data_parallel_size, engine.data_parallel_rank
    rows = len(arr) // n
    return arr[rows * i:rows * (i + 1)]


def check_packed(comm, layout, kind, device="cpu", **kw):
    model, params, exs = case(kind, **kw)
    want_loss, want_grads, want_logits = separate_reference(model, params, exs)
    x, t, docs, where = packed_batch(exs)
    engine = ms.make_engine(model, layout, comm=comm, device=device)
    engine.load_checkpoint(params)
    t_local = engine.shard_batch(t)
    count = engine.count_targets(t_local)
    assert count == int((t != -100).sum())
    value, grads = engine.train_step(engine.shard_batch(x), t_local, CE, count=count,
                                     documents=data_rows(engine, docs))
    what = f"{kind} {layout} {kw}"
    assert_close(value, want_loss, what=f"{what} loss")
    assert_dicts_close({k: engine.backend.to_host(g) for k, g in
                        engine.gather_grads(grads).items()}, want_grads, what=what)
    y = engine.backend.to_host(engine.gather_batch(
        engine.predict(engine.shard_batch(x), documents=data_rows(engine, docs))))
    for i, ((ids, _), (r, col)) in enumerate(zip(exs, where)):
        assert_close(y[r, col:col + len(ids)], want_logits[i, :len(ids)],
                     what=f"{what} logits of example {i}")


LAYOUTS = [  # (ranks, layout, model, kw)
    (1, "single", "gpt", {}), (1, "recompute=1", "gpt", {}), (1, "recompute=attn", "gpt", {}),
    (2, "dp=2", "gpt", {}), (2, "tp=2", "gpt", {}), (2, "tp=2", "gpt", {"tied": True}),
    (2, "tp=2,sequence_parallel=1", "gpt", {}), (2, "pp=2,microbatches=2", "gpt", {}),
    (2, "pp=2,microbatches=4", "gpt", {}), (2, "pp=2,schedule=1f1b,microbatches=2", "gpt", {}),
    (2, "pp=2,schedule=1f1b,microbatches=4,recompute=attn", "gpt", {}),
    (2, "fsdp=2", "gpt", {}), (2, "dp=2,recompute=1", "gpt", {}),
    (2, "cp=2", "gpt", {}), (2, "cp=2,cp_kind=ulysses", "gpt", {}),
    (4, "dp=2,tp=2", "gpt", {}), (4, "tp=2,cp=2,sequence_parallel=1", "gpt", {}),
    (1, "single", "llama", {}), (1, "recompute=1", "llama", {}),
    (1, "recompute=attn", "llama", {}), (2, "dp=2", "llama", {}), (2, "tp=2", "llama", {}),
    (2, "tp=2,sequence_parallel=1", "llama", {}), (2, "pp=2,microbatches=2", "llama", {}),
    (2, "pp=2,schedule=1f1b,microbatches=4", "llama", {}), (2, "fsdp=2", "llama", {}),
    (2, "cp=2", "llama", {}), (2, "cp=2,cp_kind=ulysses", "llama", {}),
    (4, "dp=2,tp=2", "llama", {})]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("ranks,layout,kind,kw", LAYOUTS,
                         ids=[f"{n}-{lay}-{k}-{kw}" for n, lay, k, kw in LAYOUTS])
def test_packed_rows_equal_separate_examples(ranks, layout, kind, kw):
    check_packed(group_comm(ranks), layout, kind, **kw)


DEVICE_LAYOUTS = [(1, "single", "gpt"), (1, "single", "llama"),
                  (2, "tp=2,sequence_parallel=1", "gpt"), (2, "cp=2", "gpt"),
                  (2, "cp=2,cp_kind=ulysses", "llama"),
                  (2, "pp=2,schedule=1f1b,microbatches=2,recompute=attn", "gpt")]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("ranks,layout,kind", DEVICE_LAYOUTS,
                         ids=[f"{n}-{lay}-{k}" for n, lay, k in DEVICE_LAYOUTS])
def test_packed_rows_on_device_arrays(ranks, layout, kind):
    comm = group_comm(ranks)
    check_packed(comm, layout, kind, device=device_backend(comm, "staged")[0])


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_unpacked_documents_change_the_answer(kind):
    """The check can fail: the packed rows without their documents (attention across the
    examples, positions running on) do not give the separate rows' loss."""
    model, params, exs = case(kind)
    want_loss = separate_reference(model, params, exs)[0]
    x, t, _, _ = packed_batch(exs)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    value, _ = engine.train_step(x, t, CE, count=int((t != -100).sum()))
    assert abs(value - want_loss) > 1e-6 * abs(want_loss)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["dp=2", "tp=2", "pp=2,schedule=1f1b", "cp=2"])
def test_split_documents_are_refused_on_every_rank(layout):
    """A document id in two separate runs: the same ValueError on every rank, before any
    communication (a rank that went on would hang in its first collective). Each rank checks
    its own rows, so every row is broken here."""
    model, params, exs = case("gpt")
    x, t, docs, _ = packed_batch(exs)
    docs[:, -1] = 0                                   # document 0 again after 1 (and 2, -1)
    engine = ms.make_engine(model, layout, comm=group_comm(2))
    engine.load_checkpoint(params)
    local = data_rows(engine, docs)
    with pytest.raises(ValueError, match="contiguous"):
        engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE, documents=local)
    with pytest.raises(ValueError, match="contiguous"):
        engine.predict(engine.shard_batch(x), documents=local)


@pytest.mark.mpi(min_size=2)
def test_cp_still_needs_two_chunks_per_rank():
    """Under cp the packed sequence is still cut into 2 cp chunks: T=10 at cp=2 (5 tokens per
    rank) is refused on every rank."""
    model, params, _ = case("gpt")
    engine = ms.make_engine(model, "cp=2", comm=group_comm(2))
    engine.load_checkpoint(params)
    x = np.ones((2, 5), np.int64)
    with pytest.raises(ValueError, match="two equal chunks"):
        engine.train_step(x, x, CE, documents=np.zeros((2, 10), np.int64))


@pytest.mark.mpi(min_size=2)
def test_documents_cut_by_cp_are_refused():
    """Documents are the whole sequence's ids: ids cut to a cp rank's own tokens are refused
    on every rank, before any communication, naming cp."""
    model, params, _ = case("gpt")
    engine = ms.make_engine(model, "cp=2", comm=group_comm(2))
    engine.load_checkpoint(params)
    x = np.ones((2, 6), np.int64)
    with pytest.raises(ValueError, match="not cut by cp"):
        engine.train_step(x, x, CE, documents=np.zeros((2, 6), np.int64))

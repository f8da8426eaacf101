"""A vocabulary tp does not divide (parallel/vocab_parallel.py): padded to a multiple of tp
inside the placements, never seen outside. Every layout against single in float64 (rtol 1e-9:
logits, loss, every gradient), padded rows and columns zero and staying zero under AdamW with
weight decay, (B, T, V) outputs whose argmax is a real id, checkpoints of V rows.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/parallel/test_vocab_padding.py` for N in 2 and 4 (a k-rank layout runs on group_comm(k)).
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, single_reference
from mpishard.parallel import placement as pl
from mpishard.parallel.compose import plan_params
from mpishard.costs.rank_costs import rank_memory
from test_device_double import MODES, device_backend
from test_gpt_engine import make_case, step_against_single

CE = ms.losses.CrossEntropy()


def make_gpt(vocab, tied=False, n_layers=2):
    return ms.GPT(vocab_size=vocab, seq_len=8, d_model=16, n_heads=4, n_layers=n_layers,
                  d_ff=32, tied=tied)


def make_llama(vocab, tied=False, n_layers=2):
    """The same padding with no Llama-specific code (GQA: 2 kv heads, split at tp=2)."""
    return ms.Llama(vocab_size=vocab, seq_len=8, d_model=16, n_heads=4, n_layers=n_layers,
                    n_kv_heads=2, d_ff=24, tied=tied)


# -- serial: the plan ---------------------------------------------------------------------------
@pytest.mark.parametrize("vocab,tp,rows", [(13, 2, 7), (13, 4, 4), (97, 4, 25), (5, 4, 2),
                                           (16, 4, 4)])
def test_plan_pads_the_vocabulary_to_a_multiple_of_tp(vocab, tp, rows):
    """Every rank holds ceil(V/tp) rows of embed/tokens and columns of head/weights; the
    last ones end in padding (with V=5, tp=4 the last rank holds padding only)."""
    model = make_gpt(vocab)
    layout = ms.parse_layout(f"tp={tp}")
    plan = plan_params(model, layout)
    assert plan["embed/tokens"].full_shape == (vocab, 16)            # the real V outside
    assert rank_memory(model, layout, 0)["shapes"]["embed/tokens"] == (rows, 16)
    assert rank_memory(model, layout, tp - 1)["shapes"]["head/weights"] == (16, rows)
    full = np.arange(vocab * 3, dtype=float).reshape(vocab, 3)
    placement = pl.Placement((pl.Shard("tp", 0, pad=True),))
    blocks = [pl.shard_array(full, placement, {"tp": tp}, {"tp": r}) for r in range(tp)]
    stacked = np.concatenate(blocks)
    assert stacked.shape == (rows * tp, 3)
    assert np.array_equal(stacked[:vocab], full) and not stacked[vocab:].any()


def test_tp_no_longer_refuses_a_vocabulary_it_does_not_divide():
    plan_params(make_gpt(13), ms.parse_layout("tp=4"))
    plan_params(make_gpt(13, tied=True), ms.parse_layout("tp=2,pp=2"))


# -- every layout against single ----------------------------------------------------------------
def padded_block_is_zero(engine, name, vocab) -> bool:
    """Whether this rank's padded rows (embed/tokens) or columns (head/weights) of `name`, in
    the parameter and its gradient, are all zero (true where it holds no padding)."""
    if name not in engine.params:
        return True
    tp = engine.layout.size("tp")
    dim = 0 if name == "embed/tokens" else 1
    for arr, placements in ((engine.params[name], engine.placements),
                            (engine.grads[name], engine.grad_placements)):
        arr = np.asarray(arr)
        if placements[name].shards[-1].axis == "fsdp" and engine.layout.size("fsdp") > 1:
            continue                 # (fsdp slices of the block: checked through gather below)
        v = arr.shape[dim]
        real = vocab - engine.mesh.coords["tp"] * v
        pad = arr.take(np.arange(max(real, 0), v), axis=dim)
        if v * tp < vocab or pad.any():
            return False
    return True


def check_against_single(comm, layout, vocab, tied=False, n_layers=2, make=make_gpt):
    model = make(vocab, tied, n_layers)
    what = f"{type(model).__name__} V={vocab} {layout} tied={tied}"
    engine, params, _, y, want = step_against_single(model, layout, comm, what)
    assert y.shape == (8, 8, vocab)
    assert np.array_equal(y.argmax(-1), want.argmax(-1))
    assert_dicts_close(engine.gather_params(), params, rtol=0, what=f"{what} params round trip")
    for name in ("embed/tokens", "head/weights"):
        assert padded_block_is_zero(engine, name, vocab), f"{what}: {name} padding not zero"


LAYOUTS = [  # (ranks, layout, vocab, case)
    (2, "tp=2", 13, {}), (2, "tp=2", 13, {"tied": True}), (2, "tp=2", 97, {}),
    (2, "tp=2,sequence_parallel=1", 13, {}), (2, "tp=2,sequence_parallel=1", 13, {"tied": True}),
    (4, "tp=4", 13, {}), (4, "tp=4", 5, {"tied": True}), (4, "tp=4", 50, {}),
    (4, "tp=4,sequence_parallel=1", 97, {"tied": True}),
    (4, "dp=2,tp=2", 13, {"tied": True}), (4, "tp=2,pp=2", 13, {}),
    (4, "tp=2,pp=2", 13, {"tied": True}), (4, "tp=2,pp=2,schedule=interleaved", 13,
                                             {"tied": True, "n_layers": 4}),
    (4, "fsdp=2,tp=2,zero=3", 13, {}), (4, "fsdp=2,tp=2,zero=3", 13, {"tied": True}),
    (4, "fsdp=2,tp=2,zero=1", 13, {"tied": True}),
    (4, "fsdp=2,tp=2,zero=2,sequence_parallel=1", 97, {}),
    (2, "tp=2", 13, {"make": make_llama}), (2, "tp=2", 13, {"make": make_llama, "tied": True}),
    (4, "tp=4", 13, {"make": make_llama, "tied": True}),
    (4, "tp=2,pp=2", 97, {"make": make_llama, "tied": True}),
    (4, "fsdp=2,tp=2,zero=3", 13, {"make": make_llama})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout,vocab,kw", LAYOUTS,
                         ids=[f"{lay}-V{v}-{kw.get('make', make_gpt).__name__[5:]}"
                              f"{'-tied' if kw.get('tied') else ''}" for _, lay, v, kw in LAYOUTS])
def test_layouts_equal_single(ranks, layout, vocab, kw):
    check_against_single(group_comm(ranks), layout, vocab, **kw)


@pytest.mark.mpi(min_size=2)
@pytest.mark.filterwarnings("ignore:invalid value encountered")
def test_ignored_rows_of_inf_or_nan_logits_add_nothing_under_tp():
    """The vocab-parallel loss on a padded vocabulary (13 at tp=2): rows whose target is
    ignore_index add nothing to the value (torch's rule) nor to the gradient, whatever their
    logits (inf, nan); the others equal CrossEntropy's on the full logits."""
    from mpishard.parallel.vocab_parallel import VocabParallelCrossEntropy
    comm = group_comm(2)
    engine = ms.make_engine(make_gpt(13), "tp=2", comm=comm)
    tp = engine.comm.group("tp")
    rng = np.random.default_rng(4)
    y, t = rng.normal(size=(2, 5, 13)) * 3, rng.integers(0, 13, (2, 5))
    t[0, 1] = t[1, 3] = -100
    bad = y.copy()
    bad[0, 1, 2], bad[1, 3, :] = np.inf, np.nan
    shard = np.pad(bad, ((0, 0), (0, 0), (0, 1)))[..., 7 * comm.rank:7 * (comm.rank + 1)]
    value, dy = VocabParallelCrossEntropy(tp, 13)(shard, t)
    want, want_dy = CE(y, t)
    assert_close(value, want, what="loss")
    full = np.pad(want_dy, ((0, 0), (0, 0), (0, 1)))[..., 7 * comm.rank:7 * (comm.rank + 1)]
    assert_close(dy, full, what="dloss/dlogits")
    assert not dy[0, 1].any() and not dy[1, 3].any()
    engine.close()


# -- training: the padding stays zero -----------------------------------------------------------
TRAINED = [(2, "tp=2", False), (2, "tp=2", True), (4, "tp=4", True),
           (4, "fsdp=2,tp=2,zero=1", False), (4, "tp=2,pp=2", True)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout,tied", TRAINED,
                         ids=[f"{lay}-tied={tied}" for _, lay, tied in TRAINED])
def test_adamw_with_weight_decay_leaves_the_padding_zero(ranks, layout, tied):
    """15 AdamW steps (weight decay 0.1, clipped): losses and parameters equal single's at
    rtol 1e-9, and the padded rows/columns of the parameters and gradients are still 0."""
    comm = group_comm(ranks)
    vocab = 13
    model = make_gpt(vocab, tied)
    params = model.init(seed=4)
    data = np.random.default_rng(4).integers(0, vocab, (15, 4, 9))
    curves, finals = [], []
    for c in (None, comm):
        engine = ms.SingleDevice(model) if c is None else ms.make_engine(model, layout, comm=c)
        engine.load_checkpoint(params)
        opt = ms.optim.AdamW(engine, lr=1e-2, weight_decay=0.1)
        losses = []
        for batch in data:
            x, t = batch[:, :-1], batch[:, 1:]
            value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
            ms.optim.clip_grad_norm(engine, grads, max_norm=0.5)
            opt.step(grads)
            losses.append(value)
        curves.append(np.array(losses))
        finals.append(engine.gather_params())
    assert_close(curves[1], curves[0], what=f"{layout} losses")
    assert_dicts_close(finals[1], finals[0], what=f"{layout} params")
    for name in ("embed/tokens", "head/weights"):
        assert padded_block_is_zero(engine, name, vocab), f"{layout}: {name} padding moved"


# -- checkpoints: V rows on disk, padded again on load ------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_checkpoint_holds_the_real_vocabulary(tmp_path_factory):
    comm = group_comm(2)
    model = make_gpt(13)
    params, x, t = make_case(model)
    engine = ms.make_engine(model, "tp=2", comm=comm)
    engine.load_checkpoint(params)
    opt = ms.optim.AdamW(engine, lr=1e-2, weight_decay=0.1)
    opt.step(engine.train_step(x, t, CE)[1])
    path = comm.bcast(str(tmp_path_factory.mktemp("vocab_pad")) if comm.rank == 0 else None)
    ms.checkpoint.save(f"{path}/ckpt", engine, opt)
    saved = ms.checkpoint.load(f"{path}/ckpt")
    assert saved["embed/tokens"].shape == (13, 16) and saved["head/weights"].shape == (16, 13)
    single = ms.SingleDevice(model)
    single_opt = ms.optim.AdamW(single, lr=1e-2, weight_decay=0.1)
    ms.checkpoint.restore(f"{path}/ckpt", single, single_opt)
    assert_dicts_close(single.gather_params(), engine.gather_params(), rtol=0,
                       what="tp=2 -> single")
    again = ms.make_engine(model, "tp=2", comm=comm)
    again.load_checkpoint(model.init(1))
    opt2 = ms.optim.AdamW(again, lr=1e-2, weight_decay=0.1)
    ms.checkpoint.restore(f"{path}/ckpt", again, opt2)
    for c, o in ((again, opt2), (single, single_opt)):
        o.step(c.train_step(c.shard_batch(x), c.shard_batch(t), CE)[1])
    assert_dicts_close(again.gather_params(), single.gather_params(), what="a step after")
    assert padded_block_is_zero(again, "embed/tokens", 13)


# -- generation: never a padded id --------------------------------------------------------------
GENERATED = [(2, "tp=2", False), (2, "tp=2", True), (4, "tp=4", True), (4, "tp=2,pp=2", True),
             (4, "dp=2,tp=2", False)]


def negative_logits(model, seed=6) -> dict:
    """Parameters whose real logits are all < 0 (ln_f maps every h to its shift s and the
    head's columns are -|r_v| s): a padded logit left at 0 would win every argmax."""
    params = model.init(seed=seed)
    rng = np.random.default_rng(seed)
    s = rng.normal(size=model.d_model)
    head = -s[:, None] * (0.5 + rng.random(model.vocab_size))[None, :]       # (D, V)
    params["ln_f/scale"], params["ln_f/shift"] = np.zeros_like(s), s
    params["embed/tokens" if model.tied else "head/weights"] = head.T if model.tied else head
    return params


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout,tied", GENERATED,
                         ids=[f"{lay}-tied={tied}" for _, lay, tied in GENERATED])
def test_greedy_generation_equals_single(ranks, layout, tied):
    """Greedy batched decoding (KV cache, prompts of different lengths: per-row positions
    through the vocab-parallel embedding) gives single's ids; with every real logit < 0 the
    outputs are (B, T, V), every one negative, and no generated id is a padded one."""
    model = make_gpt(13, tied, n_layers=2)
    prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]
    engine = ms.make_engine(model, layout, comm=group_comm(ranks))
    single = ms.SingleDevice(model)
    for params in (make_case(model)[0], negative_logits(model)):
        for e in (single, engine):
            e.load_checkpoint(params)
        want = single.generate(prompts, 6, temperature=0)
        got = engine.generate(prompts, 6, temperature=0)
        print(f"{layout} tied={tied}: {got}")
        assert got == want
        assert all(0 <= i < 13 for row in got for i in row)
    x = np.array([[1, 2, 3, 4]] * 4)
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    assert y.shape == (4, 4, 13) and float(y.max()) < 0


# -- device arrays (the strict CPU stand-in for cupy) ---------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,tied", [("tp=2", False), ("tp=2,sequence_parallel=1", True)])
def test_padding_on_device_arrays(layout, tied, mode):
    """The mask, the trim and the position gradients run on device arrays and equal numpy
    single (V = 13 over tp = 2); greedy generation too."""
    comm = group_comm(2)
    backend, _ = device_backend(comm, mode)
    model = make_gpt(13, tied)
    params, x, t = make_case(model)
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm, device=backend)
    engine.load_checkpoint(params)
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
    assert_close(loss, ref_loss, what=f"{layout} {mode} loss")
    full = {k: backend.to_host(v) for k, v in engine.gather_grads(grads).items()}
    assert_dicts_close(full, ref_grads, what=f"{layout} {mode}")
    y = backend.to_host(engine.gather_batch(engine.predict(engine.shard_batch(x))))
    assert_close(y, ref.predict(x), what=f"{layout} {mode} logits")
    if "sequence_parallel" not in layout:
        prompts = [[1, 2, 3], [4], [5, 6, 7, 8, 9, 10], [11, 12]]
        assert engine.generate(prompts, 4, temperature=0) == \
            ref.generate(prompts, 4, temperature=0)

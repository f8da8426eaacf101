"""GPT under tensor parallelism (tp) and sequence parallelism (tp=N,sequence_parallel=1):
every layout against single in float64 (rtol 1e-9): logits, loss and every gradient; the qkv
blocked split; the vocab-parallel loss never sees the full logits; checkpoints; AdamW.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/parallel/test_gpt_tp.py`
for N in 1, 2, 4, 8 (a k-rank layout runs on `group_comm(k)`).
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import RTOL32, assert_close, assert_dicts_close, group_comm, single_reference
from mpishard.comm.mesh import parse_layout
from mpishard.nn.transformer import LayerNorm
from mpishard.parallel import placement as pl
from mpishard.parallel.compose import plan_params
from mpishard.parallel.vocab_parallel import VocabParallelCrossEntropy
from test_gpt_engine import make_case

CE = ms.losses.CrossEntropy()


def make_gpt(n_layers=2, tied=False):
    return ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=4, n_layers=n_layers,
                  d_ff=32, tied=tied)


def check_against_single(comm, layout, n_layers=2, tied=False, T=8, rows=8):
    """train_step (loss, gathered gradients) and gathered predict of `layout` equal single's;
    the loss only ever sees (B, T, V/tp) logits."""
    model = make_gpt(n_layers, tied)
    params, x, t = make_case(model, rows, T)
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    what = f"GPT {layout} tied={tied} T={T}"
    loss = engine.output.loss(CE)
    value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), loss)
    assert_close(value, ref_loss, what=f"{what} loss")
    assert_dicts_close(engine.gather_grads(grads), ref_grads, what=what)
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    assert_close(y, ref.predict(x), what=f"{what} logits")
    assert_dicts_close(engine.gather_params(), params, rtol=0, what=f"{what} params round trip")
    tp = engine.layout.size("tp")
    widths = {s[-1] for s in loss.seen_shapes}
    print(f"{what}: logits widths seen by the loss {sorted(widths)} (V={model.vocab_size})")
    if engine.stage == engine.layout.size("pp") - 1:
        assert widths == {model.vocab_size // tp}, "the full logits reached the loss"
    assert sum(len(layer.tape) for layer in engine.layers) == 0, "activations left stashed"


# -- serial: placement, plan, refusals ---------------------------------------------------------
@pytest.mark.parametrize("tp", [2, 4])
def test_blocked_split_round_trips(tp):
    """qkv (D, 3D) under Shard('tp', 1, blocks=3): rank r holds [q_r | k_r | v_r]; the ranks'
    pieces, gathered rank-major and unblocked, are the full array; the bias likewise."""
    d, h = 8, 4
    full = np.arange(d * 3 * d, dtype=float).reshape(d, 3 * d)
    placement = pl.Placement((pl.Shard("tp", 1, blocks=3),))
    pieces = [pl.shard_array(full, placement, {"tp": tp}, {"tp": r}) for r in range(tp)]
    for r, piece in enumerate(pieces):
        heads = slice(r * d // tp, (r + 1) * d // tp)        # this rank's heads' columns
        want = np.concatenate([full[:, j * d:(j + 1) * d][:, heads] for j in range(3)], axis=1)
        assert np.array_equal(piece, want), f"rank {r}: not q_r | k_r | v_r"
        assert piece.shape == pl.local_shape(full.shape, placement, {"tp": tp}) == \
            (d, 3 * d // tp)
        regions = pl.local_pieces(full.shape, placement, {"tp": tp}, {"tp": r})
        assert len(regions) == 3 and sum(b - a for a, b in (rg[1] for rg, _ in regions)) == \
            3 * d // tp
    assert np.array_equal(pl.unblock(np.concatenate(pieces, axis=1), 1, tp, 3), full)
    bias = pl.Placement((pl.Shard("tp", 0, blocks=3), pl.Shard("fsdp", 0, pad=True)))
    b = np.arange(3 * d, dtype=float)
    parts = [[pl.shard_array(b, bias, {"tp": tp, "fsdp": 3}, {"tp": r, "fsdp": f})
              for f in range(3)] for r in range(tp)]
    per_rank = [np.concatenate(p)[:3 * d // tp] for p in parts]   # undo fsdp, trim padding
    assert np.array_equal(pl.unblock(np.concatenate(per_rank), 0, tp, 3), b)
    assert h % tp == 0


def test_blocked_split_refuses_padding_and_single_region():
    with pytest.raises(ValueError, match="cannot be padded"):
        pl.Shard("tp", 1, pad=True, blocks=3)
    with pytest.raises(ValueError, match="several rectangles"):
        pl.local_slices((4, 12), pl.Placement((pl.Shard("tp", 1, blocks=3),)), {"tp": 2},
                        {"tp": 0})


def test_plan_places_megatron_splits():
    plan = plan_params(make_gpt(), ms.parse_layout("fsdp=2,tp=2"))
    shards = {n: info.placement.shards for n, info in plan.items()}
    fsdp = pl.Shard("fsdp", 0, pad=True)
    assert shards["block_0/attn/qkv/weights"] == (pl.Shard("tp", 1, blocks=3), fsdp)
    assert shards["block_1/attn/proj/weights"] == (pl.Shard("tp", 0), fsdp)
    assert shards["block_0/mlp/fc/bias"] == (pl.Shard("tp", 0), fsdp)
    assert shards["embed/tokens"] == (pl.Shard("tp", 0, pad=True), fsdp)   # V padded to a
    assert shards["head/weights"] == (pl.Shard("tp", 1, pad=True), fsdp)   # multiple of tp
    for name in ("embed/positions", "block_0/ln_1/scale", "block_0/attn/proj/bias", "ln_f/shift"):
        assert shards[name] == (fsdp,), name


@pytest.mark.parametrize("kw,match", [
    ({"n_heads": 2, "d_model": 16}, "n_heads=2"),
    ({"d_ff": 30}, "d_ff=30"),
])
def test_tp_must_divide_heads_and_ffn(kw, match):
    """(A vocabulary it does not divide is padded: test_vocab_padding.py.)"""
    args = dict(vocab_size=16, seq_len=8, d_model=16, n_heads=4, n_layers=2, d_ff=32)
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        plan_params(ms.GPT(**args), ms.parse_layout("tp=4"))


def test_sequence_parallel_needs_tp():
    with pytest.raises(ValueError, match="sequence_parallel"):
        parse_layout("dp=2,sequence_parallel=1")
    assert parse_layout("tp=2,sequence_parallel=1").option("sequence_parallel") == 1


# -- every layout against single -----------------------------------------------------------------
LAYOUTS = [  # (ranks, layout, case)
    (2, "tp=2", {}), (2, "tp=2", {"tied": True, "T": 6}), (2, "tp=2,sequence_parallel=1", {}),
    (2, "tp=2,sequence_parallel=1", {"tied": True, "T": 6}),
    (4, "tp=4", {}), (4, "tp=4,sequence_parallel=1", {"tied": True}),
    (4, "dp=2,tp=2", {}), (4, "dp=2,tp=2", {"tied": True}),
    (4, "tp=2,pp=2", {}), (4, "tp=2,pp=2,schedule=interleaved", {"n_layers": 4}),
    (4, "tp=2,pp=2,sequence_parallel=1,schedule=1f1b", {}),
    (4, "fsdp=2,tp=2,zero=3", {}), (4, "fsdp=2,tp=2,zero=3", {"tied": True}),
    (4, "fsdp=2,tp=2,zero=1", {}), (4, "fsdp=2,tp=2,zero=3,sequence_parallel=1", {}),
    (8, "dp=2,tp=2,pp=2,sequence_parallel=1", {}),
    (8, "dp=2,tp=2,pp=2,sequence_parallel=1,schedule=1f1b", {"n_layers": 4}),
    (8, "fsdp=2,tp=4,sequence_parallel=1", {"tied": True})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("ranks,layout,kw", LAYOUTS,
                         ids=[f"{n}-{lay}-{kw}" for n, lay, kw in LAYOUTS])
def test_layouts_equal_single(ranks, layout, kw):
    check_against_single(group_comm(ranks), layout, **kw)


# -- refusals on every rank ----------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_tp_refuses_other_losses_and_uneven_sequences():
    model = make_gpt()
    params, x, t = make_case(model)
    engine = ms.make_engine(model, "tp=2,sequence_parallel=1", comm=group_comm(2))
    engine.load_checkpoint(params)
    with pytest.raises(ValueError, match="cross_entropy only"):
        engine.train_step(x, np.zeros((8, 8, 16)), ms.losses.MSE())
    with pytest.raises(ValueError, match="T=7 tokens do not divide by tp=2"):
        engine.train_step(x[:, :7], t[:, :7], CE)
    with pytest.raises(ValueError, match="T=7 tokens do not divide by tp=2"):
        engine.predict(x[:, :7])


# -- what sequence parallelism saves, and the logits a rank holds --------------------------------
def layernorm_bytes(engine) -> int:
    """Bytes the LayerNorms keep on their tapes (their inputs' normalised copies): the
    LayerNorm/residual region's activations."""
    units = []

    def walk(layer):
        units.append(layer)
        for u in getattr(layer, "units", []):
            walk(u)
    for layer in engine.layers:
        walk(layer)
    return sum(a.nbytes for u in units if isinstance(u, LayerNorm) for saved in u.tape.values()
               for a in saved)


@pytest.mark.mpi(min_size=2)
def test_sequence_parallel_divides_layernorm_activations_by_tp():
    comm = group_comm(2)
    model = make_gpt()
    params, x, t = make_case(model)
    held = {}
    for layout in ("tp=2", "tp=2,sequence_parallel=1"):
        engine = ms.make_engine(model, layout, comm=comm)
        engine.load_checkpoint(params)
        logits = engine.forward(engine.shard_batch(x))
        held[layout] = layernorm_bytes(engine), logits.shape
    (plain, shape), (sp, sp_shape) = held["tp=2"], held["tp=2,sequence_parallel=1"]
    print(f"LayerNorm activations per rank: tp=2 {plain} B, tp=2+sp {sp} B ({plain / sp:.1f}x);"
          f" logits held {shape} and {sp_shape} of (8, 8, {model.vocab_size})")
    assert plain == 2 * sp
    assert shape == sp_shape == (8, 8, model.vocab_size // 2)


def test_vocab_parallel_loss_on_one_rank_is_cross_entropy():
    """tp=1 (a world of one): the vocab-parallel loss is CrossEntropy, value and gradient."""
    tp = ms.SingleDevice(make_gpt()).comm.group("tp")
    rng = np.random.default_rng(0)
    y, t = rng.normal(size=(3, 5, 7)) * 4, rng.integers(0, 7, (3, 5))
    value, dy = VocabParallelCrossEntropy(tp, 7)(y, t)
    assert_close(value, CE.value(y, t), rtol=1e-13, what="loss")
    assert_close(dy, CE.grad(y, t), rtol=1e-13, what="dloss/dlogits")


# -- checkpoints and training --------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_checkpoint_saved_under_tp_loads_under_single(tmp_path_factory):
    comm = group_comm(2)
    model = make_gpt()
    params, x, t = make_case(model)
    engine = ms.make_engine(model, "tp=2", comm=comm)
    engine.load_checkpoint(params)
    opt = ms.optim.AdamW(engine, lr=1e-2)
    opt.step(engine.train_step(x, t, CE)[1])
    path = comm.bcast(str(tmp_path_factory.mktemp("gpt_tp")) if comm.rank == 0 else None)
    ms.checkpoint.save(f"{path}/ckpt", engine, opt)
    full = engine.gather_params()
    single = ms.SingleDevice(model)
    single.load_checkpoint(ms.checkpoint.load(f"{path}/ckpt"))
    assert_dicts_close(single.gather_params(), full, rtol=0, what="tp=2 -> single")
    again = ms.make_engine(model, "tp=2", comm=comm)      # and back, optimizer state too
    again.load_checkpoint(model.init(1))
    opt2 = ms.optim.AdamW(again, lr=1e-2)
    ms.checkpoint.restore(f"{path}/ckpt", again, opt2)
    assert set(opt2.state) == set(opt.state)
    for name, state in opt.state.items():
        for key, v in state.items():
            assert_close(opt2.state[name][key], v, rtol=0, what=f"{name} {key}")
    assert_dicts_close(again.gather_params(), full, rtol=0, what="tp=2 -> tp=2")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,dtype", [("dp=2,tp=2", np.float64), ("dp=2,tp=2", np.float32),
                                          ("tp=2,cp=2", np.float64), ("tp=2,cp=2", np.float32)])
def test_adamw_training_follows_single(layout, dtype):
    """50 AdamW steps (clipped at norm 1): the losses under dp=2,tp=2 and tp=2,cp=2 (ring
    attention, vocab-parallel loss) equal single's at rtol 1e-9 in float64 and 1e-4 in
    float32; the final parameters too in float64."""
    comm = group_comm(4)
    model = make_gpt()
    params = model.init(seed=5)
    rng = np.random.default_rng(5)           # rows (a + k s) mod 16: something to learn
    data = (rng.integers(0, 16, (50, 4, 1)) + rng.integers(1, 4, (50, 4, 1)) * np.arange(9)) % 16
    curves, finals = [], []
    for c in (None, comm):
        engine = ms.SingleDevice(model, dtype=dtype) if c is None else \
            ms.make_engine(model, layout, dtype=dtype, comm=c)
        engine.load_checkpoint(params)
        opt = ms.optim.AdamW(engine, lr=3e-3, weight_decay=0.01)
        losses = []
        for batch in data:
            x, t = batch[:, :-1], batch[:, 1:]
            value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
            ms.optim.clip_grad_norm(engine, grads, max_norm=1.0)
            opt.step(grads)
            losses.append(value)
        curves.append(np.array(losses))
        finals.append(engine.gather_params())
    print("single losses", curves[0][::10])
    assert curves[0][-1] < curves[0][0] - 0.5, "the loss goes down"
    what = f"{layout} {np.dtype(dtype).name} AdamW"
    if dtype == np.float32:
        assert_close(curves[1], curves[0], rtol=RTOL32, what=f"{what} losses")
    else:
        assert_close(curves[1], curves[0], rtol=1e-9, what=f"{what} losses")
        assert_dicts_close(finals[1], finals[0], rtol=1e-9, what=f"{what} params")

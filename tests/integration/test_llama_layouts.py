"""ms.Llama on the engine: every layout whose placements do the work (dp, fsdp zero 1-3, pp
with every schedule, recompute, tied under pp) against single in float64 (rtol 1e-9): loss,
every gathered gradient and the gathered logits; checkpoints saved under one layout reopen as
ms.Llama and reshard under others; AdamW under dp follows single; mixed precision runs.

The model has grouped-query attention (n_kv_heads=2 < n_heads=4) and an odd vocabulary.
MPI tests, for N in 1, 2, 4:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/integration/test_llama_layouts.py`
(a k-rank layout runs on `group_comm(k)`).
"""
import os
import shutil
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.cli.train import build_training, parse_train_args
from conftest import assert_close, assert_dicts_close, group_comm, single_reference
from test_device_double import MODES, device_backend
from test_device_double_gpt import check_copies, upload
from mpishard.nn.recompute import Recompute
from mpishard.parallel.compose import plan_params
from test_gpt_engine import make_case

CE = ms.losses.CrossEntropy()


def make_llama(n_layers=2, tied=False, n_kv_heads=2, vocab=13, n_heads=4, seq_len=8):
    """d_model = 4 n_heads (Dh = 4)."""
    return ms.Llama(vocab_size=vocab, seq_len=seq_len, d_model=4 * n_heads, n_heads=n_heads,
                    n_layers=n_layers, n_kv_heads=n_kv_heads, d_ff=24, rope_theta=500.0,
                    tied=tied)


def compare_with_single(comm, layout, model, T=8, rows=8):
    """The engine of `layout`: train_step's loss and gathered gradients, gathered predict and
    gathered params equal single's; no activation left on a tape. Returns the engine."""
    params, x, t = make_case(model, rows, T)
    what = f"{model!r} {layout} T={T}"
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    x_local = engine.shard_batch(x)
    value, grads = engine.train_step(x_local, engine.shard_batch(t), CE)
    assert_close(value, ref_loss, what=f"{what} loss")
    assert_dicts_close(engine.gather_grads(grads), ref_grads, what=what)
    assert_close(engine.gather_batch(engine.predict(x_local)), ref.predict(x),
                 what=f"{what} logits")
    assert_dicts_close(engine.gather_params(), params, rtol=0, what=f"{what} params")
    assert sum(len(layer.tape) for layer in engine.layers) == 0, "activations left stashed"
    return engine


# -- serial ----------------------------------------------------------------------------------------
def test_pipeline_places_embedding_first_and_head_last():
    plan = plan_params(make_llama(4), ms.parse_layout("pp=2,schedule=interleaved"))
    stage = {name: info.placement.stage for name, info in plan.items()}
    assert stage["embed/tokens"] == 0 and stage["ln_f/scale"] == stage["head/weights"] == 1
    assert [stage[f"block_{i}/attn/k/weights"] for i in range(4)] == [0, 1, 0, 1]


def test_recompute_wraps_llama_blocks_and_attention():
    blocks = ms.make_engine(make_llama(), "recompute=1").chunks[0]
    assert [type(u).__name__ for u in blocks] == ["TokenEmbedding", "Recompute", "Recompute",
                                                  "LlamaHead"]
    block = ms.make_engine(make_llama(), "recompute=attn").chunks[0][1]
    attn = block.units[0].units
    assert [repr(u) for u in attn if isinstance(u, Recompute)] == [
        "Recompute(GroupedQueryAttention(q=4, kv=2))"]


# -- every layout against single -------------------------------------------------------------------
TWO = [("dp=2", {}), ("dp=2", {"tied": True, "T": 6}), ("dp=2,overlap=1", {}),
       ("fsdp=2,zero=1", {}), ("fsdp=2,zero=2", {"tied": True}), ("fsdp=2,zero=3", {}),
       ("fsdp=2,zero=3,prefetch=1", {"T": 5}),
       ("pp=2,schedule=gpipe", {}), ("pp=2,schedule=1f1b", {"T": 6, "n_kv_heads": 1}),
       ("pp=2,schedule=1f1b,microbatches=4,stages=1+3", {"n_layers": 4}),
       ("pp=2,schedule=interleaved", {"n_layers": 4}), ("pp=2,schedule=zb1p", {}),
       ("pp=2,schedule=1f1b", {"tied": True}),
       ("dp=2,recompute=1", {}), ("pp=2,recompute=attn", {"n_kv_heads": 4})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,kw", TWO, ids=[f"{lay}-{kw}" for lay, kw in TWO])
def test_two_rank_layouts_equal_single(layout, kw):
    T = kw.pop("T", 8)
    compare_with_single(group_comm(2), layout, make_llama(**kw), T=T)


FOUR = [("pp=4", {"n_layers": 4}), ("pp=4,schedule=interleaved", {"n_layers": 8}),
        ("dp=2,pp=2", {"tied": True}), ("fsdp=2,pp=2", {"T": 6}), ("fsdp=4,zero=3", {}),
        ("dp=2,fsdp=2,zero=2", {"tied": True})]


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout,kw", FOUR, ids=[f"{lay}-{kw}" for lay, kw in FOUR])
def test_four_rank_layouts_equal_single(layout, kw):
    T = kw.pop("T", 8)
    compare_with_single(group_comm(4), layout, make_llama(**kw), T=T)


@pytest.mark.mpi(min_size=1)
def test_single_layout_on_one_rank_equals_single():
    compare_with_single(group_comm(1), "dp=1", make_llama(tied=True))


# -- training, checkpoints, precision --------------------------------------------------------------
def adamw_steps(engine, params, steps=4):
    engine.load_checkpoint(params)
    opt = ms.optim.AdamW(engine, lr=1e-2, weight_decay=0.01)
    rng = np.random.default_rng(3)
    x = rng.integers(0, engine.model.vocab_size, (4, 8))
    losses = []
    for _ in range(steps):
        value, grads = engine.train_step(engine.shard_batch(x),
                                         engine.shard_batch(np.roll(x, -1, axis=1)), CE)
        opt.step(grads)
        losses.append(value)
    return np.array(losses), opt


@pytest.mark.mpi(min_size=2)
def test_adamw_under_fsdp_follows_single_and_checkpoints_reshard():
    """Four AdamW steps under fsdp=2 (zero=3) follow single's; the checkpoint written then
    reopens as the same ms.Llama and loads bit for bit under pp=2, dp=2 and single."""
    comm = group_comm(2)
    model = make_llama(tied=True)
    params = model.init(seed=5)
    ref_losses, _ = adamw_steps(ms.SingleDevice(model), params)
    engine = ms.make_engine(model, "fsdp=2", comm=comm)
    losses, opt = adamw_steps(engine, params)
    print("single losses", ref_losses)
    assert ref_losses[-1] < ref_losses[0]
    assert_close(losses, ref_losses, what="fsdp=2 AdamW losses")
    trained = engine.gather_params()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="llama-ckpt-") if comm.Get_rank() == 0 else None)
    path = os.path.join(tmp, "ck")
    ms.checkpoint.save(path, engine, opt, step=4)
    ck = ms.checkpoint.load(path)
    assert repr(ck.model()) == repr(model) and ck.model().kind == "llama"
    for layout in ("pp=2", "dp=2", "single"):
        other = ms.make_engine(ck.model(), layout, comm=comm) if layout != "single" else \
            ms.SingleDevice(ck.model())
        other.load_checkpoint(ms.checkpoint.load(path))
        assert_dicts_close(other.gather_params(), trained, rtol=0, what=f"reload {layout}")
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp)


@pytest.mark.mpi(min_size=2)
def test_mixed_precision_fp32_parameters_follow_float64():
    """float32 compute with bf16-free settings: dp=2 in float32 follows single float64 within
    float32 rounding (the float64 layouts above are the exact check)."""
    model = make_llama()
    params, x, t = make_case(model)
    _, ref_loss, _ = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, "dp=2", comm=group_comm(2), dtype=np.float32,
                            param_dtype="bfloat16")
    engine.load_checkpoint(params)
    value, _ = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
    print(f"bf16 params, fp32 compute loss {value:.6f} vs float64 {ref_loss:.6f}")
    assert abs(value - ref_loss) < 2e-2 * abs(ref_loss)


# -- the strict device double (tests/device_double.py) ---------------------------------------------
DEVICE = [("single", 1, {}), ("tp=2", 2, {"n_kv_heads": 1}), ("tp=2,sequence_parallel=1", 2, {}),
          ("cp=2", 2, {}), ("cp=2,cp_kind=ulysses", 2, {}), ("pp=2", 2, {"tied": True})]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout,n,kw", DEVICE, ids=[f"{v}-{kw}" for v, _, kw in DEVICE])
def test_llama_train_step_on_device_arrays(layout, n, kw, mode):
    """On the stand-in for cupy, no array crosses the bus but MPI's staging, and the step
    equals numpy single's (rtol 1e-9)."""
    check_device_step(make_llama(**kw), layout, n, mode, logits=True)


def check_device_step(model, layout, n, mode, logits):
    """One train_step of `model` under `layout` on the device double in `mode`: no array
    crosses the bus but MPI's staging (check_copies), and the loss, every gathered gradient
    and (logits=True) the gathered logits equal numpy single's."""
    comm = group_comm(n)
    backend, xp = device_backend(comm, mode)
    name = type(model).__name__
    params, x, t = make_case(model, rows=4)
    ref, want_loss, want = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(model, layout, comm=comm, device=backend)
    engine.load_checkpoint(params)
    x_dev, t_dev = upload(engine, xp, x, t)
    xp.copies.reset()
    backend.staged.update(to_host=0, to_device=0)
    loss, grads = engine.train_step(x_dev, t_dev, CE)
    check_copies(layout, mode, engine, backend, xp, grads)
    assert_close(loss, want_loss, what=f"{name} {layout} {mode} loss")
    assert_dicts_close({k: backend.to_host(v) for k, v in engine.gather_grads(grads).items()},
                       want, what=f"{name} {layout} {mode}")
    if logits:
        assert_close(backend.to_host(engine.gather_batch(engine.predict(x_dev))),
                     ref.predict(x), what=f"{name} {layout} {mode} logits")


def test_batched_cached_generation_on_device_arrays():
    """Greedy batched decoding (left padding: per-row rotary positions; GQA in the cache) on
    the device double gives numpy's ids."""
    model = make_llama(seq_len=12)
    params = {k: 6 * v for k, v in model.init(seed=2).items()}
    backend, _ = device_backend(MPI.COMM_SELF, "staged")
    prompts, got = [[3, 1, 4], [1], [5, 9, 2, 6, 5]], []
    for device in ("cpu", backend):
        engine = ms.make_engine(model, comm=MPI.COMM_SELF, device=device)
        engine.load_checkpoint(params)
        got.append(engine.generate(prompts, 12, temperature=0))
    print(got[0])
    assert got[0] == got[1]


# -- `train --model llama:...` ---------------------------------------------------------------------
TRAIN = ["--model", "llama:d_model=16,n_heads=4,n_kv_heads=2,n_layers=2,seq_len=16,rope_theta=500",
         "--corpus-bytes", "20000", "--batch", "8", "--lr", "0.01", "--no-progress",
         "--log-every", "0", "--dtype", "float64", "--steps", "4", "--eval-every", "2",
         "--log-level", "WARNING"]
_TRAINED = {}


def train_run(layout, comm):
    trainer = build_training(parse_train_args(["--layout", layout, *TRAIN]), comm)
    assert trainer.engine.model.kind == "llama" and trainer.engine.model.vocab_size == 256
    return trainer.fit()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout", [(2, "tp=2"), (2, "cp=2"), (4, "dp=2,tp=2"),
                                      (4, "tp=2,cp=2")])
def test_train_command_follows_single(n, layout):
    """`train --model llama:...` on bytes: every step's loss and the validation losses equal
    single's (float64, rtol 1e-9)."""
    if MPI.COMM_WORLD.Get_size() < n:
        pytest.skip(f"needs {n} ranks")
    if "single" not in _TRAINED:
        _TRAINED["single"] = train_run("single", MPI.COMM_SELF)
    ref, got = _TRAINED["single"], train_run(layout, group_comm(n))
    assert_close(got["loss_history"], ref["loss_history"], what=f"{layout} losses")
    assert_close([e["test_loss"] for e in got["eval_history"]],
                 [e["test_loss"] for e in ref["eval_history"]], what=f"{layout} val losses")
    assert ref["loss_history"][-1] < ref["loss_history"][0]

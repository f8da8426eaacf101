"""Mixed precision (parallel/precision.py, optim.py masters, train/scaler.py).

fp32 compute with bfloat16/float16 parameters and gradient communication: round-trips, the
16-bit all-reduce against its exact fp32 definition, bytes per step halved (measured with
engine.comm_bytes), fp32 master weights, the float16 loss scaler skipping a step on every rank
when one rank overflows, and training to the float32 run's accuracy.
"""
import ml_dtypes
import numpy as np
import pytest
from conftest import group_comm, world

import mpishard as ms
from mpishard.checkpoint.restorer import restore
from mpishard.checkpoint.writer import save
from mpishard.parallel.precision import LOW, LowPrecisionComm
from mpishard.train.data import load_dataset
from mpishard.train.scaler import GradScaler
from mpishard.train.trainer import Trainer

F32, BF16 = np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16)
MODEL = ms.MLP(dims=[8, 16, 4], activation="relu")     # 212 parameters (even: no padding)


def rounded(a, low):
    return np.asarray(a).astype(low).astype(F32)


def batch(rows=8, seed=1):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(rows, 8)), rng.normal(size=(rows, 4))


# -- serial --------------------------------------------------------------------------------------
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_params_round_trip_through_store_gather_and_checkpoint(low, tmp_path):
    params = MODEL.init(seed=0)
    e = ms.make_engine(MODEL, dtype=np.float32, param_dtype=low, comm_dtype=low)
    e.load_checkpoint(params)
    assert e.params["layer_0/weights"].dtype == LOW[low]
    assert e.grads["layer_0/weights"].dtype == F32
    full = e.gather_params()
    diff = max(float(np.abs(full[n] - rounded(params[n], LOW[low])).max()) for n in params)
    print(f"{low}: gather_params vs rounded params max diff {diff:g}")
    assert diff == 0 and full["layer_0/weights"].dtype == F32
    opt = ms.optim.AdamW(e, lr=1e-2)
    x, t = batch()
    e.train_step(x, t, ms.losses.MSE())
    opt.step()
    master = {n: opt.state[n]["master"].copy() for n in params}
    save(str(tmp_path / "ck"), e, opt, step=1)
    e2 = ms.make_engine(MODEL, dtype=np.float32, param_dtype=low, comm_dtype=low)
    e2.load_checkpoint(params)                 # (restore fills the blocks a loaded engine has)
    opt2 = ms.optim.AdamW(e2, lr=1e-2)
    restore(str(tmp_path / "ck"), e2, opt2)
    for n in params:
        assert np.array_equal(opt2.state[n]["master"], master[n])     # fp32 masters, exactly
        assert np.array_equal(e2.params[n], e.params[n])
    # a float32 checkpoint (no masters) still restores into a 16-bit engine
    e32 = ms.make_engine(MODEL, dtype=np.float32)
    e32.load_checkpoint(params)
    save(str(tmp_path / "ck32"), e32, ms.optim.AdamW(e32, lr=1e-2), step=0)
    e3 = ms.make_engine(MODEL, dtype=np.float32, param_dtype=low)
    e3.load_checkpoint(params)
    restore(str(tmp_path / "ck32"), e3, ms.optim.AdamW(e3, lr=1e-2))
    assert np.array_equal(e3.params["layer_1/bias"], params["layer_1/bias"].astype(LOW[low]))


def test_mistakes_raise_before_any_collective():
    with pytest.raises(TypeError, match="needs dtype=float32"):
        ms.make_engine(MODEL, dtype=np.float64, param_dtype="bfloat16")
    with pytest.raises(TypeError, match="comm_dtype must be one of"):
        ms.make_engine(MODEL, dtype=np.float32, comm_dtype="int8")
    with pytest.raises(TypeError, match="dtype must be float32 or float64"):
        ms.make_engine(MODEL, dtype=np.float16)


def test_master_weights_are_updated_in_fp32():
    """Step 1 is exact: a float32 engine loaded with the bf16-rounded weights computes the same
    gradient, so master = p - lr g bit for bit. Later steps differ only because the forward uses
    the rounded master (relative error <= 2**-9 per weight); the updates, each far below half a
    bf16 ulp here (lr 1e-4), must still accumulate in the master: a bf16-only update would
    leave the weights unchanged. Tolerance: 5% of the distance travelled (measured ~0.1%)."""
    params = MODEL.init(seed=0)
    low = {n: rounded(p, BF16) for n, p in params.items()}
    e16 = ms.make_engine(MODEL, dtype=np.float32, param_dtype="bfloat16")
    e32 = ms.make_engine(MODEL, dtype=np.float32)
    e16.load_checkpoint(params)
    e32.load_checkpoint(low)
    o16, o32 = ms.optim.SGD(e16, lr=1e-4), ms.optim.SGD(e32, lr=1e-4)
    for step in range(30):
        x, t = batch(seed=step)
        for e, o in ((e16, o16), (e32, o32)):
            e.train_step(x, t, ms.losses.MSE())
            o.step()
        if step == 0:
            assert all(np.array_equal(o16.state[n]["master"], e32.params[n]) for n in params)
    travelled = max(float(np.abs(e32.params[n] - low[n]).max()) for n in params)
    diff = max(float(np.abs(o16.state[n]["master"] - e32.params[n]).max()) for n in params)
    print(f"master vs float32 run after 30 steps: max diff {diff:g}, travelled {travelled:g}")
    assert diff <= 0.05 * travelled
    for n in params:
        assert np.array_equal(e16.params[n], o16.state[n]["master"].astype(BF16))
    assert e16.memory_report(o16)["optimizer"] == 4 * sum(p.size for p in params.values())


# -- MPI -----------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("low", ["bfloat16", "float16"])
def test_low_all_reduce_is_fp32_sum_of_rounded_values(low):
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    e = ms.make_engine(MODEL, f"dp={n}", dtype=np.float32, comm=comm, comm_dtype=low)
    wire = LowPrecisionComm(e.comm, F32, LOW[low])
    xs = [np.random.default_rng(r).normal(size=(7, 143)).astype(F32) for r in range(n)]
    stacked = np.stack([rounded(x, LOW[low]) for x in xs])          # (n, 7, 143) fp32
    want = rounded(stacked.sum(axis=0), LOW[low]) if n > 1 else xs[0]
    got = wire.all_reduce(xs[rank].copy(), op="sum", group="dp")
    diff = float(np.abs(got - want).max())
    print(f"{low} all_reduce at {n} ranks: max diff {diff:g} (exact expected)")
    assert got.dtype == F32 and diff == 0
    mine = wire.reduce_scatter(np.concatenate([xs[rank]] * n), op="avg", group="dp")
    want_mine = stacked.sum(axis=0) / n if n > 1 else xs[0]     # chunk `rank` of [x_r]*n: x_r
    print(f"{low} reduce_scatter(avg): max diff {float(np.abs(mine - want_mine).max()):g}")
    assert mine.dtype == F32 and np.array_equal(mine, want_mine)


def comm_total(e) -> float:
    return float(sum(e.comm_bytes.values()))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["dp=2", "fsdp=2"])
def test_bytes_per_step_halved(layout):
    comm = group_comm(2)
    x, t = batch(rows=8)
    sent = {}
    for low in (None, "bfloat16"):
        e = ms.make_engine(MODEL, layout, dtype=np.float32, comm=comm, param_dtype=low,
                           comm_dtype=low)
        e.load_checkpoint(MODEL.init(seed=0))
        e.reset_comm_stats()
        e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.MSE())
        sent[low or "float32"] = comm_total(e)
    loss_bytes = 2 * (2 - 1) / 2 * 8                    # global_mean: one float64 all_reduce
    print(f"{layout}: bytes per train_step float32 {sent['float32']:g}, "
          f"bfloat16 {sent['bfloat16']:g} (loss all_reduce {loss_bytes:g} in each)")
    assert sent["bfloat16"] - loss_bytes == (sent["float32"] - loss_bytes) / 2


@pytest.mark.mpi(min_size=2)
def test_loss_scaler_skips_on_inf_on_one_rank_only():
    comm = world()
    n, rank = comm.Get_size(), comm.Get_rank()
    e = ms.make_engine(MODEL, f"dp={n}", dtype=np.float32, comm=comm, param_dtype="float16",
                       comm_dtype="float16")
    e.load_checkpoint(MODEL.init(seed=0))
    opt = ms.optim.SGD(e, lr=0.1)
    scaler = GradScaler(e, growth_interval=2)
    x, t = batch(rows=4 * n)
    before = {k: v.copy() for k, v in e.params.items()}
    e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.MSE(), grad_scale=scaler.scale)
    if rank == n - 1:
        e.grads["layer_1/bias"][0] = np.inf                      # one rank overflows
    stepped, _ = scaler.step(opt)
    assert not stepped and scaler.skipped_steps == 1 and scaler.scale == 2.0 ** 15
    assert all(np.array_equal(before[k], e.params[k]) for k in before)   # every rank skipped
    for _ in range(2):
        e.train_step(e.shard_batch(x), e.shard_batch(t), ms.losses.MSE(),
                     grad_scale=scaler.scale)
        stepped, _ = scaler.step(opt)
        assert stepped
    assert scaler.scale == 2.0 ** 16 and scaler.skipped_steps == 1     # grew after 2 good
    assert not np.array_equal(before["layer_0/weights"], e.params["layer_0/weights"])


@pytest.mark.mpi(min_size=2)
def test_digits_training_matches_float32():
    """dp=2, AdamW lr 3e-3, batch 64, 10 epochs on digits. Tolerance: test accuracy within 2
    points and test loss within 0.05 of the float32 run (run-to-run spread of the rounding)."""
    comm = group_comm(2)
    data = load_dataset("digits", d_in=64, d_out=10, seed=0)
    model = ms.MLP(dims=[64, 128, 128, 10], activation="relu")
    results = {}
    for low in (None, "bfloat16", "float16"):
        e = ms.make_engine(model, "dp=2", dtype=np.float32, comm=comm, param_dtype=low,
                           comm_dtype=low)
        e.load_checkpoint(model.init(seed=0))
        trainer = Trainer(e, ms.optim.AdamW(e, lr=3e-3), data, batch=64, epochs=10,
                          progress=False, log_every=0)
        results[low or "float32"] = trainer.fit()
    for name, m in results.items():
        print(f"digits dp=2 {name}: test accuracy {m['test_accuracy']:.4f}, test loss "
              f"{m['test_loss']:.4f}, final train loss {m['final_loss']:.4f}, "
              f"skipped steps {m['skipped_steps']}")
    ref = results["float32"]
    for name in ("bfloat16", "float16"):
        assert abs(results[name]["test_accuracy"] - ref["test_accuracy"]) <= 0.02
        assert abs(results[name]["test_loss"] - ref["test_loss"]) <= 0.05
    assert results["float16"]["skipped_steps"] >= 0 and results["float32"]["loss_scale"] == 1

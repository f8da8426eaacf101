"""The training loop: the same loss curve on every layout, accumulation, resume, metrics.

    pytest -m "not mpi" tests/train/test_trainer.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_trainer.py
"""
import json
import logging
import os
import shutil
import tempfile

import numpy as np
import pytest

import mpishard as ms
from mpishard.train.data import synthetic_classification, synthetic_regression
from mpishard.train.lr import cosine_schedule
from mpishard.train.optim import AdamW, SGD
from mpishard.train.trainer import Callback, Trainer, TrainState, configure_logging, summary_table

from conftest import RTOL32, RTOL64, assert_close, assert_dicts_close, group_comm, world

DIMS = [8, 16, 16, 4]       # hidden 16 divides by tp = 1, 2, 4, 8


def make_trainer(layout, comm, dtype=np.float64, steps=50, accumulate=2, clip=0.5, batch=16,
                 data=None, dims=DIMS, lr=0.01, **kw):
    """AdamW + cosine schedule + clipping + accumulation on a small classification set."""
    data = data or synthetic_classification(256, 40, d_in=dims[0], n_classes=dims[-1], seed=3)
    model = ms.MLP(dims, activation="tanh",
                   final_activation="sigmoid" if data.task == "binary" else None)
    e = ms.SingleDevice(model, dtype=dtype) if layout == "single" else \
        ms.make_engine(model, layout, dtype=dtype, comm=comm)
    e.load_checkpoint(model.init(seed=5))
    opt = AdamW(e, lr=lr, weight_decay=0.05)
    schedule = cosine_schedule(lr, steps, warmup_steps=5) if steps else None
    return Trainer(e, opt, data, batch=batch, steps=steps, accumulate=accumulate, clip=clip,
                   schedule=schedule, progress=False, log_every=0, seed=11, **kw)


def compare_runs(got, want, rtol, what):
    assert_close(got["loss_history"], want["loss_history"], rtol=rtol, what=f"{what} losses")
    g, w = np.array(got["loss_history"]), np.array(want["loss_history"])
    worst = float(np.max(np.abs(g - w) / np.abs(w)))            # relative at every step
    print(f"{what}: max relative loss difference per step {worst:.2e}")
    assert worst <= rtol, f"{what}: step losses differ by {worst:.2e} relative > {rtol:g}"
    assert_close(got["grad_norm_history"], want["grad_norm_history"], rtol=rtol,
                 what=f"{what} grad norms")
    assert_close(got["test_loss"], want["test_loss"], rtol=rtol, what=f"{what} test loss")
    assert got["test_accuracy"] == want["test_accuracy"], what


# -- the equivalence the issue asks for ---------------------------------------------------------
@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("dtype,rtol", [(np.float64, RTOL64), (np.float32, RTOL32)],
                         ids=["float64", "float32"])
def test_same_loss_curve_on_single_dp4_tp4_dp2tp2(dtype, rtol):
    comm = group_comm(4)
    ref = make_trainer("single", None, dtype).fit()
    assert len(ref["loss_history"]) == 50
    assert ref["loss_history"][-1] < 0.5 * ref["loss_history"][0]       # it does learn
    assert all(0 < n for n in ref["grad_norm_history"])
    assert min(ref["grad_norm_history"]) < 0.5 < max(ref["grad_norm_history"])  # clip bit
    for layout in ("dp=4", "tp=4", "dp=2,tp=2"):
        t = make_trainer(layout, comm, dtype)
        got = t.fit()
        compare_runs(got, ref, rtol, f"{layout} {np.dtype(dtype)}")
        assert got["layout"] == layout and got["world_size"] == 4


@pytest.mark.mpi(min_size=1)
def test_same_loss_curve_at_this_world_size():
    n = world().Get_size()
    ref = make_trainer("single", None, steps=20).fit()
    layouts = [f"dp={n}", f"tp={n}"] + ([f"dp=2,tp={n // 2}"] if n >= 4 and n % 2 == 0 else [])
    for layout in layouts:
        compare_runs(make_trainer(layout, world(), steps=20).fit(), ref, RTOL64, layout)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["pp=2", "pp=2,microbatches=2,schedule=1f1b", "fsdp=2",
                                    "fsdp=2,zero=1"])
def test_pipeline_and_fsdp_plug_in_unchanged(layout):
    """The Trainer only talks to the engine API, so later strategies need no trainer change."""
    comm = group_comm(2)
    ref = make_trainer("single", None, steps=20).fit()
    compare_runs(make_trainer(layout, comm, steps=20).fit(), ref, RTOL64, layout)


@pytest.mark.mpi(min_size=1)
def test_accumulation_equals_the_full_batch_and_defers_communication():
    """k micro-steps of B/k rows give the parameters of one step of B rows, and the gradient
    sync happens once per step (one extra scalar all-reduce for the loss)."""
    n = world().Get_size()
    layout = f"dp={n}"
    full = make_trainer(layout, world(), steps=8, accumulate=1, batch=8 * n, clip=None)
    acc = make_trainer(layout, world(), steps=8, accumulate=4, batch=8 * n, clip=None)
    m_full, m_acc = full.fit(), acc.fit()
    assert_close(m_acc["loss_history"], m_full["loss_history"], what="losses")
    assert_dicts_close(acc.engine.gather_params(), full.engine.gather_params(), what="params")
    for t in (full, acc):
        t.engine.reset_comm_stats()
        t.total_steps += 1
        t.train_step()
    calls = {k: t.engine.comm_calls["all_reduce"] for k, t in (("1", full), ("4", acc))}
    print(f"all_reduce calls per step: accumulate=1 {calls['1']}, accumulate=4 {calls['4']}")
    if n > 1:
        assert calls["4"] == calls["1"] + 1


@pytest.mark.mpi(min_size=1)
def test_resume_from_state_continues_exactly():
    """A callback checkpoints (params, optimizer state, TrainState) at step 6; a new trainer
    restored from it finishes with the uninterrupted run's parameters and curve."""
    n = world().Get_size()
    layout = f"dp=2,tp={n // 2}" if n >= 4 and n % 2 == 0 else f"tp={n}"

    class Snapshot(Callback):
        saved = None

        def on_step_end(self, trainer):
            if trainer.state.step == 6:
                host = trainer.engine.backend.to_host
                params = {k: np.array(host(v)) for k, v in trainer.engine.gather_params().items()}
                self.saved = (params, trainer.optimizer.state_dict(),
                              trainer.state.to_dict())

    snap = Snapshot()
    whole = make_trainer(layout, world(), steps=12, callbacks=[snap])
    m_whole = whole.fit()
    params, opt_state, state = snap.saved
    resumed = make_trainer(layout, world(), steps=12)
    resumed.engine.load_checkpoint(params)
    resumed.optimizer.load_state_dict(opt_state)
    resumed.state = TrainState.from_dict(json.loads(json.dumps(state)))
    m_resumed = resumed.fit()
    assert_close(m_resumed["loss_history"], m_whole["loss_history"], rtol=0, what="curve")
    assert_dicts_close(resumed.engine.gather_params(), whole.engine.gather_params(), rtol=0,
                       what="params")


@pytest.mark.mpi(min_size=1)
def test_metrics_json_on_rank_0_and_callbacks():
    comm = world()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="mpishard-test-") if comm.Get_rank() == 0 else None)
    path = os.path.join(tmp, "metrics.json")
    events = []

    class Record(Callback):
        def on_train_begin(self, trainer):
            events.append("begin")

        def on_step_end(self, trainer):
            events.append(trainer.state.step)

        def on_evaluate(self, trainer, result):
            events.append(("eval", result["step"]))

        def on_train_end(self, trainer, metrics):
            events.append("end")

    data = synthetic_classification(64, 20, d_in=8, n_classes=4, seed=0)
    t = make_trainer(f"dp={comm.Get_size()}", comm, steps=None, epochs=3, batch=16, data=data,
                     eval_every=5, callbacks=[Record()])
    m = t.fit(metrics_path=path)
    assert events == ["begin", 1, 2, 3, 4, ("eval", 5), 5, 6, 7, 8, 9, ("eval", 10), 10, 11, 12,
                      ("eval", 12), "end"]
    assert m["steps"] == 12 and m["epochs"] == 3.0 and len(m["loss_history"]) == 12
    comm.Barrier()
    if comm.Get_rank() == 0:
        on_disk = json.load(open(path))
        for key in ("test_accuracy", "final_loss", "steps", "layout", "world_size",
                    "samples_per_s", "loss_history"):
            assert on_disk[key] == m[key], key
        assert on_disk["samples_per_s"] > 0 and 0.0 <= on_disk["test_accuracy"] <= 1.0
        assert on_disk["final_loss"] == on_disk["loss_history"][-1]
    comm.Barrier()
    if comm.Get_rank() == 0:
        shutil.rmtree(tmp)


# -- serial ---------------------------------------------------------------------------------------
def test_evaluation_matches_a_direct_prediction():
    t = make_trainer("single", None, steps=10)
    t.fit()
    y = t.engine.predict(t.data.x_test)
    acc = float((y.argmax(axis=1) == t.data.t_test).mean())
    result = t.evaluate()
    assert result["test_accuracy"] == acc
    assert_close(result["test_loss"], ms.losses.CrossEntropy().value(y, t.data.t_test),
                 what="test loss")


def test_binary_and_regression_tasks():
    binary = synthetic_classification(128, 30, d_in=16, n_classes=1, seed=0)
    m = make_trainer("single", None, steps=60, data=binary, dims=[16, 8, 1], lr=0.05).fit()
    assert m["loss"] == "bce" and m["test_accuracy"] > 0.9
    reg = synthetic_regression(128, 30, d_in=4, d_out=2, seed=0)
    m = make_trainer("single", None, steps=30, data=reg, dims=[4, 16, 2]).fit()
    assert m["loss"] == "mse" and m["test_accuracy"] is None
    assert m["final_loss"] < m["loss_history"][0]


def test_sgd_and_constant_lr():
    data = synthetic_classification(64, 16, d_in=8, n_classes=4, seed=0)
    model = ms.MLP(DIMS)
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(0))
    m = Trainer(e, SGD(e, 0.1, momentum=0.9), data, batch=16, epochs=2, progress=False).fit()
    assert m["steps"] == 8 and m["lr_history"] == [0.1] * 8 and m["grad_norm_history"] == []


def test_trainer_rejects_bad_arguments():
    data = synthetic_classification(64, 16, d_in=8, n_classes=4, seed=0)
    e = ms.SingleDevice(ms.MLP(DIMS))
    e.load_checkpoint(ms.MLP(DIMS).init(0))
    opt = SGD(e, 0.1)
    with pytest.raises(ValueError, match="exactly one of steps and epochs"):
        Trainer(e, opt, data, batch=16, steps=3, epochs=1)
    with pytest.raises(ValueError, match="global batch 12 must divide by accumulate 8"):
        Trainer(e, opt, data, batch=12, steps=3, accumulate=8)
    with pytest.raises(ValueError, match="clip must be a finite number > 0"):
        Trainer(e, opt, data, batch=16, steps=3, clip=0)
    with pytest.raises(ValueError, match="clip must be a finite number > 0"):
        Trainer(e, opt, data, batch=16, steps=3, clip=float("inf"))   # not at the first clip


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout,batch,accumulate,rows", [("pp=2,microbatches=4", 8, 4, 2),
                                                          ("pp=2,microbatches=3", 8, 1, 8)])
def test_trainer_checks_microbatches_against_each_micro_step(layout, batch, accumulate, rows):
    """Each micro-step feeds batch / accumulate / dp rows to train_step, which splits them
    into microbatches: a mismatch is refused when the Trainer is built (the same ValueError on
    every rank, so the CLI prints one line), not mid-fit."""
    comm = group_comm(2)
    data = synthetic_regression(64, 16, d_in=DIMS[0], d_out=DIMS[-1], seed=0)
    e = ms.make_engine(ms.MLP(DIMS), layout, comm=comm)
    e.load_checkpoint(ms.MLP(DIMS).init(0))
    with pytest.raises(ValueError, match=f"does not divide the {rows} rows each rank gets"):
        Trainer(e, SGD(e, 0.1), data, batch=batch, steps=1, accumulate=accumulate,
                progress=False)


def test_logging_has_the_rank_and_only_rank_0_informs(capsys):
    log = configure_logging(0)
    log.info("hello from zero")
    configure_logging(3).info("quiet")
    configure_logging(3).warning("loud")
    err = capsys.readouterr().err
    assert "[rank 0] INFO mpishard: hello from zero" in err
    assert "quiet" not in err and "[rank 3] WARNING mpishard: loud" in err
    configure_logging(0, logging.WARNING)


def test_summary_table():
    table = summary_table({"layout": "dp=2,tp=2", "world_size": 4, "steps": 10, "epochs": 2.0,
                           "final_loss": 0.125, "test_loss": 0.5, "test_accuracy": 0.97,
                           "samples_per_s": 1234.4, "wall_time_s": 3.21})
    print(table)
    for text in ("dp=2,tp=2", "| world size", "97.00%", "1234", "3.21 s", "0.125"):
        assert text in table


class TickingClock:
    """A stand-in for the trainer's `time` module: perf_counter advances 1 s per call, so a
    step (two calls) takes exactly 1 s of train time."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        self.now += 1.0
        return self.now


def gpt_trainer(steps):
    """A tiny GPT on 4,000 bytes of text, batches of 4 windows of 8 bytes."""
    from mpishard.train.text import text_dataset

    model = ms.GPT(vocab_size=256, seq_len=8, d_model=8, n_heads=2, n_layers=1)
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=0))
    return Trainer(e, SGD(e, 0.1), text_dataset(seq_len=8, max_bytes=4000), batch=4,
                   steps=steps, progress=False, log_every=3, logger=configure_logging(0))


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_a_resumed_runs_throughput_counts_its_own_steps(monkeypatch, capsys, kind):
    """Resumed at step 6 of 12, a run trains 6 steps in 6 s (a clock ticking 1 s per read):
    its samples/s (log lines, metrics) and tokens/s are the uninterrupted run's, not 12
    steps' samples over 6 s."""
    from mpishard.train import trainer as trainer_module

    def run(resume_at=0):
        monkeypatch.setattr(trainer_module, "time", TickingClock())
        t = gpt_trainer(12) if kind == "gpt" else \
            make_trainer("single", None, steps=12, batch=4, logger=configure_logging(0))
        t.log_every = 3
        t.state = TrainState(step=resume_at, samples=resume_at * 4)
        return t, t.fit()

    whole, m_whole = run()
    capsys.readouterr()
    resumed, m_resumed = run(resume_at=6)
    logged = [float(ln.rsplit("samples/s ", 1)[1].split()[0])
              for ln in capsys.readouterr().err.splitlines() if " samples/s " in ln]
    assert whole.train_time == 12.0 and resumed.train_time == 6.0
    assert m_whole["samples_per_s"] == m_resumed["samples_per_s"] == 4.0
    assert logged == [4.0, 4.0]                              # steps 9 and 12
    if kind == "gpt":
        assert m_whole["tokens_per_s"] == m_resumed["tokens_per_s"] == 32.0
    configure_logging(0, logging.WARNING)


@pytest.mark.parametrize("changed", [False, True])
def test_the_blas_threads_line_is_said_once(capsys, changed):
    """health/threads.py logs a pool it changed (WARNING); the trainer says the threads at INFO
    only when nothing was changed, so a run prints the notice once either way."""
    from mpishard.health.threads import BlasThreads

    t = make_trainer("single", None, steps=1, logger=configure_logging(0))
    t.engine.blas_threads = BlasThreads(1, 2 if changed else 1, "2 rank(s) share 2 CPU(s)")
    t.fit()
    err = capsys.readouterr().err
    configure_logging(0, logging.WARNING)
    assert err.count("BLAS threads per rank") == (0 if changed else 1), err

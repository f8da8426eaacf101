"""Pipeline parallelism against the single-device reference, float64, rtol 1e-9.

MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi
tests/parallel/test_pipeline.py` for N in 1, 2, 4, 8 (a pp=k layout runs on `group_comm(k)`,
several groups side by side).
Serial tests (stage assignment, the examples under mpiexec): `pytest -m "not mpi"`.
"""
from pathlib import Path

import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, run_mpi, single_reference
from mpishard.parallel.schedules import Action, ideal_bubble, simulate
from mpishard.parallel.pipeline import pipeline_bubble
from mpishard.parallel.stages import assign_stages

ROOT = Path(__file__).resolve().parents[2]
WIDTHS = [10, 6, 12, 8]                     # hidden sizes cycle through these (all even: tp=2)


def make_model(depth, d_in=8, d_out=4, activation="tanh"):
    hidden = [WIDTHS[i % len(WIDTHS)] for i in range(depth - 1)]
    return ms.MLP(dims=[d_in] + hidden + [d_out], activation=activation)


def make_data(model, rows=16, loss="mse", seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, model.d_in))
    if loss == "cross_entropy":
        return x, rng.integers(0, model.d_out, size=rows)
    return x, rng.normal(size=(rows, model.d_out))


def check_against_single(comm, layout, depth, loss="mse", rows=16):
    """train_step (loss, every gradient) and predict of `layout` equal single's; the engine."""
    model = make_model(depth)
    params = model.init(seed=depth)
    x, t = make_data(model, rows, loss)
    ref, ref_loss, ref_grads = single_reference(model, params, x, t, loss)
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    value, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), loss)
    assert_close(value, ref_loss, what=f"{layout} depth {depth} loss")
    assert_dicts_close(engine.gather_grads(grads), ref_grads, what=f"{layout} depth {depth}")
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    assert_close(y, ref.predict(x), what=f"{layout} depth {depth} predict")
    assert sum(len(layer.tape) for layer in engine.layers) == 0, "activations left stashed"
    return engine


def all_same_error(comm, fn):
    """fn() raises ValueError on every rank of comm, with the same message; return it."""
    with pytest.raises(ValueError) as info:
        fn()
    messages = comm.allgather(str(info.value))          # control data
    assert len(set(messages)) == 1, messages
    return messages[0]


# -- stage assignment (no MPI) -----------------------------------------------------------------
def test_assign_stages_balances_parameter_count():
    equal = ms.MLP([8] * 9)                                # 8 equal layers
    assert assign_stages(equal, ms.parse_layout("pp=4")) == [0, 0, 1, 1, 2, 2, 3, 3]
    interleaved = ms.parse_layout("pp=2,schedule=interleaved")
    assert assign_stages(equal, interleaved) == [0, 0, 1, 1, 2, 2, 3, 3]
    assert sorted(np.bincount(assign_stages(equal, ms.parse_layout("pp=3")))) == [2, 3, 3]
    heavy = ms.MLP([100, 4, 4, 4, 4])                      # layer 0 dwarfs the rest
    assert assign_stages(heavy, ms.parse_layout("pp=2")) == [0, 1, 1, 1]
    for model, pp in [(make_model(d), pp) for pp in (2, 4, 8) for d in (pp, 2 * pp, 3 * pp)]:
        stages = assign_stages(model, ms.parse_layout(f"pp={pp}"))
        assert len(stages) == model.n_layers
        assert stages == sorted(stages) and set(stages) == set(range(pp))


def test_assign_stages_explicit_split():
    assert assign_stages(ms.MLP([8] * 5), ms.parse_layout("pp=2,stages=3+1")) == [0, 0, 0, 1]
    interleaved = ms.parse_layout("pp=2,schedule=interleaved,stages=2+1+1+1")
    assert assign_stages(ms.MLP([8] * 6), interleaved) == [0, 0, 1, 2, 3]


@pytest.mark.parametrize("dims,layout,words", [
    ([8] * 4, "pp=4", "pp=4 needs at least 4 layers, model has 3"),
    ([8] * 4, "pp=2,schedule=interleaved", "needs at least 4 layers, model has 3"),
    ([8] * 7, "pp=2,schedule=interleaved", "4 virtual stages do not divide the model's 6"),
    ([8] * 8, "pp=2,schedule=interleaved,virtual_stages=3",
     "6 virtual stages do not divide the model's 7"),
    ([8] * 5, "pp=2,stages=2+1", "sums to 3 layers, model has 4"),
    ([8] * 5, "pp=2,stages=2+1+1", "names 3 stages, but pp=2 needs 2"),
    ([8] * 5, "pp=2,stages=4+0", "at least 1 layer"),
    ([8] * 5, "pp=2,stages=a+b", "layer counts joined by '+'"),
    ([8] * 5, "pp=2,schedule=interleaved,virtual_stages=1", "needs virtual_stages >= 2"),
    ([8] * 5, "pp=2,virtual_stages=2", "virtual_stages=2 needs schedule=interleaved"),
])
def test_assign_stages_rejects_bad_layouts(dims, layout, words):
    with pytest.raises(ValueError) as info:
        assign_stages(ms.MLP(dims), ms.parse_layout(layout))
    assert words in str(info.value), str(info.value)


# -- against single ----------------------------------------------------------------------------
def cases():
    out = []
    for pp in (2, 4, 8):
        for schedule in ("gpipe", "1f1b"):
            for m in (1, pp, 2 * pp):
                out += [(pp, schedule, m, d) for d in (pp, 2 * pp, 3 * pp)]
        out += [(pp, "interleaved", m, 2 * pp) for m in (pp, 2 * pp)]
    return out + [(2, "interleaved,virtual_stages=3", 4, 6), (4, "interleaved", 4, 16)]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pp,schedule,m,depth", cases())
def test_matches_single(pp, schedule, m, depth):
    comm = group_comm(pp)
    loss = "cross_entropy" if depth % 2 else "mse"
    check_against_single(comm, f"pp={pp},microbatches={m},schedule={schedule}", depth, loss)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pp,schedule", [(2, "1f1b"), (2, "interleaved"), (4, "gpipe"),
                                         (4, "interleaved")])
def test_forward_backward_single_passes(pp, schedule):
    """engine.forward(x) then engine.backward(dy): one microbatch through every stage."""
    comm = group_comm(pp)
    model = make_model(2 * pp)
    params = model.init(seed=3)
    x, t = make_data(model)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    y_ref = ref.forward(x)
    dy = y_ref - t
    g_ref = {k: v.copy() for k, v in ref.backward(dy).items()}
    engine = ms.make_engine(model, f"pp={pp},schedule={schedule}", comm=comm)
    engine.load_checkpoint(params)
    y = engine.forward(engine.shard_batch(x), mb=5)
    assert (y is None) == (engine.stage != pp - 1)
    assert_close(engine.gather_batch(y), y_ref, what="forward")
    grads = engine.backward(dy if engine.stage == pp - 1 else None, mb=5)
    assert_dicts_close(engine.gather_grads(grads), g_ref, what="backward")


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["pp=2,tp=2,microbatches=4", "dp=2,pp=2,microbatches=2",
                                    "pp=2,tp=2,schedule=interleaved,microbatches=4",
                                    "dp=2,pp=2,schedule=gpipe,microbatches=4"])
def test_combined_with_dp_and_tp(layout):
    comm = group_comm(4)
    for depth in ((4, 8) if "interleaved" in layout else (4, 5)):
        check_against_single(comm, layout, depth, "mse" if depth == 4 else "cross_entropy")


# -- what the running engine measures ----------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pp", [2, 4, 8])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_stash_idle_and_bubble(pp, schedule):
    comm = group_comm(pp)
    m = 2 * pp
    engine = check_against_single(comm, f"pp={pp},microbatches={m},schedule={schedule}",
                                  2 * pp)
    st, s, v = engine.stats, engine.stage, engine.stats["virtual_stages"]
    assert st["idle_s"] >= 0 and 0 < st["busy_s"] <= st["step_s"]
    assert 0 <= st["bubble_fraction"] < 1
    measured = pipeline_bubble(engine)
    assert 0 <= measured < 1
    # the actions the engine ran, simulated: a valid schedule with the textbook bubble,
    # whose peak live activations are what the engine's tapes held
    actions = comm.allgather([tuple(a) for a in st["actions"]])          # control data
    peaks = comm.allgather(st["peak_stashed"])
    sim = simulate([[Action(*a) for a in row] for row in actions], pp, m, v)
    assert sim.peak_live_activations == peaks
    if schedule == "gpipe":
        assert peaks == [m] * pp                                    # GPipe holds all m
    elif schedule == "1f1b":
        assert peaks == [min(m, pp - i) for i in range(pp)]         # 1F1B: pp - stage
        assert max(peaks) <= pp
    if schedule == "interleaved":
        assert sim.bubble_fraction <= ideal_bubble(pp, m, v) + 1e-12
    else:
        assert sim.bubble_fraction == pytest.approx((pp - 1) / (m + pp - 1), abs=1e-12)
    print(f"{schedule} pp={pp} m={m} stage {s}: peak stashed {st['peak_stashed']}, idle "
          f"{st['idle_s'] * 1e3:.2f} ms, busy {st['busy_s'] * 1e3:.2f} ms, step "
          f"{st['step_s'] * 1e3:.2f} ms; bubble measured {measured:.3f}, schedule "
          f"{sim.bubble_fraction:.3f}, ideal {ideal_bubble(pp, m, v):.3f}")


# -- streaming inference -----------------------------------------------------------------------
class Collect:
    def __init__(self):
        self.items = []

    def write(self, arr):
        self.items.append(np.array(arr))


def check_stream(comm, layout, depth, n_requests):
    model = make_model(depth, activation="relu")
    params = model.init(seed=7)
    rng = np.random.default_rng(n_requests)
    batches = [rng.normal(size=(1 + i % 3, model.d_in)) for i in range(n_requests)]
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(params)
    out = Collect()
    engine.inference_loop(iter(batches), out)                # returns on every rank
    pp = engine.layout.size("pp")
    if engine.stage == pp - 1:
        assert len(out.items) == n_requests
        for i, (y, xb) in enumerate(zip(out.items, batches)):
            assert_close(y, ref.predict(xb), what=f"request {i}")
        assert engine.stats["inference_requests"] == n_requests
    else:
        assert out.items == []
    assert engine.stats["inference_idle_s"] >= 0
    return engine


@pytest.mark.mpi(min_size=4)
def test_inference_loop_streams_100_batches_pp4():
    comm = group_comm(4)
    engine = check_stream(comm, "pp=4", 6, 100)
    # the pipeline still trains right after streaming (no message was left behind)
    model = make_model(6, activation="relu")
    x, t = make_data(model)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(model.init(seed=7))
    value, _ = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), "mse")
    assert_close(value, ref.train_step(x, t, "mse")[0], what="loss after streaming")


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n_requests", [0, 4, 7])
def test_inference_loop_interleaved_and_short_streams(n_requests):
    check_stream(group_comm(2), "pp=2,schedule=interleaved", 4, n_requests)


class Affine:
    """A stand-in layer for the stream test: h -> 2 h + 1, whatever h's shape."""

    def forward(self, h, mb, record):
        return 2 * h + 1

    def in_flight(self):
        return ()


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["pp=2", "pp=2,schedule=interleaved"])
def test_inference_loop_end_of_stream_is_a_message_kind(layout):
    """The end of stream travels as a message kind of its own (a group's request count), so a
    stage never guesses it from a request's shape: 1-D activations between the stages, which
    the end-of-stream marker (a 1-D array) was once told apart from by ndim alone, all come
    through, and the pipeline returns on every rank."""
    engine = ms.make_engine(make_model(4), layout, comm=group_comm(2))
    runner = engine.runner
    runner.chunks = [[Affine()] for _ in runner.chunks]      # 2 h + 1 on each virtual stage
    requests = [np.arange(1.0, 2.0 + i) for i in range(5)]   # 1-D, of 1 to 5 elements
    out = Collect()
    runner.inference_loop(iter(requests), out)
    if runner.stage == runner.pp - 1:
        want = list(requests)
        for _ in range(runner.n_virtual):
            want = [2 * x + 1 for x in want]
        assert len(out.items) == len(requests)
        for got, expected in zip(out.items, want):
            np.testing.assert_array_equal(got, expected)
    else:
        assert out.items == []


@pytest.mark.mpi(min_size=4)
def test_inference_loop_with_tp_and_dp():
    comm = group_comm(4)
    check_stream(comm, "pp=2,tp=2", 4, 9)
    check_stream(comm, "dp=2,pp=2", 3, 9)


# -- bad input: the same clear error on every rank ---------------------------------------------
@pytest.mark.mpi(min_size=2)
def test_microbatches_must_divide_the_batch():
    comm = group_comm(2)
    model = make_model(4)
    engine = ms.make_engine(model, "pp=2,microbatches=3", comm=comm)
    engine.load_checkpoint(model.init(0))
    x, t = make_data(model)
    msg = all_same_error(comm, lambda: engine.train_step(x, t, "mse"))
    assert "microbatches=3 does not divide the local batch of 16 rows" in msg
    msg = all_same_error(comm, lambda: ms.make_engine(
        model, "pp=2,microbatches=3,schedule=interleaved", comm=comm))
    assert "microbatches (3)" in msg and "pp (2)" in msg
    value, _ = engine.train_step(x[:15], t[:15], "mse")         # 15 rows: 3 of 5 each
    assert np.isfinite(value)


@pytest.mark.mpi(min_size=4)
def test_pp_larger_than_the_model_and_uneven_virtual_stages():
    comm = group_comm(4)
    msg = all_same_error(comm, lambda: ms.make_engine(make_model(3), "pp=4", comm=comm))
    assert msg == "pp=4 needs at least 4 layers, model has 3"
    msg = all_same_error(comm, lambda: ms.make_engine(
        make_model(12), "pp=4,schedule=interleaved", comm=comm))
    assert "8 virtual stages do not divide the model's 12 layers" in msg
    engine = ms.make_engine(make_model(12), "pp=2,dp=2,microbatches=4", comm=comm)
    engine.load_checkpoint(make_model(12).init(0))
    x = engine.shard_batch(np.zeros((12, 8)))
    msg = all_same_error(comm, lambda: engine.train_step(x, x[:, :4], "mse"))
    assert "microbatches=4 does not divide the local batch of 6 rows" in msg


# -- the examples, launched as a user would ----------------------------------------------------
@pytest.mark.parametrize("script,n,args", [
    ("pipeline_bce_two_stages.py", 2, []),
    ("pipeline_deep_mlp.py", 4, ["--steps", "2"]),
    ("pipeline_deep_mlp.py", 4, ["--steps", "1", "--schedule", "interleaved"]),
])
def test_example_runs_and_agrees(script, n, args):
    proc = run_mpi(n, ROOT / "examples" / script, *args, env={"OPENBLAS_NUM_THREADS": "1"})
    print(proc.stdout, proc.stderr)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "agrees with single" in proc.stdout
    assert proc.stdout.count("agrees with single") == 1          # rank 0 alone prints

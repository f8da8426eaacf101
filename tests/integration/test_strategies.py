"""Every layout against the single-device reference, in float64 with rtol 1e-9.

For each layout that fits the world size (single, dp=N, tp=N, dp=a,tp=b) and each model case
(1 to 4 layers, every activation, with and without bias) the engine must reproduce
`ms.SingleDevice`: the forward output (gather_batch of predict), the global mean loss (the same
float on every rank) and every gradient (gather_grads), through train_step and through the
ShardedEngine chapter's forward + backward(dy). A layout of n ranks runs on `group_comm(n)`,
so at 8 ranks the 2-rank layouts run four times side by side.

    mpiexec -n 8 python -m mpi4py -m pytest --with-mpi -m mpi tests/integration/test_strategies.py
"""
import numpy as np
import pytest

import mpishard as ms

from conftest import RTOL32, RTOL64, assert_close, assert_dicts_close, group_comm

BATCH = 16                      # divisible by every dp size used here (1, 2, 4, 8)

LAYOUTS = ["single",
           "dp=2", "tp=2",
           "dp=4", "tp=4", "dp=2,tp=2",
           "dp=8", "tp=8", "dp=2,tp=4", "dp=4,tp=2"]

# (dims, activation, bias, final_activation). Hidden widths that tp splits (the outputs of the
# column layers 0 and 2) are 16, divisible by tp up to 8; the row layers' outputs (12, 5) and
# the model's input/output widths (6, 5) need not divide. 3 layers: a Megatron pair plus a
# replicated last layer; 1 layer: replicated.
CASES = [
    ([6, 5], "relu", True, "tanh"),
    ([6, 5], "relu", False, "sigmoid"),
    ([6, 16, 5], "relu", True, None),
    ([6, 16, 5], "sigmoid", False, None),
    ([6, 16, 12, 5], "gelu", True, None),
    ([6, 16, 12, 5], "identity", False, None),
    ([6, 16, 12, 16, 5], "tanh", True, None),
    ([6, 16, 12, 16, 5], "relu", False, "gelu"),
]


def case_id(case):
    dims, act, bias, final = case
    return (f"{len(dims) - 1}L-{act}-{'bias' if bias else 'nobias'}"
            + (f"-final_{final}" if final else ""))


def layout_size(layout):
    return ms.parse_layout(layout).world_size


def make_model(case):
    dims, act, bias, final = case
    return ms.MLP(dims, activation=act, bias=bias, final_activation=final)


def data(model, seed=0, labels=False):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((BATCH, model.d_in))
    if labels:
        t = rng.integers(0, model.d_out, BATCH)
    else:
        t = rng.standard_normal((BATCH, model.d_out))
    return x, t


def reference(model, params, x, t, loss=None, dtype=np.float64):
    """The single-device numbers: output, loss, gradients (copied out of the engine)."""
    ref = ms.SingleDevice(model, dtype=dtype)
    ref.load_checkpoint(params)
    y = ref.predict(x).copy()
    value, grads = ref.train_step(x, t, loss or ms.losses.MSE())
    return y, value, {k: g.copy() for k, g in grads.items()}


def build(model, layout, params, dtype=np.float64):
    comm = group_comm(layout_size(layout))
    engine = ms.make_engine(model, layout, dtype=dtype, comm=comm)
    engine.load_checkpoint(params)
    return engine


def same_on_every_rank(engine, value):
    values = engine.mpi_comm.allgather(value)
    assert all(v == values[0] for v in values), f"ranks disagree: {values}"


# -- the main equivalence ----------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single(layout, case):
    model = make_model(case)
    params = model.init(seed=3)
    x, t = data(model)
    want_y, want_loss, want_grads = reference(model, params, x, t)
    engine = build(model, layout, params)
    tag = f"{layout} {case_id(case)}"

    x_local, t_local = engine.shard_batch(x), engine.shard_batch(t)
    assert x_local.shape[0] == BATCH // engine.data_parallel_size

    # forward output, without an activation tape
    assert_close(engine.gather_batch(engine.predict(x_local)), want_y, RTOL64, what=f"{tag} y")

    # train_step: global mean loss (identical on every rank) and every gradient
    loss, grads = engine.train_step(x_local, t_local, ms.losses.MSE())
    same_on_every_rank(engine, loss)
    assert_close(loss, want_loss, RTOL64, what=f"{tag} loss")
    assert_dicts_close(engine.gather_grads(grads), want_grads, RTOL64, what=f"{tag} train_step")

    # the ShardedEngine chapter's calls: forward, then backward(dy), dy = dL/dy of this
    # rank's local-mean loss
    y_local = engine.forward(x_local)
    assert_close(engine.gather_batch(y_local), want_y, RTOL64, what=f"{tag} forward")
    _, dy_local = ms.losses.MSE()(y_local, t_local)
    g = engine.backward(dy_local)
    assert set(g) == set(model.param_names())
    assert_dicts_close(engine.gather_grads(g), want_grads, RTOL64, what=f"{tag} backward(dy)")

    # the parameters were not touched, and gather_params returns the checkpoint bit for bit
    full = engine.gather_params()
    assert set(full) == set(params)
    for k in params:
        assert full[k].dtype == np.float64 and full[k].shape == params[k].shape
        np.testing.assert_array_equal(full[k], params[k], err_msg=f"{tag} gather_params {k}")


# -- other losses ------------------------------------------------------------------------------
LOSS_CASES = {
    "bce": (ms.MLP([6, 16, 4], "gelu", final_activation="sigmoid"), ms.losses.BCE, False),
    "cross_entropy": (ms.MLP([6, 16, 12, 4], "tanh"), ms.losses.CrossEntropy, True),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("name", sorted(LOSS_CASES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_losses_match_single(layout, name):
    model, loss_cls, labels = LOSS_CASES[name]
    params = model.init(seed=5)
    x, t = data(model, seed=1, labels=labels)
    if name == "bce":
        t = (t > 0).astype(np.float64)                   # 0/1 targets for the probabilities
    _, want_loss, want_grads = reference(model, params, x, t, loss_cls())
    engine = build(model, layout, params)
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), loss_cls())
    same_on_every_rank(engine, loss)
    assert_close(loss, want_loss, RTOL64, what=f"{layout} {name} loss")
    assert_dicts_close(engine.gather_grads(grads), want_grads, RTOL64, what=f"{layout} {name}")


# -- float32 -----------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_float32_within_1e4(layout):
    model = ms.MLP([6, 16, 12, 16, 5], "gelu")
    params = model.init(seed=7)
    x, t = data(model, seed=2)
    want_y, want_loss, want_grads = reference(model, params, x, t)      # float64
    engine = build(model, layout, params, dtype=np.float32)
    assert all(p.dtype == np.float32 for p in engine.params.values())
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    assert y.dtype == np.float32
    assert_close(y, want_y, RTOL32, what=f"{layout} float32 y")
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                    ms.losses.MSE())
    assert all(g.dtype == np.float32 for g in grads.values())
    assert_close(loss, want_loss, RTOL32, what=f"{layout} float32 loss")
    assert_dicts_close(engine.gather_grads(grads), want_grads, RTOL32, what=f"{layout} float32")
    full = engine.gather_params()                        # the float32 checkpoint, exactly
    for k in params:
        np.testing.assert_array_equal(full[k], params[k].astype(np.float32))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", ["single", "dp=2", "tp=2", "pp=2"])
def test_integer_inputs_compute_in_the_engine_dtype(layout):
    """Integer features (raw pixel counts, say) are cast like float16 ones: a float32 engine
    computes (and a pipeline sends) float32, not float64, and matches single fed floats."""
    model = ms.MLP([6, 16, 12, 5], "relu")
    params = model.init(seed=3)
    rng = np.random.default_rng(4)
    x = rng.integers(-3, 4, (BATCH, model.d_in))
    t = rng.standard_normal((BATCH, model.d_out))
    want_y, want_loss, want_grads = reference(model, params, x.astype(np.float32), t,
                                              dtype=np.float32)
    engine = build(model, layout, params, dtype=np.float32)
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    assert y.dtype == np.float32, f"{layout}: output {y.dtype} from int64 input"
    assert_close(y, want_y, RTOL32, what=f"{layout} int input y")
    loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                    ms.losses.MSE())
    assert_close(loss, want_loss, RTOL32, what=f"{layout} int input loss")
    assert_dicts_close(engine.gather_grads(grads), want_grads, RTOL32, what=f"{layout} int")


# -- training: several SGD steps by hand -------------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_sgd_steps_match_single(layout):
    """w -= lr * g on each rank's shards for 3 steps; the parameters track the reference."""
    model = ms.MLP([6, 16, 12, 5], "relu")
    params = model.init(seed=11)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    engine = build(model, layout, params)
    for step in range(3):
        x, t = data(model, seed=100 + step)
        want, ref_grads = ref.train_step(x, t, ms.losses.MSE())
        for k, g in ref_grads.items():
            ref.params[k] -= 0.1 * g
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                        ms.losses.MSE())
        for k, g in grads.items():
            engine.params[k] -= 0.1 * g
        assert_close(loss, want, RTOL64, what=f"{layout} step {step} loss")
    assert_dicts_close(engine.gather_params(), ref.params, RTOL64, what=f"{layout} after 3 steps")


# -- how the shards and the communication look -------------------------------------------------
@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_local_shards_have_megatron_shapes(layout):
    """Column layer 0 split on columns, row layer 1 on rows, layer 1's bias and the
    replicated last layer (odd layer count) whole; dp keeps everything whole."""
    model = ms.MLP([6, 16, 12, 5], "relu")
    engine = build(model, layout, model.init(seed=0))
    tp = engine.layout.size("tp")
    shapes = {k: tuple(v.shape) for k, v in engine.params.items()}
    assert shapes == {"layer_0/weights": (6, 16 // tp), "layer_0/bias": (16 // tp,),
                      "layer_1/weights": (16 // tp, 12), "layer_1/bias": (12,),
                      "layer_2/weights": (12, 5), "layer_2/bias": (5,)}
    assert {k: tuple(g.shape) for k, g in engine.grads.items()} == shapes


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("tp", [2, 4, 8])
def test_tp_all_reduce_count(tp, depth):
    """One all-reduce per Megatron pair forward; one per pair backward except the first pair
    (the model input needs no gradient); none for a replicated last layer."""
    model = ms.MLP([6, 16, 12, 16, 5][:depth + 1], "relu")
    engine = build(model, f"tp={tp}", model.init(seed=0))
    x, t = data(model)
    pairs = depth // 2
    engine.reset_comm_stats()
    engine.predict(x)
    assert engine.comm_calls["all_reduce"] == pairs
    engine.reset_comm_stats()
    engine.train_step(x, t, ms.losses.MSE())
    assert engine.comm_calls["all_reduce"] == pairs + max(pairs - 1, 0)
    assert sum(engine.comm_calls.values()) == engine.comm_calls["all_reduce"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dp", [2, 4, 8])
def test_dp_forward_has_no_communication(dp):
    model = ms.MLP([6, 16, 12, 5], "relu")
    engine = build(model, f"dp={dp}", model.init(seed=0))
    x, t = data(model)
    engine.reset_comm_stats()
    engine.predict(engine.shard_batch(x))
    assert sum(engine.comm_calls.values()) == 0
    engine.reset_comm_stats()
    engine.train_step(engine.shard_batch(x), engine.shard_batch(t), ms.losses.MSE())
    assert engine.comm_calls["all_reduce"] >= 1                  # gradients (and the loss)
    assert set(engine.comm_calls) <= {"all_reduce"}


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout", ["single", "dp=2", "tp=2", "dp=2,tp=2"])
def test_inference_loop(layout):
    model = ms.MLP([6, 16, 5], "tanh")
    params = model.init(seed=0)
    engine = build(model, layout, params)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    batches = [data(model, seed=s)[0] for s in range(3)]

    class Out:
        def __init__(self):
            self.items = []

        def write(self, arr):
            self.items.append(arr)

    out = Out()
    engine.inference_loop((engine.shard_batch(b) for b in batches), out)
    assert len(out.items) == 3
    for b, y in zip(batches, out.items):
        assert_close(engine.gather_batch(y), ref.predict(b), RTOL64, what=f"{layout} loop")

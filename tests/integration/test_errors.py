"""User mistakes raise the same clear error on every rank, before any collective (no hang).

Each test makes every rank of the group commit the same mistake, checks the exception type and
the numbers in its message on every rank (pytest.raises runs on each rank), and then gathers
the messages: reaching that allgather proves no rank is stuck in a collective, and the
messages must be identical.
"""
import numpy as np
import pytest

import mpishard as ms

from conftest import group_comm, world


def raises_everywhere(comm, exc, pattern, fn):
    with pytest.raises(exc, match=pattern) as info:
        fn()
    messages = comm.allgather(f"{type(info.value).__name__}: {info.value}")
    assert len(set(messages)) == 1, f"ranks disagree: {messages}"
    return str(info.value)


def loaded(model, layout, comm):
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(model.init(seed=0))
    return engine


# -- layouts -----------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_layout_product_differs_from_world_size():
    comm = world()
    n = comm.Get_size()
    model = ms.MLP([4, 8, 4])
    raises_everywhere(comm, ValueError,
                      rf"'dp={n + 1}' needs dp={n + 1} = {n + 1} ranks, but the world size "
                      rf"is {n}", lambda: ms.make_engine(model, f"dp={n + 1}", comm=comm))
    raises_everywhere(comm, ValueError,
                      rf"needs dp={n + 1}\*tp=2 = {2 * n + 2} ranks, but the world size is "
                      rf"{n}", lambda: ms.make_engine(model, f"tp=2,dp={n + 1}", comm=comm))
    if n > 1:
        raises_everywhere(comm, ValueError, rf"'single' needs single = 1 ranks, but the world "
                          rf"size is {n}", lambda: ms.make_engine(model, "single", comm=comm))


@pytest.mark.mpi(min_size=1)
def test_unknown_axis_and_axis_given_twice():
    comm = world()
    n = comm.Get_size()
    model = ms.MLP([4, 8, 4])
    raises_everywhere(comm, ValueError, r"unknown axis or option 'xx'",
                      lambda: ms.make_engine(model, f"dp={n},xx=1", comm=comm))
    raises_everywhere(comm, ValueError, r"'dp' given twice",
                      lambda: ms.make_engine(model, f"dp={n},dp={n}", comm=comm))
    raises_everywhere(comm, ValueError, r"'dp' must be an integer, got '2.5'",
                      lambda: ms.make_engine(model, "dp=2.5", comm=comm))
    engine = loaded(model, f"dp={n}", comm)
    raises_everywhere(comm, ValueError, r"unknown mesh axis 'xx'",
                      lambda: engine.all_reduce(np.ones(2), group="xx"))


# -- model and engine construction -------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("tp", [2, 4])
def test_hidden_size_not_divisible_by_tp(tp):
    comm = group_comm(tp)
    raises_everywhere(comm, ValueError,
                      rf"tp={tp} does not divide the hidden size {tp + 1} of layer 0 "
                      rf"\(4 -> {tp + 1}\)",
                      lambda: ms.make_engine(ms.MLP([4, tp + 1, 3]), f"tp={tp}", comm=comm))
    # the second column layer (layer 2) is checked too
    h = 2 * tp + 1
    raises_everywhere(comm, ValueError, rf"tp={tp} does not divide the hidden size {h} of "
                      rf"layer 2 \(8 -> {h}\)",
                      lambda: ms.make_engine(ms.MLP([4, 8, 8, h, 3]), f"tp={tp}", comm=comm))


@pytest.mark.mpi(min_size=1)
def test_unknown_activation():
    comm = world()
    raises_everywhere(comm, ValueError, r"unknown activation 'swish'; choose one of \['gelu', "
                      r"'identity', 'relu', 'sigmoid', 'tanh'\]",
                      lambda: ms.MLP([4, 8, 4], activation="swish"))
    raises_everywhere(comm, ValueError, r"unknown activation 'softmax'",
                      lambda: ms.MLP([4, 8, 4], final_activation="softmax"))


@pytest.mark.mpi(min_size=1)
def test_bad_model_and_dtype():
    comm = world()
    n = comm.Get_size()
    raises_everywhere(comm, ValueError, r"at least 2 dims .* got \[4\]", lambda: ms.MLP([4]))
    raises_everywhere(comm, ValueError, r"positive, got \[4, 0, 2\]", lambda: ms.MLP([4, 0, 2]))
    raises_everywhere(comm, TypeError, r"float32 or float64, got int32",
                      lambda: ms.make_engine(ms.MLP([4, 4]), f"dp={n}", dtype=np.int32,
                                             comm=comm))
    raises_everywhere(comm, TypeError, r"model spec \(ms\.MLP, .*ms\.Qwen2\), got list",
                      lambda: ms.make_engine([4, 4], f"dp={n}", comm=comm))


# -- checkpoints -------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=1)
def test_checkpoint_missing_or_misshaped_key():
    comm = world()
    n = comm.Get_size()
    model = ms.MLP([4, 8, 3])
    layout = f"tp={n}" if 8 % n == 0 else f"dp={n}"
    engine = ms.make_engine(model, layout, comm=comm)
    params = model.init(seed=0)
    missing = {k: v for k, v in params.items() if k != "layer_1/bias"}
    raises_everywhere(comm, ValueError, r"checkpoint is missing \['layer_1/bias'\]",
                      lambda: engine.load_checkpoint(missing))
    wrong = dict(params, **{"layer_0/weights": params["layer_0/weights"].T})
    raises_everywhere(comm, ValueError, r"'layer_0/weights' has shape \(8, 4\), expected "
                      r"\(4, 8\)", lambda: engine.load_checkpoint(wrong))
    wrong = dict(params, **{"layer_1/bias": np.zeros(4)})
    raises_everywhere(comm, ValueError, r"'layer_1/bias' has shape \(4,\), expected \(3,\)",
                      lambda: engine.load_checkpoint(wrong))
    extra = dict(params, **{"layer_9/weights": np.zeros((2, 2))})
    raises_everywhere(comm, ValueError, r"unexpected keys \['layer_9/weights'\]",
                      lambda: engine.load_checkpoint(extra))
    raises_everywhere(comm, RuntimeError, r"load_checkpoint",
                      lambda: engine.predict(np.zeros((2, 4))))
    engine.load_checkpoint(params)                       # the good one still loads
    assert engine.predict(np.zeros((2, 4))).shape == (2, 3)


# -- data --------------------------------------------------------------------------------------
@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("dp", [2, 4])
def test_batch_not_divisible_by_dp(dp):
    comm = group_comm(dp)
    engine = loaded(ms.MLP([4, 8, 4]), f"dp={dp}", comm)
    rows = 2 * dp + 1
    raises_everywhere(comm, ValueError, rf"batch of {rows} rows does not divide by the {dp} "
                      rf"data-parallel ranks of layout 'dp={dp}'",
                      lambda: engine.shard_batch(np.zeros((rows, 4))))


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("call", ["forward", "predict", "train_step"])
def test_wrong_input_width(call):
    comm = world()
    n = comm.Get_size()
    layout = f"tp={n}"                                  # tp: a collective follows the check
    engine = loaded(ms.MLP([4, 4 * n, 4]), layout, comm)      # a hidden size tp divides
    x, t = np.zeros((6, 5)), np.zeros((6, 4))
    fn = {"forward": lambda: engine.forward(x),
          "predict": lambda: engine.predict(x),
          "train_step": lambda: engine.train_step(x, t, ms.losses.MSE())}[call]
    raises_everywhere(comm, ValueError, r"input has shape \(6, 5\), expected \(batch, 4\)", fn)
    raises_everywhere(comm, ValueError, r"input has shape \(4,\), expected \(batch, 4\)",
                      lambda: engine.predict(np.zeros(4)))
    # and the engine still works afterwards
    assert engine.predict(np.zeros((6, 4))).shape == (6, 4)


@pytest.mark.mpi(min_size=1)
def test_wrong_target_shape():
    comm = world()
    engine = loaded(ms.MLP([4, 8, 3]), f"dp={comm.Get_size()}", comm)
    x = engine.shard_batch(np.zeros((8 * comm.Get_size(), 4)))
    raises_everywhere(comm, ValueError, r"mse: output shape \(8, 3\) != target shape \(8, 2\)",
                      lambda: engine.train_step(x, np.zeros((8, 2)), ms.losses.MSE()))
    raises_everywhere(comm, ValueError, r"unknown loss 'l1'",
                      lambda: engine.train_step(x, np.zeros((8, 3)), "l1"))


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["pp=2", "dp=2", "tp=2"])
def test_bad_targets_raise_on_every_rank_before_communication(layout):
    """Under pp the loss runs on the last stage only; the targets are still checked on every
    rank first, so every rank raises the same error instead of one rank aborting the job."""
    comm = group_comm(2)
    model = ms.MLP([4, 6, 6, 3])
    eng = ms.make_engine(model, layout, comm=comm)
    eng.load_checkpoint(model.init(0))
    x = np.zeros((4, 4))
    cases = [(ms.losses.MSE(), np.zeros((4, 2)), "target shape"),
             (ms.losses.CrossEntropy(), np.full(4, 7, dtype=np.int64),
              r"labels must lie in \[0, 3\)")]
    for loss, t, needle in cases:
        with pytest.raises(ValueError, match=needle) as err:
            eng.train_step(eng.shard_batch(x), eng.shard_batch(t), loss)
        assert len(set(comm.allgather(str(err.value)))) == 1
    # and the engine still trains afterwards
    value, _ = eng.train_step(eng.shard_batch(x), eng.shard_batch(np.zeros((4, 3))), "mse")
    assert np.isfinite(value)

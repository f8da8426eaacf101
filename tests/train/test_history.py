"""The trainer's histories stay bounded (train/history.py): a recent window, exact totals.

    pytest -q tests/train/test_history.py
"""
import json
import sys

import numpy as np

import mpishard as ms
from mpishard.train.data import synthetic_regression
from mpishard.train.history import HISTORY_WINDOW, History, TrainState
from mpishard.train.optim import SGD
from mpishard.train.trainer import Callback, Trainer


class Losses(Callback):
    """Every step's loss, grad norm and lr, kept by the test (not bounded)."""

    def __init__(self):
        self.rows = []

    def on_step_end(self, trainer):
        st = trainer.state
        self.rows.append((st.loss_history[-1], st.grad_norm_history[-1], st.lr_history[-1]))


def history_bytes(state) -> int:
    """The three histories' containers and the distinct floats they hold."""
    hs = (state.loss_history, state.grad_norm_history, state.lr_history)
    floats = {id(v): sys.getsizeof(v) for h in hs for v in h}
    return sum(map(sys.getsizeof, hs)) + sum(floats.values())


def tiny_trainer(steps, callbacks=()):
    dims = [4, 8, 1]
    e = ms.SingleDevice(ms.MLP(dims))
    e.load_checkpoint(ms.MLP(dims).init(0))
    data = synthetic_regression(64, 16, d_in=4, d_out=1, seed=0)
    return Trainer(e, SGD(e, 0.01), data, batch=8, steps=steps, clip=1.0, progress=False,
                   log_every=0, eval_every=1, callbacks=callbacks)


def test_history_memory_does_not_grow_with_steps():
    class Size(Callback):
        def __init__(self):
            self.at = {}

        def on_step_end(self, trainer):
            if trainer.state.step in (HISTORY_WINDOW + 10, 3 * HISTORY_WINDOW):
                self.at[trainer.state.step] = history_bytes(trainer.state)

    size, losses = Size(), Losses()
    t = tiny_trainer(3 * HISTORY_WINDOW, [size, losses])
    m = t.fit()
    early, late = size.at[HISTORY_WINDOW + 10], size.at[3 * HISTORY_WINDOW]
    print(f"histories: {early} B at step {HISTORY_WINDOW + 10}, {late} B at step "
          f"{3 * HISTORY_WINDOW}")
    assert late == early                       # 2 * HISTORY_WINDOW more steps, not one byte
    assert len(t.state.eval_history) == HISTORY_WINDOW       # evaluated every step: bounded too
    # the window is exact: the last HISTORY_WINDOW steps, and where it starts
    want = np.array(losses.rows[-HISTORY_WINDOW:])
    assert m["loss_history"] == want[:, 0].tolist()
    assert m["grad_norm_history"] == want[:, 1].tolist()
    assert m["lr_history"] == want[:, 2].tolist()
    assert m["history_first_step"] == 2 * HISTORY_WINDOW + 1 and m["steps"] == 3 * HISTORY_WINDOW
    assert m["final_loss"] == losses.rows[-1][0]
    assert t.state.loss_history.total == 3 * HISTORY_WINDOW


def test_a_short_run_keeps_every_value():
    losses = Losses()
    m = tiny_trainer(30, [losses]).fit()
    assert m["loss_history"] == [r[0] for r in losses.rows] and m["history_first_step"] == 1


def test_state_round_trips_through_json_with_totals():
    st = TrainState()
    for i in range(HISTORY_WINDOW + 5):
        st.loss_history.append(float(i))
        st.step += 1
    st.eval_history.append({"step": 3, "test_loss": 0.5})
    back = TrainState.from_dict(json.loads(json.dumps(st.to_dict())))
    assert back.loss_history == st.loss_history and back.loss_history.total == HISTORY_WINDOW + 5
    assert back.first_step() == 6 and back.eval_history[-1] == {"step": 3, "test_loss": 0.5}
    old = TrainState.from_dict({"step": 2, "loss_history": [1.0, 0.5]})   # before the window
    assert isinstance(old.loss_history, History) and old.loss_history.total == 2
    assert old.loss_history[:1] == [1.0]

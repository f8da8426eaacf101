"""train/preemption.py in one process: a stop signal raised at a step becomes Preempted at the
next agreed boundary (every k steps) after the Checkpointer saved that step, the handlers are
the run's only while it runs, and a signal caught by a flag installed before training starts
(its handler set early) stops at the first boundary.
The multi-rank cases (one rank signalled, all ranks, exit 75, exact resume) are real jobs in
tests/hpc/test_preemption.py."""
import signal

import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint import Checkpointer, load
from mpishard.train.data import synthetic_regression
from mpishard.train.optim import SGD
from mpishard.train.preemption import Preempted, Preemption, StopFlag
from mpishard.train.trainer import Callback, Trainer


class SignalAt(Callback):
    def __init__(self, step, signum):
        self.step, self.signum = step, signum

    def on_step_end(self, trainer):
        if trainer.state.step == self.step:
            signal.raise_signal(self.signum)


def trainer(callbacks):
    model = ms.MLP([4, 8, 1])
    e = ms.SingleDevice(model, dtype=np.float64)
    e.load_checkpoint(model.init(seed=0))
    data = synthetic_regression(128, 32, d_in=4, seed=1)
    return Trainer(e, SGD(e, 0.05), data, batch=16, steps=20, progress=False, log_every=0,
                   callbacks=callbacks)


@pytest.mark.parametrize("every, stop_at", [(1, 5), (4, 8)])
def test_signal_stops_at_the_next_boundary_after_a_checkpoint(tmp_path, every, stop_at):
    before = signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)
    saver = Checkpointer(tmp_path / "ckpt")
    t = trainer([SignalAt(5, signal.SIGUSR1), saver, Preemption(StopFlag(), saver, every)])
    with pytest.raises(Preempted) as stop:
        t.fit()
    assert (stop.value.signum, stop.value.step, stop.value.saved) == \
        (signal.SIGUSR1, stop_at, True)
    assert f"stopped by SIGUSR1 at step {stop_at}: checkpoint saved" in str(stop.value)
    assert t.state.step == stop_at and load(tmp_path / "ckpt").step == stop_at
    assert (signal.getsignal(signal.SIGUSR1), signal.getsignal(signal.SIGTERM)) == before


def test_a_second_signal_keeps_the_first_and_no_saver_means_no_checkpoint():
    flag = StopFlag()
    t = trainer([SignalAt(3, signal.SIGTERM), SignalAt(3, signal.SIGUSR1), Preemption(flag)])
    with pytest.raises(Preempted) as stop:
        t.fit()
    assert (stop.value.signum, stop.value.step, stop.value.saved) == (signal.SIGTERM, 3, False)
    assert "no checkpoint at step 3" in str(stop.value)


def test_no_signal_trains_to_the_end_and_restores_the_handlers():
    before = signal.getsignal(signal.SIGTERM)
    t = trainer([Preemption(StopFlag(), every=3)])
    t.fit()
    assert t.state.step == 20 and signal.getsignal(signal.SIGTERM) == before
    with pytest.raises(ValueError, match="every must be >= 1"):
        Preemption(StopFlag(), every=0)


def test_a_signal_to_an_early_installed_flag_stops_at_the_first_boundary(tmp_path):
    before = signal.getsignal(signal.SIGTERM)
    flag = StopFlag().install()                    # before fit: resume, data loading, ...
    signal.raise_signal(signal.SIGTERM)
    saver = Checkpointer(tmp_path / "ckpt")
    t = trainer([saver, Preemption(flag, saver)])
    with pytest.raises(Preempted) as stop:
        t.fit()
    assert (stop.value.signum, stop.value.step, stop.value.saved) == (signal.SIGTERM, 1, True)
    assert signal.getsignal(signal.SIGTERM) == before

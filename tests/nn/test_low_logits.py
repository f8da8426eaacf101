"""A 16-bit step's logits reach the loss in 16 bits (nn/autocast.py Narrow.kept), and its
gradient comes back in 16 bits (nn/losses.py CrossEntropy.pair with a scale; on cupy the
kernel of nn/cuda_loss_src.py): the values of the float32 loss on the widened logits, the
gradient scaled and then rounded as the head's backward would round it.

- the xp path (the device double, cupy without the fused kernels): bit for bit the float32
  loss's value, and its scaled gradient rounded;
- the cupy path's wiring on numpy, the kernel replaced by its numpy mirror
  (tests/cuda_mirror.py) computing in float32 and storing 16 bits: within one 16-bit
  rounding of the float32 path (the kernel's sum runs in another order);
- step_pair: only a pair that takes the scale gets 16-bit logits;
- a step on the device double: the loss gets 16-bit logits and gives a 16-bit gradient,
  the GPT's, the Llama's and the Mixtral's (through the auxiliary loss's WithAux);
  engine.forward and predict still return float32.
"""
import ml_dtypes
import numpy as np
import pytest
from cuda_mirror import cross_entropy as mirror
from device_double import DeviceModule
from mpi4py import MPI

import mpishard as ms
from mpishard.comm.backend import Backend
from mpishard.nn import cuda_ops, fused, losses
from mpishard.nn.losses import step_pair

LOW = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}
TINY = {"bfloat16": 1e-38, "float16": 2.0 ** -24}        # float16: its subnormals' spacing


def problem(kind, rows=12, c=300, seed=0):
    rng = np.random.default_rng(seed)
    y = (rng.standard_normal((rows, c)) * 3).astype(LOW[kind])
    t = rng.integers(0, c, rows)
    t[1::6] = -100
    return y, t


@pytest.mark.parametrize("kind", sorted(LOW))
@pytest.mark.parametrize("loss", [losses.CrossEntropy(), losses.CrossEntropy().over(17.0)])
def test_the_xp_path_is_the_float32_loss_rounded(kind, loss):
    y, t = problem(kind)
    want_value, want = loss.pair(y.astype(np.float32), t)
    for scale in (1 / 3, 4096 / 3):          # not powers of two: scaled, then rounded
        value, dy = loss.pair(y, t, scale=scale)
        assert dy.dtype == LOW[kind] and dy.shape == y.shape
        assert value == want_value
        np.testing.assert_array_equal(dy, (want * np.float32(scale)).astype(LOW[kind]))
    value, wide = loss.pair(y, t)                            # no scale: widened first
    assert wide.dtype == np.float32 and np.array_equal(wide, want)


def emulated_kernel(calls):
    """cuda_ops.cross_entropy on numpy: the mirror in float32 on the widened logits, the
    gradient stored in the logits' 16-bit dtype, as the kernel stores it."""
    def run(xp, y2, labels, keep, n, scale=1.0):
        calls.append((y2.dtype, float(scale)))
        rows, g = mirror(y2.astype(np.float32), labels, keep, np.float32(n), np.float32(scale))
        return rows, g.astype(y2.dtype)
    return run


@pytest.mark.parametrize("kind", sorted(LOW))
@pytest.mark.parametrize("loss", [losses.CrossEntropy(), losses.CrossEntropy().over(17.0)])
def test_the_cupy_path_s_wiring_gives_the_float32_loss(kind, loss, monkeypatch):
    y, t = problem(kind)
    want_value, want = loss.pair(y.astype(np.float32), t)
    calls = []
    monkeypatch.setattr(fused, "use", lambda xp: True)
    monkeypatch.setattr(cuda_ops, "cross_entropy", emulated_kernel(calls))
    scale = 1 / 3
    value, dy = loss.pair(y, t, scale=scale)
    assert calls == [(LOW[kind], scale)]                     # the 16-bit logits, unwidened
    assert dy.dtype == LOW[kind] and dy.shape == y.shape
    assert abs(float(value) / want_value - 1) < 1e-6
    want = (want * np.float32(scale)).astype(np.float32)
    got = dy.astype(np.float32)
    assert np.all(np.abs(got - want) <= ULP[kind] * np.abs(want) + TINY[kind])
    assert not got[t == -100].any() and (t == -100).sum() == 2


def test_only_a_pair_that_takes_the_scale_gets_16_bit_logits():
    y, t = problem("bfloat16", rows=3, c=5)
    seen = []

    class Paired(losses.CrossEntropy):
        def pair(self, y, t):
            seen.append(y.dtype)
            return 7.0, np.ones(y.shape, np.float32)

    value, dy = step_pair(Paired(), y, t, 0.5)
    assert seen == [np.float32] and value == 7.0 and np.all(dy == 0.5)
    value, dy = step_pair(lambda y, t: (seen.append(y.dtype) or 3.0, y), y, t, 2.0)
    assert seen[-1] == np.float32 and np.array_equal(dy, 2 * y.astype(np.float32))
    assert step_pair(losses.CrossEntropy(), y, t, 1.0)[1].dtype == ml_dtypes.bfloat16
    assert step_pair(losses.CrossEntropy(), y, t)[1].dtype == np.float32


class Spy(losses.CrossEntropy):
    """CrossEntropy recording the dtypes of the logits it gets and the gradient it gives."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def pair(self, y, t, scale=None):
        value, dy = super().pair(y, t, scale)
        self.seen.append((y.dtype, dy.dtype))
        return value, dy


@pytest.fixture
def device(monkeypatch):
    from mpishard.nn import cudnn_attention as cda
    monkeypatch.setattr(cda, "is_cupy", lambda xp: False)
    return Backend("gpu", MPI.COMM_SELF, array_module=DeviceModule())


MODELS = {
    "gpt": lambda: ms.GPT(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1),
    "gpt-untied": lambda: ms.GPT(vocab_size=32, seq_len=8, d_model=16, n_heads=2, n_layers=1,
                                 tied=False),
    "llama": lambda: ms.Llama(32, 8, 16, 2, 1, n_kv_heads=1, d_ff=24),
    "mixtral": lambda: ms.Llama(32, 8, 16, 2, 1, n_kv_heads=1, d_ff=24, n_experts=4,
                                top_k=2, capacity_factor=None),
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_a_device_step_hands_the_loss_16_bit_logits(name, device):
    model = MODELS[name]()
    engine = ms.make_engine(model, dtype=np.float32, compute_dtype="bfloat16", device=device)
    engine.load_checkpoint(model.init(seed=0))
    ids = np.random.default_rng(1).integers(0, 32, (2, 9))
    x, t = (device.asarray(a) for a in (ids[:, :-1], ids[:, 1:]))
    spy = Spy()
    engine.train_step(x, t, spy)
    assert spy.seen == [(LOW["bfloat16"], LOW["bfloat16"])]
    assert engine.forward(x).dtype == np.float32 and engine.predict(x).dtype == np.float32
    engine.close()

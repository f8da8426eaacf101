"""losses.py: values against closed forms and PyTorch's conventions (mean reductions, BCE's log
clamp at -100), and finite-difference gradient checks in float64. Serial (no MPI)."""
import numpy as np
import pytest

import mpishard as ms
from mpishard import losses

from test_nn import check_grad, numeric_grad


def fd_check(loss, y, t, what):
    analytic = loss.grad(y, t)
    numeric = numeric_grad(lambda: loss.value(y, t), y)
    check_grad(analytic, numeric, what)


# -- MSE ---------------------------------------------------------------------------------------
def test_mse_value_is_mean_over_all_elements(rng):
    y, t = rng.standard_normal((6, 3)), rng.standard_normal((6, 3))
    want = sum((y[i, j] - t[i, j]) ** 2 for i in range(6) for j in range(3)) / 18
    assert abs(losses.MSE().value(y, t) - want) <= 1e-14 * want


def test_mse_gradient(rng):
    fd_check(losses.MSE(), rng.standard_normal((5, 4)), rng.standard_normal((5, 4)), "mse dy")


def test_mse_call_returns_value_and_grad(rng):
    y, t = rng.standard_normal((3, 2)), rng.standard_normal((3, 2))
    value, dy = losses.MSE()(y, t)
    assert isinstance(value, float)
    np.testing.assert_allclose(dy, 2 * (y - t) / y.size, rtol=1e-14)


def test_mse_rejects_shape_mismatch():
    with pytest.raises(ValueError, match=r"\(4, 2\).*\(4, 3\)"):
        losses.MSE().value(np.zeros((4, 2)), np.zeros((4, 3)))
    with pytest.raises(ValueError, match="4 rows.*5"):
        losses.MSE().value(np.zeros((4, 2)), np.zeros((5, 2)))


# -- BCE ---------------------------------------------------------------------------------------
def test_bce_value_closed_form(rng):
    y = rng.uniform(0.05, 0.95, (5, 3))
    t = rng.uniform(0.0, 1.0, (5, 3))           # soft targets are allowed, as in torch
    want = -np.mean(t * np.log(y) + (1 - t) * np.log(1 - y))
    assert abs(losses.BCE().value(y, t) - want) <= 1e-13 * abs(want)


def test_bce_at_one_half_is_log_two():
    y = np.full((4, 2), 0.5)
    t = np.array([[0.0, 1.0]] * 4)
    assert abs(losses.BCE().value(y, t) - np.log(2.0)) < 1e-15


def test_bce_log_is_clamped_at_minus_100():
    """torch.nn.BCELoss clamps each log at -100: a confident wrong answer costs 100, a
    confident right one 0, and 0 * log(0) does not turn into nan."""
    y = np.array([[0.0, 1.0, 0.0, 1.0]])
    t = np.array([[1.0, 0.0, 0.0, 1.0]])
    with np.errstate(divide="ignore"):
        value = losses.BCE().value(y, t)
    assert value == (100.0 + 100.0 + 0.0 + 0.0) / 4
    # just above the clamp: exp(-99) is representable, log is -99, not clamped
    y = np.array([[np.exp(-99.0)]])
    assert abs(losses.BCE().value(y, np.ones((1, 1))) - 99.0) < 1e-12


def test_bce_gradient(rng):
    y = rng.uniform(0.05, 0.95, (4, 3))
    t = (rng.uniform(size=(4, 3)) > 0.5).astype(float)
    fd_check(losses.BCE(), y, t, "bce dy")


def test_bce_gradient_is_finite_at_the_ends():
    y = np.array([[0.0, 1.0]])
    dy = losses.BCE().grad(y, np.array([[1.0, 0.0]]))
    assert np.isfinite(dy).all()
    # torch: (y - t) / max(y (1 - y), 1e-12) / N
    np.testing.assert_allclose(dy, [[-1e12 / 2, 1e12 / 2]], rtol=1e-12)


# -- CrossEntropy ------------------------------------------------------------------------------
def test_cross_entropy_value_is_mean_over_rows(rng):
    y = rng.standard_normal((5, 4)) * 2
    t = np.array([0, 3, 1, 1, 2])
    want = np.mean([np.log(np.exp(y[i]).sum()) - y[i, t[i]] for i in range(5)])
    assert abs(losses.CrossEntropy().value(y, t) - want) <= 1e-13 * abs(want)


def test_cross_entropy_uniform_logits_is_log_classes():
    for c in (2, 3, 10):
        value = losses.CrossEntropy().value(np.zeros((3, c)), np.zeros(3, dtype=np.int64))
        assert abs(value - np.log(c)) < 1e-14


def test_cross_entropy_gradient(rng):
    y = rng.standard_normal((6, 5))
    t = rng.integers(0, 5, 6)
    fd_check(losses.CrossEntropy(), y, t, "cross_entropy dy")


def test_cross_entropy_is_shift_invariant_and_stable(rng):
    y = rng.standard_normal((4, 3))
    t = np.array([2, 0, 1, 2])
    ce = losses.CrossEntropy()
    with np.errstate(all="raise"):
        big_value, big_grad = ce(y + 1000.0, t)
    value, grad = ce(y, t)
    assert abs(big_value - value) < 1e-10
    np.testing.assert_allclose(big_grad, grad, atol=1e-12)
    np.testing.assert_allclose(grad.sum(axis=1), 0.0, atol=1e-15)   # softmax - onehot


def test_cross_entropy_rejects_bad_labels():
    ce = losses.CrossEntropy()
    with pytest.raises(ValueError, match=r"\[0, 3\).*\[0, 3\]"):
        ce.value(np.zeros((2, 3)), np.array([0, 3]))
    with pytest.raises(TypeError, match="integers"):
        ce.value(np.zeros((2, 3)), np.array([0.0, 1.0]))
    with pytest.raises(ValueError, match=r"\(B, C\)"):
        ce.value(np.zeros((2, 3)), np.zeros((2, 3), dtype=np.int64))


# -- float32 and names -------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["mse", "bce", "cross_entropy"])
def test_gradient_keeps_float32(rng, name):
    y = rng.uniform(0.1, 0.9, (4, 3)).astype(np.float32)
    t = rng.integers(0, 3, 4) if name == "cross_entropy" else rng.uniform(size=(4, 3))
    t = t.astype(np.float32) if name != "cross_entropy" else t
    value, dy = losses.get_loss(name)(y, t)
    assert isinstance(value, float) and dy.dtype == np.float32


def test_get_loss():
    assert isinstance(losses.get_loss("mse"), losses.MSE)
    assert isinstance(losses.get_loss("ce"), losses.CrossEntropy)
    mse = ms.losses.MSE()
    assert losses.get_loss(mse) is mse
    with pytest.raises(ValueError, match="unknown loss 'hinge'"):
        losses.get_loss("hinge")


def test_the_fused_pair_divides_by_the_device_count_or_the_given_denominator(monkeypatch):
    """CrossEntropy.pair's cupy branch (fused.cross_entropy faked here: it records what it
    is handed): without a denominator it divides by the kept labels counted as an array (not
    read back), at least 1; with one, by it, and by 1 where it is 0 (a batch whose every
    label is ignored: the loss 0, not 0 / 0)."""
    from mpishard.nn import fused
    seen = []

    def fake(xp, y2, t, keep, n):
        seen.append(n)
        return xp.zeros(()), xp.zeros_like(y2)
    monkeypatch.setattr(fused, "use", lambda xp: True)
    monkeypatch.setattr(fused, "cross_entropy", fake)
    y = np.zeros((2, 3, 5), np.float32)
    t = np.array([[1, -100, 2], [-100, -100, 4]])
    ce = losses.CrossEntropy()
    value, dy = ce.pair(y, t)
    assert not isinstance(seen[-1], float) and seen[-1] == 3.0 and dy.shape == y.shape
    ce.pair(y, np.full((2, 3), -100))
    assert seen[-1] == 1.0                                   # nothing counted: divided by 1
    ce.over(0.0).pair(y, t)
    assert seen[-1] == 1.0
    ce.over(7.0).pair(y, t)
    assert seen[-1] == 7.0
    assert isinstance(ce(y, t)[0], float)                    # __call__ still gives a float


def test_a_training_step_calls_a_subclass_that_overrides_only_call():
    """step_pair: the loss's `pair` where it is defined at or below its __call__; a subclass
    overriding __call__ alone (label smoothing, say) is called, not bypassed."""
    from mpishard.nn.losses import step_pair

    class Smoothed(losses.CrossEntropy):
        def __call__(self, y, t):
            return 42.0, y

    class Paired(losses.CrossEntropy):
        def pair(self, y, t):
            return 7.0, y
    y, t = np.zeros((2, 5), np.float32), np.array([1, 2])
    assert step_pair(Smoothed(), y, t)[0] == 42.0
    assert step_pair(Paired(), y, t)[0] == 7.0
    assert step_pair(losses.CrossEntropy(), y, t)[0] == pytest.approx(np.log(5))
    assert step_pair(lambda y, t: (3.0, y), y, t)[0] == 3.0   # any callable

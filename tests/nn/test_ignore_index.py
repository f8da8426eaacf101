"""CrossEntropy(ignore_index=-100) against torch.nn.functional.cross_entropy on the same mask:
value and gradient in float64 (rtol 1e-9), for (B, C) and (B, T, C) logits; `over(n)` divides
the same sum by n; a call where everything is ignored gives 0 and a zero gradient; an ignored
row of inf or nan logits adds nothing to the value (torch's rule) nor to the gradient (torch
gives nan there) on every CPU path."""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close

torch = pytest.importorskip("torch")


def masked_case(shape, classes, seed=0, share=0.4):
    rng = np.random.default_rng(seed)
    y = rng.standard_normal(shape + (classes,))
    t = rng.integers(0, classes, shape)
    t[rng.random(shape) < share] = -100
    return y, t


@pytest.mark.parametrize("shape", [(7,), (3, 5)])
def test_ignore_index_equals_torch(shape):
    y, t = masked_case(shape, 11)
    value, dy = ms.losses.CrossEntropy()(y, t)
    ty = torch.tensor(y, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(ty.reshape(-1, 11), torch.tensor(t).reshape(-1),
                                            ignore_index=-100)
    ref.backward()
    assert_close(value, ref.item(), what="value")
    assert_close(dy, ty.grad.numpy(), what="gradient")
    assert np.all(dy.reshape(-1, 11)[t.reshape(-1) == -100] == 0.0)


def test_other_ignore_index_and_counted():
    y, t = masked_case((4, 6), 9, seed=1)
    t[t == -100] = 3                           # ignore class 3 instead
    loss = ms.losses.CrossEntropy(ignore_index=3)
    value, dy = loss(y, t)
    ty = torch.tensor(y, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(ty.reshape(-1, 9), torch.tensor(t).reshape(-1),
                                            ignore_index=3)
    ref.backward()
    assert_close(value, ref.item(), what="value")
    assert_close(dy, ty.grad.numpy(), what="gradient")
    assert loss.counted(t) == int((t != 3).sum())


def test_over_divides_the_sum_by_n():
    y, t = masked_case((3, 5), 7, seed=2)
    loss = ms.losses.CrossEntropy()
    n = loss.counted(t)
    value, dy = loss(y, t)
    v2, d2 = loss.over(2.5 * n)(y, t)
    assert_close(v2, value / 2.5, what="value")
    assert_close(d2, dy / 2.5, what="gradient")
    assert loss.denominator is None, "over() changed the original"


def test_everything_ignored_gives_zero():
    y, t = masked_case((2, 3), 5)
    t[:] = -100
    value, dy = ms.losses.CrossEntropy()(y, t)
    assert value == 0.0 and not dy.any()


@pytest.mark.filterwarnings("ignore:invalid value encountered")
@pytest.mark.parametrize("fused", ["0", "1"])
def test_ignored_rows_of_inf_or_nan_logits_add_nothing(fused, monkeypatch):
    """The xp path (MPISHARD_CPU_FUSED=0) and numba's kernel (where installed) alike: the value
    is the kept rows' (as torch's), the gradient 0 on the ignored rows."""
    monkeypatch.setenv("MPISHARD_CPU_FUSED", fused)
    y, t = masked_case((6,), 5, seed=3, share=0.0)
    t[[1, 4]] = -100
    bad = y.copy()
    bad[1, 2], bad[4, :] = np.inf, np.nan
    for dtype in (np.float64, np.float32):
        want, want_dy = ms.losses.CrossEntropy()(y.astype(dtype), t)
        value, dy = ms.losses.CrossEntropy()(bad.astype(dtype), t)
        assert np.isfinite(value) and value == want
        assert np.array_equal(dy, want_dy) and not dy[[1, 4]].any()
    ty = torch.tensor(bad, requires_grad=True)
    ref = torch.nn.functional.cross_entropy(ty, torch.tensor(t), ignore_index=-100)
    assert_close(value, ref.item(), rtol=1e-6, what="value")      # float32's against torch's


def test_labels_out_of_range_still_refused():
    y, t = masked_case((2, 3), 5)
    t[0, 0] = -3
    with pytest.raises(ValueError, match="ignore_index=-100"):
        ms.losses.CrossEntropy()(y, t)


def test_count_applies_to_cross_entropy_only():
    with pytest.raises(ValueError, match="cross_entropy only"):
        ms.losses.MSE().over(3)

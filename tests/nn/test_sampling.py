"""Sampling (nn/sampling.py): greedy, temperature, top-k and top-p filtering as transformers
does it, and the inverse-CDF draw, checked exactly (hand-made cases, a stand-in generator with
known uniforms) and against transformers' own logits warpers where it is installed."""
import numpy as np
import pytest

from mpishard.nn.sampling import check_sampling, filter_logits, sample


class Uniforms:
    """A generator whose random(n) returns the given uniforms, in order."""

    def __init__(self, values):
        self.values = list(values)

    def random(self, n):
        out, self.values = self.values[:n], self.values[n:]
        return np.asarray(out)


def test_greedy_takes_the_first_maximum():
    z = np.array([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 0.0]])
    assert sample(z, None, temperature=0.0).tolist() == [1, 0]


def test_top_k_keeps_the_k_largest_and_their_ties():
    z = np.array([[1.0, 4.0, 3.0, 3.0, 0.0]])
    assert np.isinf(filter_logits(z, top_k=2)).tolist() == [[True, False, False, False, True]]
    assert np.isinf(filter_logits(z, top_k=1)).tolist() == [[True, False, True, True, True]]
    assert not np.isinf(filter_logits(z, top_k=9)).any()          # K >= V keeps all


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = np.array([0.5, 0.3, 0.15, 0.05])
    z = np.log(p)[None, ::-1]                     # ids 3..0 hold 0.05, 0.15, 0.3, 0.5

    def kept(top_p):
        return (~np.isinf(filter_logits(z, top_p=top_p)[0])).tolist()

    assert kept(0.5) == [False, False, False, True]       # 0.5 alone reaches 0.5
    assert kept(0.51) == [False, False, True, True]       # 0.8
    assert kept(0.79) == [False, False, True, True]
    assert kept(0.81) == [False, True, True, True]        # 0.95
    assert kept(1e-9) == [False, False, False, True]      # always at least one
    assert kept(1.0) == [True, True, True, True]


def test_the_draw_is_the_inverse_cdf_of_the_filtered_softmax():
    z = np.log(np.array([[0.1, 0.2, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]]))
    ids = sample(z, Uniforms([0.05, 0.99]), temperature=1.0)
    assert ids.tolist() == [0, 3]
    assert sample(z, Uniforms([0.1000001, 0.2499]), temperature=1.0).tolist() == [1, 0]
    # top_k=2 on row 0 keeps ids 2, 3 (0.3 : 0.4): u = 0.42 falls in id 2's 3/7
    assert sample(z[:1], Uniforms([0.42]), 1.0, top_k=2).tolist() == [2]
    assert sample(z[:1], Uniforms([0.43]), 1.0, top_k=2).tolist() == [3]
    # temperature 0.5 squares the probabilities: 1 : 4 : 9 : 16 of 30
    assert sample(z[:1], Uniforms([1 / 30 - 1e-9]), 0.5).tolist() == [0]
    assert sample(z[:1], Uniforms([1 / 30 + 1e-9]), 0.5).tolist() == [1]
    # a draw never lands on a removed id, even at the top end
    assert sample(z[:1], Uniforms([1 - 1e-16]), 1.0, top_p=0.3).tolist() == [3]


@pytest.mark.parametrize("bad,message", [
    (dict(temperature=-0.1), "temperature must be >= 0"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(top_p=0.0), "top_p must be > 0"),
    (dict(top_p=1.01), "top_p must lie in"),
])
def test_bad_options_raise(bad, message):
    with pytest.raises(ValueError, match=message):
        check_sampling(**dict(dict(temperature=1.0, top_k=0, top_p=1.0), **bad))


def test_filters_equal_transformers_warpers():
    torch = pytest.importorskip("torch")
    lp = pytest.importorskip("transformers.generation.logits_process")
    rng = np.random.default_rng(0)
    checked = 0
    for _ in range(300):
        z = rng.normal(size=(4, 23)) * 2             # no ties: torch.sort's order among ties
        k = int(rng.integers(0, 30))                  # is its own
        p = float(rng.choice([1.0, 0.99, 0.9, 0.5, 0.1, 1e-3]))
        t = torch.tensor(z)
        if k > 0:
            t = lp.TopKLogitsWarper(k)(None, t)
        if p < 1:
            t = lp.TopPLogitsWarper(p)(None, t)
        ours = filter_logits(z, k, p)
        np.testing.assert_array_equal(np.isinf(ours), np.isinf(t.numpy()), err_msg=f"{k} {p}")
        np.testing.assert_array_equal(ours, t.numpy())
        checked += 1
    assert checked == 300

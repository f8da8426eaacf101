"""hfmap.views.region_of: the one reading of an index for every lazily read array
(LazyArray, hf's SafeTensor, Mixtral's expert views). Reading its region and applying its
`post` index equals numpy's own indexing, steps (forward and backward), ints and Ellipsis
included; anything else is a clear error naming the array."""
import numpy as np
import pytest

from mpishard.hfmap.views import region_of

KEYS = [np.s_[...], np.s_[1:4, 2:7], np.s_[..., 3], np.s_[-1], np.s_[::2, ::-3],
        np.s_[5:1:-2, :], np.s_[2:2], np.s_[:, 7], np.s_[1, ..., ::3], np.s_[1:6:2, 1],
        np.s_[::-1], np.s_[-3:, -5:-1:2], np.s_[4:1], np.s_[np.int64(2), 1:8:3],
        np.s_[-100:100, ::7], np.s_[3::-2]]


@pytest.mark.parametrize("key", KEYS, ids=str)
def test_reading_the_region_then_post_is_numpys_indexing(key):
    full = np.arange(6 * 8 * 5).reshape(6, 8, 5)
    region, post = region_of(key, full.shape, "w")
    assert all(0 <= a <= b <= n for (a, b), n in zip(region, full.shape))
    span = full[tuple(slice(a, b) for a, b in region)]
    assert np.array_equal(span[post], full[key])


def test_a_step_reads_the_span_it_strides_over_and_keeps_its_step():
    region, post = region_of(np.s_[1:8:3], (10,), "w")
    assert region == [(1, 8)] and post == (slice(0, 7, 3),)
    region, post = region_of(np.s_[7:0:-3], (10,), "w")
    assert region == [(1, 8)] and post == (slice(6, None, -3),)


@pytest.mark.parametrize("key,error,message", [
    (np.s_[6], IndexError, "index 6 out of range for 6 in 'w'"),
    (np.s_[-7], IndexError, "index -7 out of range for 6 in 'w'"),
    (np.s_[1, 2, 3], IndexError, "3 indices for a 2-d array 'w'"),
    (np.s_[..., 1, ...], IndexError, "w: an index can only have one Ellipsis"),
    (np.s_[1.5], TypeError, "w: only ints, slices and Ellipsis index a lazily read array, "
                            "got 1.5"),
    (np.s_[None], TypeError, "got None"),
    (np.s_[[0, 1]], TypeError, r"got \[0, 1\]"),
    (np.s_[True], TypeError, "w: a bool is not an index"),
])
def test_anything_else_is_a_clear_error(key, error, message):
    with pytest.raises(error, match=message):
        region_of(key, (6, 8), "w")

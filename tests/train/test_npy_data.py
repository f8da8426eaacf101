"""`--dataset npy:DIR`: memory-mapped .npy files, validated, read a batch at a time per rank.

    pytest -m "not mpi" tests/train/test_npy_data.py

Serial tests; the resident-memory one launches tests/train/npy_rss_probe.py on 2 ranks over a
200 MB float32 x.npy for one epoch and checks that no rank's memory grows anywhere near it.
"""
import json

import numpy as np
import pytest

from mpishard.train.npy_data import MappedRows, load_npy_dataset, npy_task

from conftest import run_mpi

MB = 1 << 20


def write(d, **arrays):
    for name, a in arrays.items():
        np.save(d / f"{name}.npy", a)
    return f"npy:{d}"


def test_rows_read_on_demand_equal_the_file(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(40, 5)).astype(np.float32)
    y = rng.normal(size=40)
    name = write(tmp_path, x=x, y=y)
    d = load_npy_dataset(name, 5, 1)
    assert isinstance(d.x_train, MappedRows) and d.task == "regression"
    assert d.x_train.shape == (36, 5) and d.x_test.shape == (4, 5) and d.d_out == 1
    idx = np.array([7, 0, 35, 7])
    np.testing.assert_array_equal(d.x_train[idx], x[idx])
    np.testing.assert_array_equal(d.t_train[idx], y[idx, None])
    np.testing.assert_array_equal(d.x_test[1:3][[1]], x[38:39])
    np.testing.assert_array_equal(d.t_test, y[36:, None])
    np.testing.assert_array_equal(np.asarray(d.x_train[10:12]), x[10:12])
    f = tmp_path / "f"
    f.mkdir()
    name = write(f, x=np.asfortranarray(x), y=np.arange(40) % 3, x_test=x[:6], y_test=np.ones(6,
                 dtype=np.int32))
    d = load_npy_dataset(name, 5, 3)
    assert d.task == "classification" and len(d.x_train) == 40 and npy_task(name) == d.task
    np.testing.assert_array_equal(d.x_train[idx], x[idx])


@pytest.mark.parametrize("arrays,d_out,message", [
    ({"x": np.zeros((4, 2, 2)), "y": np.zeros(4)}, 1, "x.npy must be 2-D"),
    ({"x": np.zeros((4, 3), dtype=complex), "y": np.zeros(4)}, 1, "must hold real numbers"),
    ({"x": np.array([["a"] * 3] * 4), "y": np.zeros(4)}, 1, "must hold real numbers"),
    ({"x": np.zeros((4, 3)), "y": np.zeros(5)}, 1, "y.npy must have one row per row"),
    ({"x": np.zeros((4, 3)), "y": np.zeros((4, 2), dtype=np.int64)}, 2, "1-D class labels"),
    ({"x": np.zeros((4, 3)), "y": np.array([0, 1, 2, 3])}, 3, "holds label 3, outside"),
    ({"x": np.zeros((4, 3)), "y": np.array([0, -1, 0, 0])}, 3, "holds label -1"),
    ({"x": np.zeros((4, 3)), "y": np.zeros((4, 2))}, 1, "model has 1 output"),
    ({"x": np.zeros((4, 4)), "y": np.zeros(4)}, 1, "has 4 features but the model's input"),
    ({"x": np.zeros((4, 3)), "y": np.zeros(4), "x_test": np.zeros((2, 3))}, 1,
     "give both x_test.npy and y_test.npy"),
    ({"x": np.zeros((4, 3)), "y": np.zeros(4), "x_test": np.zeros((2, 3)),
      "y_test": np.zeros(2, dtype=np.int64)}, 1, "must both be integer labels or both floats"),
    ({"x": np.zeros((1, 3)), "y": np.zeros(1)}, 1, "need 2 to hold out"),
    ({"y": np.zeros(4)}, 1, "x.npy not found"),
    ({"x": np.zeros((4, 3)), "y": np.float64(1.0)}, 1, "must be an array of rows"),
])
def test_bad_files_are_one_clear_value_error(tmp_path, arrays, d_out, message):
    name = write(tmp_path, **arrays)
    with pytest.raises(ValueError, match=message):
        load_npy_dataset(name, 3, d_out)


def test_unreadable_and_missing(tmp_path):
    (tmp_path / "x.npy").write_bytes(b"not an npy file")
    np.save(tmp_path / "y.npy", np.zeros(3))
    with pytest.raises(ValueError, match="x.npy is not a readable .npy array"):
        load_npy_dataset(f"npy:{tmp_path}", 3, 1)
    with pytest.raises(ValueError, match="is not a directory"):
        load_npy_dataset(f"npy:{tmp_path / 'nope'}", 3, 1)


def test_resident_memory_stays_far_below_the_file(tmp_path):
    """One epoch of a 200 MB x.npy at dp=2: each rank's VmRSS grows by a few MB."""
    n, d = 200 * MB // (4 * 256), 256
    x = np.lib.format.open_memmap(tmp_path / "x.npy", mode="w+", dtype=np.float32,
                                  shape=(n, d))
    block = np.random.default_rng(0).standard_normal((4096, d), dtype=np.float32)
    for start in range(0, n, len(block)):
        x[start:start + len(block)] = block[:n - start]
    x.flush()
    del x
    np.save(tmp_path / "y.npy", np.random.default_rng(1).integers(0, 4, n))
    r = run_mpi(2, "tests/train/npy_rss_probe.py", tmp_path, timeout=300)
    print(r.stdout, r.stderr[-3000:])
    assert r.returncode == 0
    out = json.loads(r.stdout.strip().splitlines()[-1])
    size = out["file_bytes"]
    for rank, m in enumerate(out["ranks"]):
        grow, peak_grow = m["end"] - m["warm"], m["peak"] - m["warm"]
        print(f"rank {rank}: VmRSS {m['warm'] / MB:.1f} -> {m['end'] / MB:.1f} MB "
              f"(+{grow / MB:.1f}), peak +{peak_grow / MB:.1f} MB, file {size / MB:.0f} MB, "
              f"{out['steps']} steps of {out['batch']} rows")
        assert grow < 0.05 * size and peak_grow < 0.05 * size

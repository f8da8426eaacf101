"""`python -m mpishard infer`: a checkpoint over the rows of an .npy file, on any layout.

    pytest -m "not mpi" tests/cli/test_infer.py

Serial tests. A SingleDevice engine on COMM_SELF saves the checkpoint; `infer` then runs it
under single (in-process and 1 rank), dp=2, pp=2, tp=2 (2 ranks) and dp=2,pp=2 (4 ranks), each
`mpiexec` in a subprocess, and the outputs must equal SingleDevice.predict on the whole input.
21 rows in batches of 4 leave a short last batch (1 row), which dp=2 pads. Bad input gives one
error line and exit code 2.
"""
import shutil

import numpy as np
import pytest

import mpishard as ms
from mpishard import cli

from conftest import assert_close, engine_lines
from test_cli import launch              # mpiexec -n N python -m mpi4py -m mpishard ...

DIMS, ROWS, BATCH = [6, 8, 8, 3], 21, 4


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(directory, checkpoint path, input path, SingleDevice.predict of the input)."""
    d = tmp_path_factory.mktemp("infer")
    model = ms.MLP(DIMS, activation="tanh")
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(model.init(seed=3))
    ms.checkpoint.save(d / "ck", engine, step=7)
    x = np.random.default_rng(5).normal(size=(ROWS, DIMS[0]))
    np.save(d / "x.npy", x)
    return d, d / "ck", d / "x.npy", np.asarray(engine.predict(x))


def infer_args(ck, x, y, *more):
    """The infer command line as strings (CPU arrays, batches of BATCH rows)."""
    return [str(a) for a in ("infer", "--checkpoint", ck, "--input", x, "--output", y,
                             "--batch", BATCH, "--device", "cpu", *more)]


@pytest.mark.parametrize("n,layout", [(1, "single"), (2, "dp=2"), (2, "pp=2"), (2, "tp=2"),
                                      (4, "dp=2,pp=2")])
def test_infer_matches_single_device(saved, n, layout):
    d, ck, x, want = saved
    y = d / f"y-{layout}.npy"
    rc, out, err, _ = launch(n, *infer_args(ck, x, y, "--layout", layout))
    assert rc == 0, out + err
    lines = out.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"infer: {ROWS} rows in 6 batches of 4"), \
        out                                       # rank 0 alone prints
    got = np.load(y, allow_pickle=False)
    assert got.dtype == np.float64                # the checkpoint's dtype
    assert_close(got, want, rtol=1e-12, what=f"infer {layout} vs SingleDevice.predict")
    assert sorted(p.name for p in d.glob(f"y-{layout}.npy*")) == [y.name]   # no tmp left


def test_infer_in_process_float32_and_streaming_helper(saved, capsys):
    d, ck, x, want = saved
    y = d / "y32.npy"
    assert cli.main(infer_args(ck, x, y, "--dtype", "float32")) == 0
    assert "rows/s" in capsys.readouterr().out
    got = np.load(y)
    assert got.dtype == np.float32
    assert_close(got, want, rtol=1e-5, what="float32 infer")
    # the collective helper under the command: any batch size, output where asked
    model = ms.MLP(DIMS, activation="tanh")
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(ms.checkpoint.load(ck))
    out = np.full((ROWS, DIMS[-1]), np.nan)
    from mpishard.cli.infer import batch_spans, infer_rows

    assert batch_spans(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert infer_rows(engine, np.load(x, mmap_mode="r"), 8, out) == 3
    assert_close(out, want, rtol=1e-12, what="infer_rows")


def test_bad_input_in_process(saved, tmp_path, capsys):
    d, ck, x, _ = saved
    y = tmp_path / "y.npy"
    np.save(tmp_path / "wide.npy", np.zeros((4, DIMS[0] + 1)))
    np.save(tmp_path / "flat.npy", np.zeros(DIMS[0]))
    np.save(tmp_path / "obj.npy", np.array([{}], dtype=object), allow_pickle=True)
    np.save(tmp_path / "empty.npy", np.zeros((0, DIMS[0])))
    cases = [
        (infer_args(tmp_path / "none", x, y), "not a checkpoint"),
        (infer_args(ck, tmp_path / "wide.npy", y), "shape (4, 7), the model takes (rows, 6)"),
        (infer_args(ck, tmp_path / "flat.npy", y), "shape (6,), the model takes (rows, 6)"),
        (infer_args(ck, tmp_path / "obj.npy", y), "without pickle"),
        (infer_args(ck, tmp_path / "empty.npy", y), "no rows"),
        (infer_args(ck, tmp_path / "missing.npy", y), "no such file"),
        (infer_args(ck, x, x), "is the input file"),
        (infer_args(ck, x, tmp_path / "no" / "y.npy"), "does not exist"),
        (infer_args(ck, x, tmp_path), "is a directory"),
        (infer_args(ck, x, y, "--batch", "0"), "--batch must be > 0"),
        (infer_args(ck, x, y, "--layout", "dp=2"), "needs dp=2 = 2 ranks"),
    ]
    for argv, message in cases:
        assert cli.main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("mpishard: error: ") and message in err, \
            (message, err)
    assert not y.exists()
    # a corrupt block is found while loading (sha256 before the first read)
    bad = tmp_path / "corrupt"
    shutil.copytree(ck, bad)
    block = sorted(bad.glob("*layer_1.weights*.npy"))[0]
    data = bytearray(block.read_bytes())
    data[-1] ^= 0xFF
    block.write_bytes(bytes(data))
    assert cli.main(infer_args(bad, x, y)) == 2
    assert "is corrupt" in capsys.readouterr().err and not y.exists()


@pytest.mark.parametrize("case,message", [
    ("batch", "--batch 3 must divide by the 2 data-parallel ranks of layout 'dp=2'"),
    ("width", "shape (4, 7), the model takes (rows, 6)"),
    ("checkpoint", "not a checkpoint"),
])
def test_bad_input_exits_2_with_one_line_on_two_ranks(saved, tmp_path, case, message):
    d, ck, x, _ = saved
    y = tmp_path / "y.npy"
    np.save(tmp_path / "wide.npy", np.zeros((4, DIMS[0] + 1)))
    argv = {"batch": infer_args(ck, x, y, "--layout", "dp=2", "--batch", 3),
            "width": infer_args(ck, tmp_path / "wide.npy", y, "--layout", "pp=2"),
            "checkpoint": infer_args(tmp_path / "none", x, y)}[case]
    rc, out, err, _ = launch(2, *argv)
    assert rc == 2, out + err
    lines = engine_lines(err)                     # Open MPI adds its own box on exit 2
    assert len(lines) == 1 and lines[0].startswith("mpishard: error: "), err
    assert message in lines[0] and "Traceback" not in err, err
    assert not y.exists()


# -- a GPT checkpoint: token ids in, logits at every position out (issue 31, defect 10) ----------
GPT_SIZES = dict(vocab_size=12, seq_len=8, d_model=8, n_heads=2, n_layers=2)


@pytest.fixture(scope="module")
def saved_gpt(tmp_path_factory):
    """(directory, checkpoint, token input (9 rows of 6 ids), SingleDevice.predict of it)."""
    d = tmp_path_factory.mktemp("infer-gpt")
    model = ms.GPT(**GPT_SIZES)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(model.init(seed=1))
    ms.checkpoint.save(d / "ck", engine, step=3)
    x = np.random.default_rng(2).integers(0, GPT_SIZES["vocab_size"], (9, 6))
    np.save(d / "x.npy", x)
    return d, d / "ck", d / "x.npy", np.asarray(engine.predict(x))


def test_infer_a_gpt_gives_the_logits_in_process(saved_gpt, capsys):
    d, ck, x, want = saved_gpt
    y = d / "y.npy"
    assert cli.main(infer_args(ck, x, y)) == 0, capsys.readouterr().err
    assert "infer: 9 rows in 3 batches of 4" in capsys.readouterr().out
    got = np.load(y, allow_pickle=False)
    assert got.shape == (9, 6, GPT_SIZES["vocab_size"]) and got.dtype == np.float64
    assert_close(got, want, rtol=1e-12, what="GPT infer vs SingleDevice.predict")


@pytest.mark.parametrize("layout", ["dp=2", "tp=2", "pp=2"])
def test_infer_a_gpt_on_two_ranks(saved_gpt, layout):
    d, ck, x, want = saved_gpt
    y = d / f"y-{layout}.npy"
    rc, out, err, _ = launch(2, *infer_args(ck, x, y, "--layout", layout))
    assert rc == 0 and "Traceback" not in err, out + err
    assert_close(np.load(y), want, rtol=1e-9, what=f"GPT infer {layout} vs SingleDevice.predict")


def test_infer_a_gpt_refuses_bad_tokens(saved_gpt, tmp_path, capsys):
    d, ck, x, _ = saved_gpt
    y = tmp_path / "y.npy"
    np.save(tmp_path / "long.npy", np.zeros((2, 9), dtype=np.int64))
    np.save(tmp_path / "floats.npy", np.zeros((2, 4)))
    np.save(tmp_path / "big.npy", np.full((2, 4), 12))
    for path, message in [("long.npy", "with T <= seq_len=8"),
                          ("floats.npy", "a GPT takes integer token ids"),
                          ("big.npy", "token ids 12..12 outside the vocabulary 0..11")]:
        assert cli.main(infer_args(ck, tmp_path / path, y)) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and message in err, (message, err)
    assert not y.exists()

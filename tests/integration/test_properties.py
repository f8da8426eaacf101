"""Property-based tests (hypothesis) of the parsers that read user input and files.

    pytest -m "not mpi" tests/integration/test_properties.py

- the layout parser: any string gives a Layout or a ValueError, never another exception; a
  parsed layout's text parses back to the same sizes and options
- train's --config TOML: any table of keys and values is parsed and validated, or one
  UsageError
- the checkpoint reader: a valid checkpoint with its index.json edited (any value replaced by
  any JSON value, keys deleted), its bytes cut or flipped, or a block file cut, flipped or
  removed either loads and reads back or raises CheckpointError; never another exception and
  never a hang (each case runs under a SIGALRM guard)

A modest max_examples keeps `make test` fast; deadline off (file I/O on shared cores).
"""
import json
import os
import shutil
import signal
import tempfile
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

import mpishard as ms
from mpishard.checkpoint import CheckpointError
from mpishard.checkpoint.reader import describe, load
from mpishard.cli.train import parse_train_args, validate_train_args
from mpishard.cli.usage import UsageError
from mpishard.comm.mesh import AXES, OPTIONS, Layout, parse_layout

SETTINGS = settings(max_examples=100, deadline=None, database=None,
                    suppress_health_check=[HealthCheck.too_slow])
FILE_SETTINGS = settings(max_examples=50, deadline=None, database=None,
                         suppress_health_check=[HealthCheck.too_slow])
GUARD_S = 10


@contextmanager
def guard(seconds=GUARD_S):
    """Raise TimeoutError if the body runs longer than `seconds` (a hang is a failure)."""
    def expired(signum, frame):
        raise TimeoutError(f"still running after {seconds} s")
    old = signal.signal(signal.SIGALRM, expired)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# -- the layout parser --------------------------------------------------------------------------
NAMES = st.sampled_from(AXES + tuple(OPTIONS) + ("single", "", "dp ", " tp", "x", "DP"))
VALUES = st.one_of(st.integers(-3, 9).map(str), st.sampled_from(
    ["", "1f1b", "gpipe", "ring", "ulysses", "attn", "2+1", "1.5", "nan", "inf", "1e3", " 2 ",
     "0x2", "=", "２"]), st.text(max_size=4))
PARTS = st.one_of(st.tuples(NAMES, VALUES).map(lambda kv: f"{kv[0]}={kv[1]}"), NAMES,
                  st.text(max_size=6))


OPTION_VALUES = {k: [str(v) for v in allowed] if allowed else ["1", "2", "4", "0.5", "2+1"]
                 for k, (_, allowed, _) in OPTIONS.items()}
PLAUSIBLE = st.tuples(
    st.lists(st.tuples(st.sampled_from(AXES), st.integers(1, 4)), max_size=3,
             unique_by=lambda kv: kv[0]),
    st.lists(st.sampled_from(sorted(OPTIONS)).flatmap(
        lambda k: st.sampled_from(OPTION_VALUES[k]).map(lambda v: (k, v))), max_size=2,
        unique_by=lambda kv: kv[0]),
).map(lambda t: ",".join(f"{k}={v}" for k, v in t[0] + t[1]))


@SETTINGS
@given(st.one_of(PLAUSIBLE, st.lists(PARTS, max_size=5).map(",".join), st.text(max_size=30)))
def test_layout_parser_gives_a_layout_or_value_error(text):
    try:
        layout = parse_layout(text)
    except ValueError as exc:
        assert str(exc)
        event("ValueError")
        return
    event("parsed")
    assert isinstance(layout, Layout) and layout.world_size >= 1
    again = parse_layout(layout.text)
    assert again.sizes == layout.sizes and again.options == layout.options


# -- the train --config TOML ---------------------------------------------------------------------
KEYS = st.sampled_from(["layout", "model", "lr", "batch", "steps", "epochs", "dataset", "clip",
                        "no_progress", "no-progress", "seed", "dtype", "gpt", "accumulate",
                        "optimizer", "on_nonfinite", "max_nonfinite", "momentum", "warmup",
                        "eval_every", "checkpoint_every", "resume", "timeout", "colour", "",
                        "schedule", "min_lr", "param_dtype", "n_train", "loss"])
SCALARS = st.one_of(st.booleans(), st.integers(-5, 10 ** 6), st.floats(allow_nan=True),
                    st.sampled_from(["dp=1", "single", "64,32,10", "adamw", "sgd", "skip",
                                     "float16", "digits", "npy:", "text", "cosine", "d_model=8"]),
                    st.text(max_size=6))
TOML_VALUES = st.one_of(SCALARS, st.lists(SCALARS, max_size=3),
                        st.dictionaries(st.sampled_from(["d_model", "n_heads", "x"]), SCALARS,
                                        max_size=2))


def toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float):
        return "nan" if v != v else ("inf" if v == float("inf") else
                                     "-inf" if v == float("-inf") else repr(v))
    if isinstance(v, int):
        return str(v)
    if isinstance(v, str):
        return json.dumps(v)          # a TOML basic string
    if isinstance(v, list):
        return "[" + ", ".join(map(toml_value, v)) + "]"
    return "{" + ", ".join(f"{json.dumps(k)} = {toml_value(x)}" for k, x in v.items()) + "}"


GOOD = {"layout": ["single", "dp=1"], "lr": [0.01, 0.5], "batch": [8, 64], "steps": [5],
        "model": ["64,32,10", [64, 10]], "no_progress": [True, False], "seed": [0, 3],
        "optimizer": ["sgd", "adamw"], "on_nonfinite": ["skip", "stop"], "max_nonfinite": [3],
        "clip": [1.0], "accumulate": [1, 2], "schedule": ["cosine"], "warmup": [2],
        "dataset": ["digits", "synthetic-regression"], "dtype": ["float64"]}
GOOD_TABLES = st.tuples(st.dictionaries(st.sampled_from(sorted(GOOD)), st.integers(0, 1),
                                        max_size=6),
                        st.dictionaries(KEYS, TOML_VALUES, max_size=1)).map(
    lambda t: {**{k: GOOD[k][i % len(GOOD[k])] for k, i in t[0].items()}, **t[1]})


@SETTINGS
@given(st.one_of(GOOD_TABLES, st.dictionaries(KEYS, TOML_VALUES, max_size=5)), st.booleans(),
       st.integers(1, 8))
def test_train_config_is_parsed_or_one_usage_error(table, garble, world_size):
    text = "".join(f"{json.dumps(k)} = {toml_value(v)}\n" for k, v in table.items())
    if garble and table:
        text = text[:len(text) // 2] + "= ]["
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "run.toml")
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            validate_train_args(parse_train_args(["--config", path]), world_size)
            event("valid")
        except UsageError as exc:
            assert str(exc) and "\n" not in str(exc).strip()
            event("UsageError")


# -- the checkpoint reader -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint():
    """A small valid checkpoint (an MLP and its AdamW state) in a temporary directory."""
    d = tempfile.mkdtemp(prefix="mpishard-prop-")
    model = ms.MLP([3, 4, 2])
    engine = ms.make_engine(model, "single", dtype=np.float64)
    engine.load_checkpoint(model.init(seed=0))
    opt = ms.optim.AdamW(engine, lr=1e-2)
    _, grads = engine.train_step(np.ones((4, 3)), np.zeros((4, 2)), ms.losses.MSE())
    opt.step(grads)
    ms.checkpoint.save(os.path.join(d, "ckpt"), engine, opt, step=1)
    yield os.path.join(d, "ckpt")
    shutil.rmtree(d, ignore_errors=True)


def read_everything(path):
    """What a user does with a checkpoint: open, read every array and optimizer state,
    describe it."""
    ckpt = load(path)
    for name in ckpt:
        np.asarray(ckpt[name])
        ckpt.optimizer_state(name)
    describe(path)


def json_paths(node, prefix=()):
    yield prefix
    if isinstance(node, dict):
        for k, v in node.items():
            yield from json_paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from json_paths(v, prefix + (i,))


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2, 2 ** 40) | st.floats()
                    | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=4),
                                                                        c, max_size=3),
                    max_leaves=6)


def edit_index(path, data):
    """Replace the value at a random place of index.json by a random JSON value, or delete
    it."""
    index_file = os.path.join(path, "index.json")
    with open(index_file) as f:
        index = json.load(f)
    where = data.draw(st.sampled_from(sorted((p for p in json_paths(index) if p), key=repr)))
    parent = index
    for k in where[:-1]:
        parent = parent[k]
    if data.draw(st.booleans()) and isinstance(parent, dict):
        del parent[where[-1]]
    else:
        parent[where[-1]] = data.draw(JSON)
    with open(index_file, "w") as f:
        json.dump(index, f)


def damage_file(path, data):
    """Cut, flip bytes of, or remove index.json or a block file."""
    names = sorted(os.listdir(path))
    name = data.draw(st.sampled_from(names))
    full = os.path.join(path, name)
    raw = bytearray(open(full, "rb").read())
    how = data.draw(st.sampled_from(["cut", "flip", "remove"]))
    if how == "remove":
        os.remove(full)
        return
    if how == "cut":
        raw = raw[:data.draw(st.integers(0, max(0, len(raw) - 1)))]
    else:
        for _ in range(data.draw(st.integers(1, 4))):
            i = data.draw(st.integers(0, len(raw) - 1))
            raw[i] = data.draw(st.integers(0, 255))
    with open(full, "wb") as f:
        f.write(raw)


@FILE_SETTINGS
@given(data=st.data(), mode=st.sampled_from(["index", "file"]))
def test_checkpoint_reader_raises_only_checkpoint_error(checkpoint, data, mode):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "ckpt")
        shutil.copytree(checkpoint, path)
        (edit_index if mode == "index" else damage_file)(path, data)
        with guard():
            try:
                read_everything(path)
                event(f"{mode}: read back")
            except CheckpointError as exc:
                assert str(exc)
                event(f"{mode}: CheckpointError")


def test_the_unharmed_checkpoint_reads(checkpoint):
    with guard():
        read_everything(checkpoint)

"""engine.trace(DIR): one merged Chrome/Perfetto trace with a track per rank; compute, comm
and pipeline spans; the pipeline actions in the order the schedule says; trace-summary reads
it; `train --trace DIR` records a window of steps (train/trace_steps.py). MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/comm/test_trace.py`.
"""
import argparse
import importlib.util
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
import mpishard.cli as cli
from conftest import group_comm
from mpishard.cli.train import parse_train_args, validate_train_args
from mpishard.cli.trace_summary import run_trace_summary
from mpishard.train.trace_steps import parse_steps, window
from mpishard.parallel.schedules import Action, make_schedule


def traced_steps(comm, layout, directory, steps=2):
    model = ms.MLP([8, 16, 16, 16, 4])
    engine = ms.make_engine(model, layout, comm=comm)
    engine.load_checkpoint(model.init(seed=0))
    rng = np.random.default_rng(0)
    x = engine.shard_batch(rng.normal(size=(16, 8)))
    t = engine.shard_batch(rng.normal(size=(16, 4)))
    opt = ms.optim.SGD(engine, lr=0.1)
    with engine.trace(directory) as trace:
        for _ in range(steps):
            _, grads = engine.train_step(x, t, "mse")
            opt.step(grads)
    assert engine.comm.stats.tracer is None and engine.runner.tracer is None
    with open(trace.path) as f:
        return engine, [e for e in json.load(f)["traceEvents"] if e["ph"] == "X"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["dp=2", "pp=2,microbatches=4,schedule=zb1p"])
def test_merged_trace_has_every_rank(layout, tmp_path_factory, capsys):
    comm = group_comm(2)
    directory = comm.bcast(str(tmp_path_factory.mktemp("trace")) if comm.rank == 0 else None)
    engine, events = traced_steps(comm, layout, directory)
    assert {e["pid"] for e in events} == {0, 1}
    assert sum(e["name"] == "optimizer step" for e in events) == 2 * 2
    comm_events = [e for e in events if e["cat"] == "comm"]
    assert comm_events and all(e["args"]["bytes"] >= 0 for e in comm_events)
    if layout == "dp=2":
        assert any(e["name"] == "all_reduce" and e["args"]["group"] for e in comm_events)
        assert any(e["name"].startswith("Linear(layer_0/weights)") for e in events)
    else:
        for rank in (0, 1):
            mine = sorted((e for e in events if e["pid"] == rank and e["cat"] == "action"),
                          key=lambda e: e["ts"])
            ran = [Action(e["args"]["kind"], e["args"]["microbatch"], e["args"]["chunk"])
                   for e in mine]
            assert ran == 2 * make_schedule("zb1p", 2, 4)[rank]       # the measured order
            assert all(a["ts"] + a["dur"] <= b["ts"] + 1e-3 for a, b in zip(mine, mine[1:]))
    if comm.rank == 0:
        capsys.readouterr()
        assert run_trace_summary(argparse.Namespace(directory=directory, png="none")) == 0
        out = capsys.readouterr().out
        assert out.splitlines()[0].split()[:5] == ["rank", "wall", "ms", "compute", "ms"]
        assert ("bubble measured" in out) == ("pp=" in layout)
        assert os.path.exists(os.path.join(directory, "trace.json"))


# -- train --trace DIR --trace-steps A:B ---------------------------------------------------------
TRAIN_LAYOUTS = {2: "dp=2", 4: "dp=2,tp=2"}


@pytest.mark.mpi(min_size=2)
def test_train_trace_cli_then_trace_summary(tmp_path_factory, capsys):
    """A tiny `train --trace DIR` on the world (dp=2 on 2 ranks, dp=2,tp=2 on 4): the default
    window (steps 2 to 4) of a 5-step run, a track per rank with compute and collective spans,
    three optimizer steps per rank; trace-summary reads it and draws the timeline."""
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    layout = TRAIN_LAYOUTS.get(size, f"dp={size}")
    directory = comm.bcast(str(tmp_path_factory.mktemp("train_trace")) if comm.rank == 0
                           else None)
    code = cli.main(["train", "--dataset", "synthetic-regression", "--model", "8,16,16,1",
                     "--layout", layout, "--batch", "16", "--n-train", "64", "--n-test", "16",
                     "--steps", "5", "--no-progress", "--log-every", "0", "--log-level",
                     "WARNING", "--trace", directory])
    assert code == 0
    out = capsys.readouterr().out
    path = os.path.join(directory, "trace.json")
    if comm.rank == 0:
        assert f"trace: steps 2 to 4 in {path}" in out
    with open(path) as f:
        trace = json.load(f)
    assert trace["otherData"]["layout"] == layout and trace["otherData"]["steps"] == [2, 4]
    events = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    tracks = {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert tracks == {f"rank {r}" for r in range(size)}
    for rank in range(size):
        mine = [e for e in events if e["pid"] == rank]
        assert sum(e["name"] == "optimizer step" for e in mine) == 3
        assert any(e["cat"] == "compute" and e["name"].endswith(" forward") for e in mine)
        assert any(e["cat"] == "compute" and e["name"].endswith(" backward") for e in mine)
        reduces = [e for e in mine if e["cat"] == "comm" and e["name"] == "all_reduce"]
        assert reduces and all(e["args"]["bytes"] > 0 and e["args"]["group"] for e in reduces)
    comm.Barrier()
    if comm.rank == 0:
        png = "none" if importlib.util.find_spec("matplotlib") is None else None
        args = argparse.Namespace(directory=directory, png="none", timeline=png)
        assert run_trace_summary(args) == 0
        lines = capsys.readouterr().out.splitlines()
        assert [int(line.split()[0]) for line in lines[1:1 + size]] == list(range(size))
        if png is None:
            assert os.path.getsize(os.path.join(directory, "timeline.png")) > 0
            assert lines[-1].startswith("wrote ") and "the last traced step" in lines[-1]


@pytest.mark.parametrize("text,pair", [("2:4", (2, 4)), ("3:3", (3, 3)), ("5:", (5, None)),
                                       ("all", (1, None))])
def test_trace_steps_parse(text, pair):
    assert parse_steps(text) == pair


@pytest.mark.parametrize("text", ["0:3", "4:2", "3", "a:b", ":4", ""])
def test_trace_steps_bad(text):
    with pytest.raises(ValueError, match="--trace-steps must be A:B"):
        parse_steps(text)


@pytest.mark.parametrize("steps,done,total,expected", [
    (None, 0, 100, (2, 4)), (None, 0, 3, (2, 3)), (None, 0, 1, (1, 1)),
    (None, 10, 100, (12, 14)),            # after a resume at step 10
    ((5, 7), 0, 100, (5, 7)), ((5, None), 0, 8, (5, 8)), ((5, 70), 0, 8, (5, 8)),
    ((1, None), 0, 6, (1, 6))])
def test_trace_window(steps, done, total, expected):
    assert window(steps, done, total) == expected


@pytest.mark.parametrize("steps,done,total", [((9, 12), 0, 8), ((3, 4), 5, 10)])
def test_trace_window_outside_the_run(steps, done, total):
    with pytest.raises(ValueError, match="traces no step of this run"):
        window(steps, done, total)


@pytest.mark.parametrize("argv,message", [
    (["--trace-steps", "2:4"], "--trace-steps 2:4 needs --trace DIR"),
    (["--trace", "DIR", "--trace-steps", "4:2"], "--trace-steps must be A:B"),
    (["--trace", __file__], "exists and is not a directory")])
def test_train_trace_bad_input(argv, message, tmp_path):
    argv = [str(tmp_path / "t") if a == "DIR" else a for a in argv]
    with pytest.raises(cli.UsageError, match=message):
        validate_train_args(parse_train_args(argv), 1)

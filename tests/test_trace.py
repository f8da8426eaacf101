"""engine.trace(DIR): one merged Chrome/Perfetto trace with a track per rank; compute, comm
and pipeline spans; the pipeline actions in the order the schedule says; trace-summary reads
it. MPI tests: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/test_trace.py`.
"""
import argparse
import json
import os

import numpy as np
import pytest

import mpishard as ms
from conftest import group_comm
from mpishard.cli.trace_summary import run_trace_summary
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

"""The Mixtral's load-balancing-loss runners (parallel/aux_loss.py): explicit delegation
to the runner they hold (forward, backward, the tracer, a pipeline's inference_loop), and under
pp one before_action hook, set once, that ends each step's collection.

Serial: `pytest tests/parallel/test_moe_aux_runner.py -m "not mpi"`.
MPI, N in 1, 2, 4, 8: `mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi \
    tests/parallel/test_moe_aux_runner.py`
"""
import json

import numpy as np
import pytest
from conftest import assert_close, group_comm

import mpishard as ms
from mpishard.parallel.aux_loss import AuxLossPipeline, AuxLossRunner

CE = ms.losses.CrossEntropy()


def make_mixtral(n_layers=2):
    return ms.Llama(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=n_layers,
                    n_kv_heads=2, d_ff=12, n_experts=4, top_k=2, router_aux_loss_coef=0.3)


def batch(seed):
    rng = np.random.default_rng(seed)
    return rng.integers(0, 13, (4, 8)), rng.integers(0, 13, (4, 8))


def steps_against_single(engine, model, params, n=2):
    """n train_steps of `engine` and of single on the same batches: equal losses."""
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    engine.load_checkpoint(params)
    for i in range(n):
        x, t = batch(i)
        want, _ = ref.train_step(x, t, CE)
        got, _ = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
        assert_close(got, want, what=f"{engine.layout.text} step {i} loss with c aux")


def test_runner_delegates_explicitly():
    model = make_mixtral()
    engine = ms.SingleDevice(model)
    runner = engine.runner
    assert type(runner) is AuxLossRunner
    runner.tracer = "a tracer"
    assert runner.runner.tracer == "a tracer"       # the held runner's, as a trace sets it
    runner.tracer = None
    runner.other = 1                                 # nothing else reaches the held runner
    assert not hasattr(runner.runner, "other")
    with pytest.raises(AttributeError):
        runner.layers                                # noqa: B018 (no attribute forwarding)
    steps_against_single(ms.SingleDevice(model), model, model.init(seed=1))


@pytest.mark.mpi(min_size=2)
def test_pipeline_hook_is_set_once_and_each_step_adds_its_own_aux():
    """Two gpipe steps (different batches, so different c aux) equal single's; the held
    PipelineRunner keeps the one hook made at construction."""
    model = make_mixtral()
    engine = ms.make_engine(model, "pp=2,schedule=gpipe", comm=group_comm(2))
    runner = engine.runner
    assert type(runner) is AuxLossPipeline
    hook = runner.runner.before_action
    steps_against_single(engine, model, model.init(seed=2))
    assert runner.runner.before_action is hook, "a hook per step"
    assert not runner.aux.active and runner.aux.grad is None


@pytest.mark.mpi(min_size=2)
def test_a_trace_reaches_the_pipeline_runner(tmp_path_factory):
    comm = group_comm(2)
    model = make_mixtral()
    engine = ms.make_engine(model, "pp=2,schedule=gpipe", comm=comm)
    engine.load_checkpoint(model.init(seed=3))
    x, t = batch(0)
    tmp = comm.bcast(str(tmp_path_factory.mktemp("trace")) if comm.Get_rank() == 0 else None)
    with engine.trace(tmp) as trace:
        engine.train_step(engine.shard_batch(x), engine.shard_batch(t), CE)
    assert engine.runner.tracer is None and engine.runner.runner.tracer is None
    with open(trace.path) as f:
        names = {e["name"] for e in json.load(f)["traceEvents"] if e["ph"] == "X"}
    assert {"F0", "B0"} <= names, sorted(names)

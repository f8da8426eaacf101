"""The calibration's whole-step measurements (cli/calibrate.py): the per-call costs of tiny
models (`fixed`) and the mid-size reference models' train_step and AdamW step, over what the
micro-benchmarks predict for them (`step_factor`, `optimizer_factor`: costs/step_time.py),
and the same models' whole steps on every rank of the job (dp=N) over the model's prediction
(`mesh_factor`). The per-call and reference timings go through the `timed` passed in
(costs/calibration.timed: every rank at once, windows of its WINDOW seconds); the dp=N steps
through plan_time's step_fn and measure_steps, as `plan --validate` times a layout.
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..comm.mesh import parse_layout
from ..engine import make_engine
from ..models.gpt.spec import GPT
from ..nn.losses import MSE, CrossEntropy
from ..models.mlp.spec import MLP
from ..costs.step_time import predict_rank, predict_step
from ..train.optim import AdamW
from .plan_time import measure_steps, step_fn

REFERENCE_STEPS = {   # reference_seconds' models and batches: mid-size, fixed
    "mlp": (MLP([512, 1024, 1024, 256]), 64),
    "gpt": (GPT(vocab_size=128, seq_len=32, d_model=96, n_heads=4, n_layers=2), 8)}


def step_seconds(model, comm, dtype, timed, batch: int = 2) -> tuple:
    """(train_step seconds, AdamW step seconds) of `model` on each rank alone (COMM_SELF),
    every rank at once, batch `batch` (2: measure_fixed's tiny models), each by
    `timed(fn, comm)` (costs/calibration.timed)."""
    engine = make_engine(model, "single", dtype=dtype, comm=MPI.COMM_SELF)
    engine.load_checkpoint(model.init(seed=0))
    opt = AdamW(engine, lr=1e-4)
    rng = np.random.default_rng(0)
    if model.takes_tokens:
        x = rng.integers(0, model.vocab_size, (batch, model.seq_len))
        t, loss = rng.integers(0, model.vocab_size, (batch, model.seq_len)), CrossEntropy()
    else:
        x, t, loss = (rng.standard_normal((batch, model.d_in)).astype(dtype),
                      rng.standard_normal((batch, model.d_out)).astype(dtype), MSE())
    grads = engine.train_step(x, t, loss)[1]
    return (timed(lambda: engine.train_step(x, t, loss), comm),
            timed(lambda: opt.step(grads), comm))


def measure_fixed(comm, dtype, timed, ops=None) -> dict:
    """Per-call costs that do not grow with the arrays (calibrate.py: `fixed`); `ops`: the
    measured ops, whose AdamW call on the smallest array (what step_time charges a tiny
    tensor) is taken out of the per-tensor optimizer cost."""
    (m1, o1), (m5, o5) = (step_seconds(MLP([4] * (n + 1)), comm, dtype, timed)
                              for n in (1, 5))

    def gpt(n):
        return GPT(vocab_size=8, seq_len=4, d_model=8, n_heads=2, n_layers=n)
    (g1, _), (g3, _) = (step_seconds(gpt(n), comm, dtype, timed) for n in (1, 3))
    layer, block = max(m5 - m1, 0.0) / 4, max(g3 - g1, 0.0) / 2
    n0, s0 = (ops or {}).get("adamw", [[0.0, 0.0]])[0]
    return {"mlp_layer": layer, "mlp_base": max(m1 - layer, 0.0), "gpt_block": block,
            "gpt_base": max(g1 - block, 0.0),
            "optimizer_tensor": max((o5 - o1) / 8 - (n0 * s0 if ops else 0.0), 0.0)}


def reference_seconds(comm, dtype, timed) -> dict:
    """{'mlp'|'gpt': (train_step seconds, AdamW step seconds) of a mid-size reference model,
    on every rank alone at once (as `fixed`), on fresh arrays}."""
    return {kind: step_seconds(model, comm, dtype, timed, batch)
            for kind, (model, batch) in REFERENCE_STEPS.items()}


def measure_step_factor(samples: list, cal: dict, itemsize: int) -> dict:
    """{'step_factor': {'mlp'|'gpt': the median over `samples` (reference_seconds') of the
    reference's measured train_step over what step_time charges its train_step from `cal`},
    'optimizer_factor': the same of its AdamW step, and each one's '..._range': {kind:
    [lowest, highest]}}: what the micro-benchmarks, each on its own arrays in a loop, miss of
    a step at realistic sizes (operands evicted, fresh outputs, the interpreter between
    calls); step_time multiplies each part of a model of that kind by its factor. Three
    timings spread over the calibration, so one bad moment does not set it (one bench's
    single timing gave 1.05 where the day's others gave 1.27-1.34). The references are fixed,
    not the model being planned."""
    plain = {key: value for key, value in cal.items()
             if key not in ("step_factor", "optimizer_factor")}
    out: dict = {}
    for name, part in (("step_factor", 0), ("optimizer_factor", 1)):
        ratios = {}
        for kind, (model, batch) in REFERENCE_STEPS.items():
            row = predict_rank(model, parse_layout("dp=1"), 0, batch, plain, itemsize)
            predicted = row["optimizer_s"] if part else row["compute_s"] - row["optimizer_s"]
            ratios[kind] = sorted(s[kind][part] / predicted for s in samples)
        out[name] = {kind: float(np.median(r)) for kind, r in ratios.items()}
        out[name + "_range"] = {kind: [r[0], r[-1]] for kind, r in ratios.items()}
    return out


def mesh_seconds(comm, dtype, rounds: int = 7) -> dict:
    """{'mlp'|'gpt': seconds} of each reference model (REFERENCE_STEPS, its batch a rank) on
    dp=N, all N ranks of `comm`: train_step and AdamW (plan --validate's step), the median
    over `rounds` rounds of the slowest rank's step; {} for one rank."""
    n = comm.Get_size()
    if n == 1:
        return {}
    return {kind: measure_steps([step_fn(model, f"dp={n}", batch * n, dtype, comm)], comm,
                                rounds)[0][0]
            for kind, (model, batch) in REFERENCE_STEPS.items()}


def measure_mesh_factor(samples: list, cal: dict, n: int, itemsize: int) -> dict:
    """{'mesh_factor': {'mlp'|'gpt': f}, 'mesh_factor_range': {kind: [lowest, highest]}}
    (costs/step_time.py) from `samples` (mesh_seconds' at n ranks, {} for one rank): the median
    over them of the reference's measured dp=N step over its prediction from `cal` (every
    other factor in it). What it holds is what ranks waiting for each other cost beyond the
    terms, most of it on ranks that share cores (a rank spinning in MPI takes a core another
    computes on). Three timings spread over the calibration, as step_factor's: at 8 ranks on
    2 cores a single timing once gave 1.96 for the GPT where three in another calibration
    gave 1.24-1.53.

    A pipeline factor measured the same way (dp=N/2,pp=2 over dp=N, each over its prediction)
    was left out: on one 2-core host it came out 0.67-0.99 at 4 ranks and 1.21 at 8
    depending on the reference's depth and batch, while the GPT validated there pipelined
    1.3x slower than predicted at 4 ranks: a property of the reference, not of the machine."""
    samples = [s for s in samples if s]
    if not samples:
        return {}
    plain = {key: value for key, value in cal.items()
             if key not in ("mesh_factor", "mesh_factor_range")}
    out: dict = {"mesh_factor": {}, "mesh_factor_range": {}}
    for kind, (model, batch) in REFERENCE_STEPS.items():
        predicted = predict_step(model, parse_layout(f"dp={n}"), batch * n, plain,
                                 itemsize)["step_s"]
        ratios = sorted(s[kind] / predicted for s in samples)
        out["mesh_factor"][kind] = float(np.median(ratios))
        out["mesh_factor_range"][kind] = [ratios[0], ratios[-1]]
    return out

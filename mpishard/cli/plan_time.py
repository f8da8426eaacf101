"""`plan --validate K`: run the layouts the planner ranks fastest, compare predicted and
measured step time.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m mpishard plan \\
        --model 784,512,512,10 --world-size 4 --batch 256 --calibrate --validate 10

The K layouts predicted fastest are built once each in the current MPI job (its size must be
--world-size) and warmed up (2 steps each); then `rounds` rounds run one train_step + AdamW
step of every layout in turn, so a change in the machine's load during the run reaches every
layout alike. A layout's measured time is the median over rounds of the slowest rank's step.
The calibration (cli/calibrate.py) is measured first in the same job with --calibrate.
"""
from __future__ import annotations

import os
import time

import numpy as np
from mpi4py import MPI

from ..engine import make_engine
from ..nn.losses import MSE, CrossEntropy
from ..parallel.model_costs import is_gpt
from ..parallel.step_time import predict_step
from ..train.optim import AdamW

ROUNDS, WARMUP = 9, 2


def step_fn(model, layout, batch, dtype, comm):
    """A callable running one train_step + AdamW step of `layout` on synthetic data."""
    engine = make_engine(model, layout, dtype=dtype, comm=comm)
    engine.load_checkpoint(model.init(seed=0))
    opt = AdamW(engine, lr=1e-4)
    rng = np.random.default_rng(0)
    if is_gpt(model):
        x = rng.integers(0, model.vocab_size, (batch, model.seq_len))
        t, loss = rng.integers(0, model.vocab_size, (batch, model.seq_len)), CrossEntropy()
    else:
        x = rng.standard_normal((batch, model.d_in)).astype(dtype)
        t, loss = rng.standard_normal((batch, model.d_out)).astype(dtype), MSE()
    x, t = engine.shard_batch(x), engine.shard_batch(t)

    def step():
        opt.step(engine.train_step(x, t, loss)[1])
    return step


def measure_steps(steps: list, comm, rounds=ROUNDS, warmup=WARMUP) -> list:
    """Median over `rounds` alternating rounds of the slowest rank's seconds per step, one
    per callable in `steps` (each warmed up `warmup` times first)."""
    for step in steps:
        for _ in range(warmup):
            step()
    times = [[] for _ in steps]
    for _ in range(rounds):
        for i, step in enumerate(steps):
            comm.Barrier()
            t0 = time.perf_counter()
            step()
            times[i].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return [float(np.median(t)) for t in times]


def validate(model, rows, batch, dtype, calibration, top, comm=None, rounds=ROUNDS) -> list:
    """Run the `top` layouts of `rows` predicted fastest; [(layout, predicted s, measured s)]."""
    comm = MPI.COMM_WORLD if comm is None else comm
    itemsize = np.dtype(dtype).itemsize
    pred = sorted((predict_step(model, r["layout"], batch, calibration, itemsize)["step_s"],
                   r["layout"]) for r in rows)[:top]
    steps = [step_fn(model, layout, batch, dtype, comm) for _, layout in pred]
    measured = measure_steps(steps, comm, rounds)
    return [(layout, p, m) for (p, layout), m in zip(pred, measured)]


def validation_report(results) -> str:
    """The predicted vs measured table, the median absolute error and the best's gap."""
    lines = [f"{'layout':<36}{'predicted':>12}{'measured':>12}{'error':>9}"]
    errors = []
    for layout, p, m in results:
        errors.append(abs(p - m) / m)
        lines.append(f"{layout:<36}{p * 1e3:>10.2f}ms{m * 1e3:>10.2f}ms{100 * (p - m) / m:>8.1f}%")
    best_measured = min(m for _, _, m in results)
    predicted_best = min(results, key=lambda r: r[1])
    gap = predicted_best[2] / best_measured - 1
    lines.append(f"median absolute error {100 * float(np.median(errors)):.1f}% over "
                 f"{len(results)} layouts; predicted best {predicted_best[0]!r} measured "
                 f"{100 * gap:.1f}% slower than the measured best "
                 f"(load average {os.getloadavg()[0]:.1f})")
    return "\n".join(lines)

"""`plan --validate K`: run the layouts the planner ranks first, compare predicted and
measured step time.

    OPENBLAS_NUM_THREADS=1 mpiexec -n 4 python -m mpi4py -m mpishard plan \\
        --model 784,512,512,10 --world-size 4 --batch 256 --calibrate --validate 10

The K layouts ranked first (as `--layout auto` ranks them: a pipeline by its step with the
idle time paid in full, costs/step_time.ranking_seconds) are built once each in the current
MPI job (its size must be --world-size) and warmed up (2 steps each); then `rounds` rounds
run one train_step + AdamW step of every layout in turn, so a change in the machine's load
during the run reaches every layout alike. A layout's measured time is the median over rounds
of the slowest rank's step. The calibration (cli/calibrate.py, costs/calibration.py) is
measured first in the same job with --calibrate.
"""
from __future__ import annotations

import os
import time
from math import inf

import numpy as np
from mpi4py import MPI

from ..comm.mesh import parse_layout
from ..engine import make_engine
from ..nn.losses import MSE, CrossEntropy
from ..costs.calibration import layer_gflops
from ..costs.choose import rank_rows
from ..costs.step_time import predict_step
from ..health.heap import keep_host_heap
from ..train.optim import AdamW

ROUNDS, WARMUP = 9, 2
REFERENCE = 256                   # the GEMM size validation re-times each round


def step_fn(model, layout, batch, dtype, comm):
    """A callable running one train_step + AdamW step of `layout` on synthetic data."""
    engine = make_engine(model, layout, dtype=dtype, comm=comm)
    engine.load_checkpoint(model.init(seed=0))
    opt = AdamW(engine, lr=1e-4)
    rng = np.random.default_rng(0)
    if model.takes_tokens:
        x = rng.integers(0, model.vocab_size, (batch, model.seq_len))
        t, loss = rng.integers(0, model.vocab_size, (batch, model.seq_len)), CrossEntropy()
    else:
        x = rng.standard_normal((batch, model.d_in)).astype(dtype)
        t, loss = rng.standard_normal((batch, model.d_out)).astype(dtype), MSE()
    x, t = engine.shard_batch(x), engine.shard_batch(t)

    def step():
        opt.step(engine.train_step(x, t, loss)[1])
    return step


def measure_steps(steps: list, comm, rounds=ROUNDS, warmup=WARMUP, probe=None) -> tuple:
    """(median over `rounds` alternating rounds of the slowest rank's seconds per step, one
    per callable in `steps` (each warmed up `warmup` times first); the median of `probe()`
    run once per round, or None)."""
    for step in steps:
        for _ in range(warmup):
            step()
    times, probes = [[] for _ in steps], []
    for _ in range(rounds):
        for i, step in enumerate(steps):
            comm.Barrier()
            t0 = time.perf_counter()
            step()
            times[i].append(comm.allreduce(time.perf_counter() - t0, op=MPI.MAX))
        if probe is not None:
            probes.append(probe())
    return [float(np.median(t)) for t in times], \
        (float(np.median(probes)) if probes else None)


def ranked_first(rows, top: int) -> list:
    """The `top` of plan rows (with a calibration's step_s and unlent_s) in `--layout auto`'s
    order (costs/choose.rank_rows, no memory limit)."""
    return rank_rows(rows, inf, calibrated=True)["fit"][:top]


def validate(model, rows, batch, dtype, calibration, top, comm=None, rounds=ROUNDS) -> list:
    """Run the `top` of plan rows `rows` ranked first (as `--layout auto` ranks them:
    step_time.ranking_seconds, then memory), a row without a step_s predicted from
    `calibration`; [(layout, predicted s, measured s)] in that order.
    Each round also times the calibration's reference GEMMs (n = REFERENCE, a short window):
    `validate.drift` is their median rate over the calibration's, how much faster (> 1) or
    slower the machine ran than when it was calibrated (reported, not used). The host heap is
    kept, as `train` and the calibration keep it (cli/calibrate.py)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    keep_host_heap("keep")      # the train command's heap, as the calibration measured with
    itemsize = np.dtype(dtype).itemsize
    predicted = [r if r.get("step_s") is not None else   # plan's rows carry their prediction
                 dict(r, **predict_step(model, parse_layout(r["layout"]), batch, calibration,
                                        itemsize)) for r in rows]
    pred = [(r["step_s"], r["layout"]) for r in ranked_first(predicted, top)]
    steps = [step_fn(model, layout, batch, dtype, comm) for _, layout in pred]
    reference = dict((int(round((f / 4) ** (1 / 3))), g) for f, g in calibration["gemm"])
    # (a gemm point is one GEMM of a layer at n: 4 n^3 FLOPs)
    probe = (lambda: layer_gflops(REFERENCE, comm, dtype, window=0.05, repeats=1)) \
        if REFERENCE in reference else None
    measured, rate = measure_steps(steps, comm, rounds, probe=probe)
    validate.drift = rate / reference[REFERENCE] if rate else None
    return [(layout, p, m) for (p, layout), m in zip(pred, measured)]


validate.drift = None


def _summary(results) -> tuple:
    """(median absolute error, predicted best, its gap to the measured best); the predicted
    best is the first of `results` (validate's order: the ranking's)."""
    errors = [abs(p - m) / m for _, p, m in results]
    best = results[0]
    return float(np.median(errors)), best[0], best[2] / min(m for _, _, m in results) - 1


def validation_summary(results, drift=None) -> dict:
    """validation_report's numbers (plan --json): per layout the predicted and measured
    seconds and the relative error; the median absolute error, the predicted best and how
    much slower it ran than the measured best ('best_gap'), the drift and, with one, the
    error again with every prediction divided by it."""
    error, best, gap = _summary(results)
    scaled = _summary([(lay, p / drift, m) for lay, p, m in results])[0] if drift else None
    return {"layouts": [{"layout": lay, "predicted_s": p, "measured_s": m,
                         "error": (p - m) / m} for lay, p, m in results],
            "median_abs_error": error, "predicted_best": best, "best_gap": gap,
            "measured_best": min(results, key=lambda r: r[2])[0], "drift": drift,
            "median_abs_error_drift_scaled": scaled, "load_average": os.getloadavg()[0]}


def validation_report(results, drift=None) -> str:
    """The predicted vs measured table, the median absolute error, the best's gap and the
    machine's drift since the calibration (validate.drift): with a drift, the error again
    with every prediction divided by it (the calibration's rates at the machine's share
    during the validation; the ranking, and so the best's gap, does not change)."""
    summary = validation_summary(results, drift)
    lines = [f"{'layout':<36}{'predicted':>12}{'measured':>12}{'error':>9}"]
    for row in summary["layouts"]:
        lines.append(f"{row['layout']:<36}{row['predicted_s'] * 1e3:>10.2f}ms"
                     f"{row['measured_s'] * 1e3:>10.2f}ms{100 * row['error']:>8.1f}%")
    lines.append(f"median absolute error {100 * summary['median_abs_error']:.1f}% over "
                 f"{len(results)} layouts; predicted best {summary['predicted_best']!r} "
                 f"measured {100 * summary['best_gap']:.1f}% slower than the measured best "
                 f"(load average {summary['load_average']:.1f})")
    if drift:
        lines.append(f"reference GEMMs ran at {drift:.2f}x their calibrated rate during the "
                     f"validation (the machine's share changed since --calibrate); predictions "
                     f"/ {drift:.2f}: median absolute error "
                     f"{100 * summary['median_abs_error_drift_scaled']:.1f}%")
    return "\n".join(lines)

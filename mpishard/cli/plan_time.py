"""`plan --calibrate FILE` and `plan --validate K`: measure this machine, check the prediction.

    mpiexec -n 8 python -m mpi4py -m mpishard plan --model 784,512,512,10 --world-size 8 \\
        --batch 256 --calibrate ~/.cache/mpishard/calibration.json --validate 12

Calibration (every rank of the job at once, as in training, so cores shared by more ranks
than they have show in the rates): GEMM GFLOP/s per shape class, memory bandwidth of an
element-wise update, the cost of one small call, and per collective kind and group size
(2, 4, ... up to the job's size; the world split into groups, all busy together; watchdog off:
no window per split communicator) the
alpha-beta fit through the engine's own calls at a small and a large size. The JSON is small
and belongs to the machine and the rank count it was measured at (an example:
examples/calibration.example.json). Validation runs the layouts the planner ranks first in
the current MPI job (its size must be --world-size) for a few steps each and prints predicted
against measured step time (median over steps of the slowest rank).
"""
from __future__ import annotations

import json
import os
import time

import numpy as np
from mpi4py import MPI

from ..engine import make_engine
from ..nn.losses import MSE, CrossEntropy
from ..nn.models import MLP
from ..parallel.model_costs import is_gpt
from ..parallel.step_time import predict_step
from ..train.optim import AdamW

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
GEMM_SHAPES = {"small": (64, 128, 128), "medium": (256, 512, 512), "large": (512, 1024, 1024)}
SIZES = (2 ** 12, 2 ** 21)                 # bytes per rank: the alpha point and the beta point
DEFAULT_PATH = os.path.join("~", ".cache", "mpishard", "calibration.json")


def _median_time(fn, comm, repeats=7, inner=1) -> float:
    """Median over repeats of the slowest rank's seconds per call."""
    fn()
    out = []
    for _ in range(repeats):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        out.append(comm.allreduce((time.perf_counter() - t0) / inner, op=MPI.MAX))
    return float(np.median(out))


def measure_compute(comm, dtype) -> dict:
    rng = np.random.default_rng(comm.Get_rank())
    rates = {}
    for name, (m, k, n) in GEMM_SHAPES.items():
        a, b = rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((k, n)).astype(dtype)
        rates[name] = 2 * m * k * n / _median_time(lambda: a @ b, comm, inner=3) / 1e9
    big = np.ones(2 ** 20, dtype)
    seconds = _median_time(lambda: np.multiply(big, 0.5, out=big), comm, inner=5)
    tiny = np.ones(8, dtype)
    call = _median_time(lambda: [np.add(tiny, tiny) for _ in range(100)], comm) / 100
    return {"gemm_gflops": rates, "memory_gbs": 2 * big.nbytes / seconds / 1e9,
            "call_s": 20 * call}        # a layer pass: ~20 numpy calls


def _collective(engine, kind, a):
    """(a call of `kind` on the engine's 'dp' group, the counted bytes of one call)."""
    if kind == "send":
        me, n = engine.comm.rank("dp"), engine.comm.size("dp")
        peer = me ^ 1
        return (lambda: engine.send(peer, a) if me % 2 == 0 else engine.receive(peer)) \
            if peer < n else (lambda: None)
    if kind == "broadcast":
        return lambda: engine.broadcast(a, root=0, group="dp")
    return lambda: getattr(engine, kind)(a, group="dp")


def measure_collectives(comm, dtype) -> dict:
    world = comm.Get_size()
    out = {k: {} for k in KINDS}
    n = 2
    while n <= world:
        sub = comm.Split(comm.Get_rank() // n, comm.Get_rank())
        engine = make_engine(MLP([2, 2]), f"dp={n}", dtype=dtype, comm=sub, timeout=0)
        for kind in KINDS:
            points = []
            for nbytes in SIZES:
                a = np.ones(max(n, nbytes // np.dtype(dtype).itemsize // n * n), dtype)
                fn = _collective(engine, kind, a)
                engine.reset_comm_stats()
                fn()
                counted = comm.allreduce(sum(engine.comm_bytes.values()), op=MPI.MAX)
                points.append((counted or a.nbytes, _median_time(fn, comm, inner=3)))
            (b1, t1), (b2, t2) = points
            beta = (b2 - b1) / max(t2 - t1, 1e-9)
            out[kind][str(n)] = [max(t1 - b1 / beta, 1e-7), beta]
        sub.Free()
        n *= 2
    return out


def calibrate(path, dtype=np.float32, comm=None) -> dict:
    """Measure this machine on every rank of `comm` (collective); rank 0 writes `path`."""
    comm = MPI.COMM_WORLD if comm is None else comm
    cal = {"ranks": comm.Get_size(), "dtype": np.dtype(dtype).name,
           "host": os.uname().nodename, "load_average": os.getloadavg()[0],
           **measure_compute(comm, dtype), "collectives": measure_collectives(comm, dtype)}
    if comm.Get_rank() == 0 and path:
        path = os.path.expanduser(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal


def load_calibration(path) -> dict:
    with open(os.path.expanduser(path)) as f:
        return json.load(f)


def measure_step(model, layout, batch, dtype, comm, steps=5, warmup=2) -> float:
    """Median over `steps` of the slowest rank's train_step + AdamW step, in seconds."""
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
    for _ in range(warmup):
        step()
    return _median_time(step, comm, repeats=steps)


def validate(model, rows, batch, dtype, calibration, top, comm=None, steps=5) -> list:
    """Run the `top` layouts of `rows` predicted fastest; [(layout, predicted s, measured s)]."""
    comm = MPI.COMM_WORLD if comm is None else comm
    itemsize = np.dtype(dtype).itemsize
    pred = sorted((predict_step(model, r["layout"], batch, calibration, itemsize)["step_s"],
                   r["layout"]) for r in rows)[:top]
    return [(layout, p, measure_step(model, layout, batch, dtype, comm, steps))
            for p, layout in pred]


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

"""Single-rank float32 train_step throughput as a fraction of plain matmul throughput.

    python benchmarks/mfu.py                                  # MLP([1024, 4096, 1024]), batch 512
    OMP_NUM_THREADS=1 python benchmarks/mfu.py --repeats 9
    python benchmarks/mfu.py --dims 256,1024,256 --batch 128

One `engine.train_step` (forward, MSE loss, backward) of an MLP runs these GEMMs, for each
layer i with input (B, D_i) and weight (D_i, F_i):

    forward     y_i  = x_i W_i                 (B, D_i) @ (D_i, F_i)
    backward    dW_i = x_i^T dy_i              (D_i, B) @ (B, F_i)
                dx_i = dy_i W_i^T              (B, F_i) @ (F_i, D_i)   not for layer 0: the
                                                                        model input needs no grad

The same GEMMs, as plain `a @ b` on arrays of those shapes, are timed in the same run,
alternating with the train steps so both see the same machine load. Both are charged the same
FLOPs (2 m k n per GEMM), so

    mfu_fraction = (FLOPs / t_step) / (FLOPs / t_matmul) = t_matmul / t_step

is the share of the machine's matmul speed the engine keeps after its elementwise work
(bias, activation, loss), copies and bookkeeping. Medians of `--repeats` timings after
`--warmup` untimed ones. The last line printed is exactly `mfu_fraction=<value>`.
`measure()` is what benchmarks/run_all.py calls.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms


def gemm_shapes(dims, batch) -> list:
    """(m, k, n) of every GEMM in one train step, as listed in the module docstring."""
    shapes = []
    for d, f in zip(dims[:-1], dims[1:]):
        shapes.append((batch, d, f))              # forward  x W
    for i, (d, f) in enumerate(zip(dims[:-1], dims[1:])):
        shapes.append((d, batch, f))              # backward x^T dy
        if i > 0:
            shapes.append((batch, f, d))          # backward dy W^T
    return shapes


def flops(shapes) -> float:
    return float(sum(2 * m * k * n for m, k, n in shapes))


def measure(dims=(1024, 4096, 1024), batch=512, repeats=7, warmup=2, activation="relu",
            seed=0, verbose=False) -> dict:
    dims = [int(d) for d in dims]
    rng = np.random.default_rng(seed)
    model = ms.MLP(dims, activation=activation)
    engine = ms.SingleDevice(model, dtype=np.float32, comm=MPI.COMM_SELF)
    engine.load_checkpoint(model.init(seed=seed))
    x = rng.standard_normal((batch, dims[0])).astype(np.float32)
    t = rng.standard_normal((batch, dims[-1])).astype(np.float32)
    loss = ms.losses.MSE()

    shapes = gemm_shapes(dims, batch)
    operands = [(rng.standard_normal((m, k)).astype(np.float32),
                 rng.standard_normal((k, n)).astype(np.float32)) for m, k, n in shapes]

    def step():
        engine.train_step(x, t, loss)

    def matmuls():
        for a, b in operands:
            a @ b

    for _ in range(warmup):
        step()
        matmuls()
    t_step, t_mm = [], []
    for _ in range(repeats):                      # alternate, so both see the same load
        t0 = time.perf_counter()
        step()
        t_step.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        matmuls()
        t_mm.append(time.perf_counter() - t0)
    step_s, mm_s = statistics.median(t_step), statistics.median(t_mm)
    work = flops(shapes)
    res = {
        "dims": dims, "batch": batch, "repeats": repeats, "gemms": len(shapes),
        "gflop_per_step": work / 1e9,
        "step_s": step_s, "matmul_s": mm_s,
        "step_gflops": work / step_s / 1e9, "matmul_gflops": work / mm_s / 1e9,
        "mfu_fraction": mm_s / step_s,
        "threads": os.environ.get("OMP_NUM_THREADS", "default"),
    }
    if verbose:
        print(f"MLP {dims}, batch {batch}, float32, {len(shapes)} GEMMs, "
              f"{res['gflop_per_step']:.2f} GFLOP per step, OMP_NUM_THREADS={res['threads']}")
        print(f"train_step  median {step_s * 1e3:8.2f} ms  {res['step_gflops']:8.2f} GFLOP/s  "
              f"(all: {' '.join(f'{s * 1e3:.1f}' for s in t_step)})")
        print(f"plain a @ b median {mm_s * 1e3:8.2f} ms  {res['matmul_gflops']:8.2f} GFLOP/s  "
              f"(all: {' '.join(f'{s * 1e3:.1f}' for s in t_mm)})")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="1024,4096,1024", help="comma-separated layer widths")
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args(argv)
    res = measure([int(d) for d in args.dims.split(",")], args.batch, args.repeats,
                  args.warmup, verbose=True)
    print(f"mfu_fraction={res['mfu_fraction']:.4f}")


if __name__ == "__main__":
    main()

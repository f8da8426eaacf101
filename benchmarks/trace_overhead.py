"""The cost of the trace (engine.trace): train_step + AdamW step time with tracing off and on,
alternating blocks in one run, as ratios (median of the blocks' medians).

    mpiexec -n 2 python -m mpi4py benchmarks/trace_overhead.py --layout dp=2
    python benchmarks/trace_overhead.py --layout single --off-only   # time one tree only

`--off-only` times only the untraced step, so the same command run with PYTHONPATH set to an
older checkout measures "before" against "off" (the hooks' cost when no tracer is attached).
Rank 0 prints one line: median step seconds off, on, and on/off.
"""
import argparse
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms


def block(engine, opt, x, t, steps):
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        _, grads = engine.train_step(x, t, "mse")
        opt.step(grads)
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--layout", default="single")
    p.add_argument("--dims", default="256,512,512,512,512,10")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--off-only", action="store_true")
    args = p.parse_args()
    model = ms.MLP([int(d) for d in args.dims.split(",")])
    engine = ms.make_engine(model, args.layout, comm=MPI.COMM_WORLD)
    engine.load_checkpoint(model.init(seed=0))
    rng = np.random.default_rng(0)
    x = engine.shard_batch(rng.normal(size=(args.batch, model.d_in)))
    t = engine.shard_batch(rng.normal(size=(args.batch, model.d_out)))
    opt = ms.optim.AdamW(engine, lr=1e-4)
    block(engine, opt, x, t, 3)
    off, on = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.blocks):
            off.append(block(engine, opt, x, t, args.steps))
            if not args.off_only:
                trace = engine.trace(MPI.COMM_WORLD.bcast(tmp, root=0))
                trace.start()
                on.append(block(engine, opt, x, t, args.steps))
                trace.stop()
    if MPI.COMM_WORLD.rank == 0:
        line = f"{args.layout}: off {np.median(off) * 1e3:.3f} ms (blocks {min(off) * 1e3:.3f}-" \
               f"{max(off) * 1e3:.3f})"
        if on:
            line += f", on {np.median(on) * 1e3:.3f} ms (blocks {min(on) * 1e3:.3f}-" \
                    f"{max(on) * 1e3:.3f}), on/off {np.median(on) / np.median(off):.3f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()

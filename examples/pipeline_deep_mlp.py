"""A deep MLP in 4 pipeline stages: schedules, stashed activations, idle time and the bubble.

    mpiexec -n 4 python -m mpi4py examples/pipeline_deep_mlp.py
    mpiexec -n 4 python -m mpi4py examples/pipeline_deep_mlp.py --schedule interleaved --width 256

An 8-layer relu MLP (32 -> width x 7 -> 10, softmax cross entropy) is split into 4 stages of
equal parameter count (2 layers each; 1 per virtual stage with --schedule interleaved). Each
step trains on 64 rows in --microbatches microbatches (default 8) and is checked against the
single-device reference (loss, every gradient, the predictions; float64, rtol 1e-9). Rank 0
prints, per stage, the peak number of stashed microbatch activations, the time spent idle
waiting for a neighbour and the measured bubble, next to the simulated schedule's numbers and
the textbook (p-1)/(v*m+p-1). Timings only mean something with one free core per rank.
The exit status is non-zero if the pipeline ever disagrees with `single`.
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.parallel.schedules import Action, ideal_bubble, simulate
from mpishard.parallel.pipeline import pipeline_bubble

RTOL = 1e-9


def close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max()) <= RTOL * max(float(np.abs(b).max()), 1e-300)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b", "interleaved"])
    parser.add_argument("--microbatches", type=int, default=8)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.1)
    args = parser.parse_args()

    pp = 4
    model = ms.MLP(dims=[32] + [args.width] * 7 + [10], activation="relu")
    params = model.init(seed=1)
    layout = f"pp={pp},microbatches={args.microbatches},schedule={args.schedule}"
    engine = ms.make_engine(model, layout, dtype=np.float64)
    engine.load_checkpoint(params)
    single = ms.SingleDevice(model)
    single.load_checkpoint(params)
    comm, rank0 = engine.mpi_comm, engine.device_id == 0

    rng = np.random.default_rng(0)                 # labels from a random linear teacher
    x = rng.normal(size=(64, 32))
    t = (x @ rng.normal(size=(32, 10))).argmax(axis=1)
    ce = ms.losses.CrossEntropy()

    ok = True
    for step in range(args.steps):
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), ce)
        ref_loss, ref_grads = single.train_step(x, t, ce)
        full = engine.gather_grads(grads)
        ok &= close(loss, ref_loss) and all(close(full[k], ref_grads[k]) for k in ref_grads)
        for name in engine.params:                 # SGD on this stage's own weights
            engine.params[name] -= args.lr * grads[name]
        for name in single.params:
            single.params[name] -= args.lr * ref_grads[name]
        if rank0:
            print(f"step {step}  loss {loss:.6f}  single {ref_loss:.6f}")
    stats = dict(engine.stats)                     # the last step's numbers
    bubble = pipeline_bubble(engine)
    ok &= close(engine.gather_batch(engine.predict(engine.shard_batch(x))), single.predict(x))
    ok = comm.allreduce(bool(ok), op=MPI.LAND)     # control data

    every = comm.gather((sorted(engine.local_names), [tuple(a) for a in stats["actions"]],
                         stats["peak_stashed"], stats["idle_s"], stats["busy_s"],
                         stats["step_s"]), root=0)
    if rank0:
        v = stats["virtual_stages"]
        sim = simulate([[Action(*a) for a in row[1]] for row in every], pp,
                       args.microbatches, v)
        print(f"{layout}: the last step, per stage")
        for s, (names, _, peak, idle, busy, total) in enumerate(every):
            layers = sorted({n.split("/")[0] for n in names}, key=lambda n: int(n[6:]))
            print(f"  stage {s} [{', '.join(layers)}]: peak stashed {peak} (schedule "
                  f"{sim.peak_live_activations[s]}), idle {idle * 1e3:.2f} ms, busy "
                  f"{busy * 1e3:.2f} ms of {total * 1e3:.2f} ms")
        print(f"bubble: measured {bubble:.3f}, simulated from the actions run "
              f"{sim.bubble_fraction:.3f}, ideal (p-1)/(v*m+p-1) "
              f"{ideal_bubble(pp, args.microbatches, v):.3f}")
        print(f"pipeline {'agrees with' if ok else 'DISAGREES with'} single (rtol {RTOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

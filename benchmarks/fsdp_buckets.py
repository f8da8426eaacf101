"""ZeRO-2/3 gradient buckets: reduce-scatter calls and step time, bucket_mb=0 against the
default bucket, alternating blocks in one run (each side's time: the median of its blocks'
medians, a block's step time the slowest rank's; also the median of the blocks' ratios).

    mpiexec -n 2 python -m mpi4py benchmarks/fsdp_buckets.py --fsdp 2
    mpiexec -n 2 python -m mpi4py benchmarks/fsdp_buckets.py --dims 64,256,256,256,256,10

Rank 0 prints, per zero stage, the calls and bytes per step (train_step + AdamW step) of each
side and the step-time ratio default / bucket_mb=0.
"""
import argparse
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms


def block(engine, opt, x, t, steps) -> float:
    times = []
    for _ in range(steps):
        MPI.COMM_WORLD.Barrier()
        t0 = time.perf_counter()
        _, grads = engine.train_step(x, t, "mse")
        opt.step(grads)
        times.append(MPI.COMM_WORLD.allreduce(time.perf_counter() - t0, op=MPI.MAX))
    return float(np.median(times))


def per_step(engine, opt, x, t) -> tuple:
    engine.reset_comm_stats()
    _, grads = engine.train_step(x, t, "mse")
    opt.step(grads)
    return dict(engine.comm_calls), dict(engine.comm_bytes)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--fsdp", type=int, default=MPI.COMM_WORLD.size)
    p.add_argument("--dims", default="64,256,256,256,256,10")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--blocks", type=int, default=5)
    p.add_argument("--zero", default="2,3")
    args = p.parse_args()
    model = ms.MLP([int(d) for d in args.dims.split(",")])
    rng = np.random.default_rng(0)
    xg, tg = rng.normal(size=(args.batch, model.d_in)), rng.normal(size=(args.batch, model.d_out))
    sides = {}
    for zero in (int(z) for z in args.zero.split(",")):
        for bucket in ("bucket_mb=0", "default"):
            layout = f"fsdp={args.fsdp},zero={zero}" + ("" if bucket == "default" else
                                                          f",{bucket}")
            e = ms.make_engine(model, layout, dtype=np.float32, comm=MPI.COMM_WORLD)
            e.load_checkpoint(model.init(seed=0))
            opt = ms.optim.AdamW(e, lr=1e-4)
            x, t = e.shard_batch(xg), e.shard_batch(tg)
            block(e, opt, x, t, 2)                                     # warm-up
            sides[(zero, bucket)] = [e, opt, x, t, per_step(e, opt, x, t), []]
    for _ in range(args.blocks):                                       # alternating
        for side in sides.values():
            side[5].append(block(*side[:4], args.steps))
    if MPI.COMM_WORLD.rank:
        return
    for zero in sorted({z for z, _ in sides}):
        for bucket in ("bucket_mb=0", "default"):
            calls, sent = sides[(zero, bucket)][4]
            print(f"zero={zero} {bucket:11s}: reduce_scatter {calls.get('reduce_scatter', 0)} "
                  f"calls {sent.get('reduce_scatter', 0):,.0f} B, all_gather "
                  f"{calls.get('all_gather', 0)} calls {sent.get('all_gather', 0):,.0f} B per "
                  f"step; median step {np.median(sides[(zero, bucket)][5]) * 1e3:.2f} ms")
        base, new = (np.median(sides[(zero, b)][5]) for b in ("bucket_mb=0", "default"))
        ratios = [b / a for a, b in zip(sides[(zero, "bucket_mb=0")][5],
                                        sides[(zero, "default")][5])]
        print(f"zero={zero}: step time default / bucket_mb=0 = {new / base:.3f} (median of "
              f"the per-block ratios {np.median(ratios):.3f}, blocks "
              f"{', '.join(f'{r:.2f}' for r in ratios)})", flush=True)


if __name__ == "__main__":
    main()

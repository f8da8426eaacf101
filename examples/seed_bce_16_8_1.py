"""A 16 -> 8 -> 1 sigmoid + BCE classifier, SGD lr 0.5, batch 32, trained under every layout.

    mpiexec -n 2 python -m mpi4py examples/seed_bce_16_8_1.py
    mpiexec -n 2 python -m mpi4py examples/seed_bce_16_8_1.py --steps 200 --print-every 50

The task: x ~ N(0, 1) in 16 dimensions, label 1 where x . w > 0 for a random w
(linearly separable). The model is relu(x W0 + b0) -> sigmoid(h W1 + b1), the loss BCE, the
optimizer plain SGD (lr 0.5) on batches of 32 rows drawn, reshuffled every epoch, from 1024
training rows. The same initial weights and the same batches run under each layout:

    single   one device (every rank runs it on its own COMM_SELF)
    dp=2     each rank gets 16 of the 32 rows, gradients averaged with all_reduce
    tp=2     W0 split by columns (4 hidden units per rank), W1 by rows, one all_reduce forward
    pp=2     layer 0 on rank 0, layer 1 on rank 1

Rank 0 prints the loss every `--print-every` steps (1000 by default) in one column per layout;
the columns agree to float64 rounding, and the script exits non-zero if any layout departs
from `single` by more than 1e-9 relative. Layouts that need another number of ranks than the
world has are skipped (with one rank only `single` runs).
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.train.data import DistributedBatcher

RTOL = 1e-9


def task(n_train=1024, n_test=256, seed=0):
    """Rows x ~ N(0, 1) labelled 1 where x . w > 0 for a random w: (x, t, x_test, t_test) with
    float (N, 1) 0/1 targets."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=(16, 1))
    x = rng.normal(size=(n_train + n_test, 16))
    t = (x @ w > 0).astype(np.float64)
    return x[:n_train], t[:n_train], x[n_train:], t[n_train:]


def train(layout, args, data):
    """Train on `layout`; returns (loss per step, test accuracy) on every rank."""
    x, t, x_test, t_test = data
    model = ms.MLP(dims=[16, 8, 1], activation="relu", final_activation="sigmoid")
    if layout == "single":
        engine = ms.SingleDevice(model)
    else:
        engine = ms.make_engine(model, layout, dtype=np.float64)
    engine.load_checkpoint(model.init(seed=args.seed))
    opt = ms.optim.SGD(engine, lr=args.lr)
    bce = ms.losses.BCE()
    batches = DistributedBatcher.for_engine(engine, x, t, args.batch, seed=args.seed)
    losses = []
    for step in range(args.steps):
        [(xb, tb)] = batches.micro_batches(step)          # this rank's rows of the batch
        loss, grads = engine.train_step(xb, tb, bce)      # global mean loss, local gradients
        opt.step(grads)                                   # W -= lr * dW on this rank's shards
        losses.append(loss)
    y = engine.gather_batch(engine.predict(engine.shard_batch(x_test)))
    accuracy = float(((engine.backend.to_host(y) >= 0.5) == (t_test >= 0.5)).mean())
    return losses, accuracy


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5000)
    p.add_argument("--print-every", type=int, default=1000)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layouts", nargs="+", default=["single", "dp=2", "tp=2", "pp=2"],
                   help="layouts to compare (default: single dp=2 tp=2 pp=2)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    if args.steps < 1 or args.print_every < 1:
        p.error("--steps and --print-every must be >= 1")
    data = task(n_test=256)
    results = {}
    for layout in args.layouts:
        if layout != "single":
            try:
                size = ms.parse_layout(layout).world_size
                if size != comm.Get_size():
                    raise ValueError(f"needs {size} ranks, the world has {comm.Get_size()}")
                results[layout] = train(layout, args, data)
            except (ValueError, ImportError) as exc:      # the same on every rank
                if rank0:
                    print(f"skipping {layout}: {exc}")
                continue
        else:
            results[layout] = train(layout, args, data)
    ref = np.array(results["single"][0]) if "single" in results else None
    diffs = {c: float(np.max(np.abs(np.array(results[c][0]) - ref) / np.abs(ref)))
             for c in results if ref is not None and c != "single"}
    worst = max(diffs.values(), default=0.0)          # the same on every rank
    if rank0:
        report(args, comm.Get_size(), results, diffs)
    if worst > RTOL:
        if rank0:
            print(f"FAILED: a layout departs from single by {worst:.2e} > {RTOL:g}")
        return 1
    return 0


def report(args, world_size, results, diffs):
    cols = list(results)
    print(f"16 -> 8 -> 1 relu/sigmoid + BCE, SGD lr {args.lr}, batch {args.batch}, "
          f"{args.steps} steps, {world_size} rank(s)")
    print(f"{'step':>7} " + " ".join(f"{c:>12}" for c in cols))
    for step in range(args.print_every, args.steps + 1, args.print_every):
        print(f"{step:>7} " + " ".join(f"{results[c][0][step - 1]:>12.6f}" for c in cols))
    print(f"{'test acc':>7} " + " ".join(f"{results[c][1]:>12.4f}" for c in cols))
    for c, d in diffs.items():
        print(f"{c}: max relative difference from single over all steps {d:.2e}")


if __name__ == "__main__":
    sys.exit(main())

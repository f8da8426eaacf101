"""A 2-layer ReLU MLP (16 -> 64 -> 16, MSE), data parallel: weights replicated, batch split.

    mpiexec -n 2 python -m mpi4py examples/chapter_data_parallel.py
    mpiexec -n 4 python -m mpi4py examples/chapter_data_parallel.py

The layout is `dp=N` with N the world size. Every rank loads the full checkpoint (from
`model.init`), keeps a full copy of the weights, and is fed BATCH / N rows of each global batch
(`engine.shard_batch`). Each rank computes the gradient of the mean loss over its own rows;
`all_reduce(op='avg')` over the dp ranks turns those into the gradient of the mean loss over
the global batch, so every replica applies the same SGD step (w -= lr * g, by hand) and the
replicas stay identical.

The same steps run on `ms.SingleDevice` (every rank, on its own); the script exits non-zero
if the losses or the trained weights differ by more than 1e-9 relative. Rank 0 alone prints.
"""
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms

MODEL_DIM, HIDDEN_DIM, BATCH, STEPS, LR, RTOL = 16, 64, 32, 5, 0.1, 1e-9


def main():
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    model = ms.MLP(dims=[MODEL_DIM, HIDDEN_DIM, MODEL_DIM], activation="relu")
    params = model.init(seed=0)

    engine = ms.make_engine(model, f"dp={n}", dtype=np.float64)   # on every rank (SPMD)
    engine.load_checkpoint(params)
    reference = ms.SingleDevice(model)
    reference.load_checkpoint(params)

    rng = np.random.default_rng(0)            # the same global batch on every rank
    x = rng.standard_normal((BATCH, MODEL_DIM))
    t = np.sin(x)
    x_local, t_local = engine.shard_batch(x), engine.shard_batch(t)
    say(f"data parallel dp={n}: MLP {model.dims}, global batch {BATCH}, "
        f"{x_local.shape[0]} rows per rank, SGD lr {LR}")
    worst = 0.0
    for step in range(STEPS):
        loss, grads = engine.train_step(x_local, t_local, ms.losses.MSE())   # grads averaged
        for name, g in grads.items():
            engine.params[name] -= LR * g     # the same step on every replica
        want, ref_grads = reference.train_step(x, t, ms.losses.MSE())
        for name, g in ref_grads.items():
            reference.params[name] -= LR * g
        worst = max(worst, abs(loss - want) / abs(want))
        say(f"step {step}  loss {loss:.6f}  (single device {want:.6f})")
    for name, p in engine.gather_params().items():
        ref = reference.params[name]
        worst = max(worst, float(np.abs(p - ref).max() / np.abs(ref).max()))
    ok = worst <= RTOL
    say(f"all-reduce traffic per rank: {engine.comm_bytes['all_reduce']} bytes in "
        f"{engine.comm_calls['all_reduce']} calls")
    say(f"max relative difference from single device: {worst:.2e} "
        f"({'OK' if ok else 'FAIL'}, tolerance {RTOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

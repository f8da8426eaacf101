"""A 2-layer ReLU MLP (16 -> 64 -> 16, MSE), tensor parallel (Megatron): the hidden dim split.

    mpiexec -n 2 python -m mpi4py examples/chapter_tensor_parallel.py
    mpiexec -n 4 python -m mpi4py examples/chapter_tensor_parallel.py

The layout is `tp=N` with N the world size (HIDDEN_DIM must divide by N). With f = 64 / N,
each rank holds a column block of W0 (16, f) and b0 (f,), and the matching row block of W1
(f, 16); b1 is replicated. Every rank sees the whole batch:

    h_local = relu(x W0[:, block] + b0[block])    'bd,df->bf'   no communication
    y = all_reduce(h_local W1[block, :]) + b1     'bf,fd->bd'   one all-reduce forward

and in the backward dy is already replicated, so each rank's block gradients need no
communication at all (the first layer's input needs no gradient). The SGD step (w -= lr * g,
by hand) updates each rank's blocks in place.

The same steps run on `ms.SingleDevice` (every rank, on its own); the script exits non-zero
if the losses or the trained weights (gathered with `gather_params`) differ by more than 1e-9
relative. Rank 0 alone prints.
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

    engine = ms.make_engine(model, f"tp={n}", dtype=np.float64)   # raises if 64 % n != 0
    engine.load_checkpoint(params)            # every rank passes the full dict, keeps a block
    reference = ms.SingleDevice(model)
    reference.load_checkpoint(params)

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, MODEL_DIM))
    t = np.sin(x)
    blocks = ", ".join(f"{k} {tuple(v.shape)}" for k, v in engine.params.items())
    say(f"tensor parallel tp={n}: MLP {model.dims}; rank 0 holds {blocks}")
    worst = 0.0
    for step in range(STEPS):
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                        ms.losses.MSE())
        for name, g in grads.items():
            engine.params[name] -= LR * g     # each rank updates its own blocks
        want, ref_grads = reference.train_step(x, t, ms.losses.MSE())
        for name, g in ref_grads.items():
            reference.params[name] -= LR * g
        worst = max(worst, abs(loss - want) / abs(want))
        say(f"step {step}  loss {loss:.6f}  (single device {want:.6f})")
    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    y_ref = reference.predict(x)
    worst = max(worst, float(np.abs(y - y_ref).max() / np.abs(y_ref).max()))
    for name, p in engine.gather_params().items():
        ref = reference.params[name]
        worst = max(worst, float(np.abs(p - ref).max() / np.abs(ref).max()))
    ok = worst <= RTOL
    say(f"all-reduce calls per rank: {engine.comm_calls['all_reduce']} "
        f"({STEPS} training steps + 1 predict: one each)")
    say(f"max relative difference from single device: {worst:.2e} "
        f"({'OK' if ok else 'FAIL'}, tolerance {RTOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""A 2-layer ReLU MLP on one device, checked against the same model written out in numpy.

    mpiexec -n 1 python -m mpi4py examples/chapter_single.py
    python examples/chapter_single.py                      # the same, without mpiexec

The model is y = relu(x W0 + b0) W1 + b1 with model_dim -> hidden_dim -> model_dim
(16 -> 64 -> 16 here), trained with the mean squared error. This script trains it for a few
steps of plain SGD (w -= lr * g, by hand: there is no optimizer here) twice:

- with `ms.SingleDevice`, the reference engine every strategy is tested against, and
- with its forward and backward written out in numpy, line by line (`chapter_train_step`),

and exits non-zero if the two disagree by more than 1e-9 relative. Under mpiexec with more
than one rank every rank runs its own copy and rank 0 alone prints.
"""
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms

MODEL_DIM, HIDDEN_DIM, BATCH, STEPS, LR, RTOL = 16, 64, 32, 5, 0.1, 1e-9


def chapter_train_step(p, x, t):
    """(loss, gradients) of relu(x W0 + b0) W1 + b1 under the MSE loss, in plain numpy."""
    z = x @ p["layer_0/weights"] + p["layer_0/bias"]      # 'bd,df->bf'
    h = np.maximum(z, 0.0)                                # relu
    y = h @ p["layer_1/weights"] + p["layer_1/bias"]      # 'bf,fd->bd'
    loss = np.mean((y - t) ** 2)
    dy = 2.0 * (y - t) / y.size                           # d mean((y - t)^2) / dy
    grads = {"layer_1/weights": h.T @ dy, "layer_1/bias": dy.sum(axis=0)}
    dh = dy @ p["layer_1/weights"].T                      # undoes h @ W1
    dz = dh * (z > 0)                                     # undoes relu
    grads["layer_0/weights"] = x.T @ dz                   # undoes x @ W0
    grads["layer_0/bias"] = dz.sum(axis=0)
    return loss, grads


def main():
    rank = MPI.COMM_WORLD.Get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)
    model = ms.MLP(dims=[MODEL_DIM, HIDDEN_DIM, MODEL_DIM], activation="relu")
    params = model.init(seed=0)

    engine = ms.SingleDevice(model)           # one device: this rank alone (COMM_SELF)
    engine.load_checkpoint(params)
    by_hand = {k: v.copy() for k, v in params.items()}

    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, MODEL_DIM))
    t = np.sin(x)                             # a smooth target the model can fit
    say(f"single device: MLP {model.dims}, batch {BATCH}, SGD lr {LR}")
    worst = 0.0
    for step in range(STEPS):
        loss, grads = engine.train_step(x, t, ms.losses.MSE())
        for name, g in grads.items():
            engine.params[name] -= LR * g     # SGD by hand on the engine's own arrays
        want, want_grads = chapter_train_step(by_hand, x, t)
        for name, g in want_grads.items():
            by_hand[name] -= LR * g
        worst = max(worst, abs(loss - want) / abs(want))
        say(f"step {step}  loss {loss:.6f}  (numpy by hand {want:.6f})")
    for name, p in engine.gather_params().items():
        rel = float(np.abs(p - by_hand[name]).max() / np.abs(by_hand[name]).max())
        worst = max(worst, rel)
    ok = worst <= RTOL
    say(f"max relative difference from the chapter's numpy: {worst:.2e} "
        f"({'OK' if ok else 'FAIL'}, tolerance {RTOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

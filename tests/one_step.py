"""A float64 `train_step` of a model on one rank, repeatable: for tests that compare two
code paths (kernels on and off) on the same parameters and batch."""
import numpy as np
from mpi4py import MPI

import mpishard as ms


def stepper(model, x, t, seed=0):
    """A function running one float64 `train_step` of `model` (its init(seed) parameters,
    layout single, cross entropy) on (x, t): (loss, {name: gradient copy})."""
    params = model.init(seed=seed)

    def step():
        engine = ms.make_engine(model, "single", dtype=np.float64, comm=MPI.COMM_SELF)
        engine.load_checkpoint(params)
        loss, grads = engine.train_step(x, t, ms.losses.CrossEntropy())
        return loss, {n: g.copy() for n, g in grads.items()}
    return step

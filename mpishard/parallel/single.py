"""The chapter's SingleDevice, generalised to any depth: the one-device reference.

Every other layout is tested against this engine. It is the composition with no mesh axis:
plain `Linear` + `Activation` layers run in order, gradients need no communication.

    engine = ms.SingleDevice(ms.MLP([784, 512, 10]))
    engine.load_checkpoint(params)
    y = engine.forward(x)          # 'bd,df->bf' per layer
    grads = engine.backward(dy)    # {'layer_0/weights': ..., ...}
"""
from __future__ import annotations

import numpy as np
from mpi4py import MPI

from .compose import MeshEngine


class SingleDevice(MeshEngine):
    """One device holds everything (runs on COMM_SELF unless a comm of size 1 is given)."""

    def __init__(self, model, dtype=np.float64, comm=None, device="cpu", debug=None):
        super().__init__(model, "single", comm=MPI.COMM_SELF if comm is None else comm,
                         dtype=dtype, device=device, debug=debug)

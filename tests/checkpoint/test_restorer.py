"""Exact resume (`ms.checkpoint.restore`) in every order a user can build engine, optimizer
and restore, for SGD with momentum and AdamW, on the same layout and onto another (resharding).

    mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -m mpi tests/checkpoint/test_restorer.py

A run of STEPS steps is cut after CUT, saved, and resumed; the resumed losses and parameters
must be those of the uninterrupted run: bit for bit on the same layout, to 1e-12 across layouts
(float64; a layout sums its gradients in another order).
"""
import os
import shutil
import tempfile

import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint import CheckpointError
from mpishard.train.optim import SGD, AdamW

from conftest import assert_close, assert_dicts_close, group_comm

DIMS = [5, 8, 3]            # fsdp=2 pads W0's 5 rows and the 3-wide bias: padding is restored
STEPS, CUT, BATCH = 7, 3, 8
OPTIMIZERS = {"sgd": lambda e: SGD(e, lr=0.05, momentum=0.9, weight_decay=0.01),
              "adamw": lambda e: AdamW(e, lr=0.02, weight_decay=0.05)}
# (saved under, resumed under): each layout onto itself, and onto others (resharding)
PAIRS = [("single", "single"), ("dp=2", "dp=2"), ("fsdp=2", "fsdp=2"),
         ("fsdp=2,zero=1", "fsdp=2,zero=1"), ("dp=2", "fsdp=2"), ("fsdp=2", "single"),
         ("single", "fsdp=2,zero=1"), ("fsdp=2,zero=1", "dp=2")]


def batches():
    rng = np.random.default_rng(3)
    return [(rng.standard_normal((BATCH, DIMS[0])), rng.standard_normal((BATCH, DIMS[-1])))
            for _ in range(STEPS)]


def engine(layout, comm, loaded=True):
    model = ms.MLP(DIMS, activation="tanh")
    e = ms.SingleDevice(model) if layout == "single" else ms.make_engine(model, layout,
                                                                         comm=comm)
    if loaded:
        e.load_checkpoint(model.init(seed=5))
    return e


def train(e, opt, data):
    """Losses of `opt.step` after a train_step on each (x, t) of `data`, clipped."""
    losses = []
    for x, t in data:
        loss, grads = e.train_step(e.shard_batch(x), e.shard_batch(t), "mse")
        ms.optim.clip_grad_norm(e, grads, max_norm=0.5)
        opt.step(grads)
        losses.append(loss)
    return losses


def host_params(e):
    return {k: np.array(v) for k, v in e.gather_params().items()}


def resumed(order, path, layout, comm, make):
    """(engine, optimizer) restored from `path` in the order `order`."""
    if order == "optimizer first":            # the order: a fresh engine
        e = engine(layout, comm, loaded=False)
        opt = make(e)
        assert ms.checkpoint.restore(path, e, opt) == CUT
    elif order == "optimizer first, engine loaded":
        e = engine(layout, comm)
        opt = make(e)
        assert ms.checkpoint.restore(path, e, opt) == CUT
    elif order == "optimizer after":          # restore, then build the optimizer
        e = engine(layout, comm, loaded=False)
        assert ms.checkpoint.restore(path, e) == CUT
        opt = make(e)
    elif order == "optimizer first, not passed":
        e = engine(layout, comm, loaded=False)
        opt = make(e)
        assert ms.checkpoint.restore(path, e) == CUT
    return e, opt


ORDERS = ["optimizer first", "optimizer first, engine loaded", "optimizer after",
          "optimizer first, not passed"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
@pytest.mark.parametrize("saved, restored", PAIRS, ids=[f"{a}->{b}" for a, b in PAIRS])
def test_resume_continues_exactly_in_every_order(kind, saved, restored):
    comm = group_comm(2)
    rank, make, data = comm.Get_rank(), OPTIMIZERS[kind], batches()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="mpishard-restore-") if rank == 0 else None)
    # a single-device save runs on each rank alone: each writes its own (identical) copy
    path = os.path.join(tmp, f"ckpt-{rank}" if saved == "single" else "ckpt")
    read = os.path.join(tmp, "ckpt-0" if saved == "single" else "ckpt")

    e = engine(saved, comm)
    want = train(e, make(e), data)                         # the uninterrupted run
    p_want = host_params(e)
    e = engine(saved, comm)
    opt = make(e)
    assert train(e, opt, data[:CUT]) == want[:CUT]
    ms.checkpoint.save(path, e, opt, step=CUT)
    comm.Barrier()

    rtol = 0.0 if saved == restored else 1e-12
    for order in ORDERS:
        e, opt = resumed(order, read, restored, comm, make)
        assert opt.state, f"{order}: the optimizer state was not restored"
        got = train(e, opt, data[CUT:])
        assert_close(got, want[CUT:], rtol=rtol, what=f"{kind} {saved}->{restored} {order} loss")
        assert_dicts_close(host_params(e), p_want, rtol=rtol,
                           what=f"{kind} {saved}->{restored} {order} params")
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(tmp)


@pytest.mark.mpi(min_size=2)
def test_state_kept_for_the_next_optimizer_must_match_its_type():
    """restore(path, engine) keeps the checkpoint's AdamW state for the engine's next
    optimizer; an SGD built instead is refused with what to do, and an engine loaded again
    with other weights forgets the kept state."""
    comm = group_comm(2)
    rank = comm.Get_rank()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="mpishard-restore-") if rank == 0 else None)
    path = os.path.join(tmp, "ckpt")
    e = engine("dp=2", comm)
    opt = OPTIMIZERS["adamw"](e)
    train(e, opt, batches()[:CUT])
    ms.checkpoint.save(path, e, opt, step=CUT)

    e = engine("fsdp=2", comm, loaded=False)
    ms.checkpoint.restore(path, e)
    with pytest.raises(ValueError, match="holds AdamW state.*build an AdamW"):
        OPTIMIZERS["sgd"](e)
    assert OPTIMIZERS["adamw"](e).state            # the refusal kept it for the right type

    e = engine("fsdp=2", comm, loaded=False)
    ms.checkpoint.restore(path, e)
    e.load_checkpoint(e.model.init(seed=1))        # other weights: the kept state is dropped
    assert OPTIMIZERS["adamw"](e).state == {}

    e = engine("fsdp=2", comm, loaded=False)       # an optimizer of another type, passed
    with pytest.raises(CheckpointError, match="holds AdamW state, the optimizer is SGD"):
        ms.checkpoint.restore(path, e, OPTIMIZERS["sgd"](e))
    assert not e.loaded                            # refused before the engine was touched
    comm.Barrier()
    if rank == 0:
        shutil.rmtree(tmp)

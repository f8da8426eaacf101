"""Peers: our train step against PyTorch CPU on the same MLP, batch, dtype and threads.

    python benchmarks/peers_torch.py single [--quick] [--json out.json]
    mpiexec -n 2 python -m mpi4py benchmarks/peers_torch.py ours-dp2 [--quick] [--json ...]
    python benchmarks/peers_torch.py torch-ddp2 [--quick] [--json ...]

single      in one process, alternating sample by sample: our single-rank step
            (engine.train_step + ms.optim.SGD.step) against torch's nn.Linear/ReLU stack +
            autograd + torch.optim.SGD.step, both float32, one thread (torch.set_num_threads(1)
            and OMP_NUM_THREADS=1 for numpy's BLAS). Both start from the same weights; the
            losses of the first steps are compared (`max_loss_rel_diff`) so we know both do
            the same work.
ours-dp2    our layout dp=2 (2 MPI ranks, half the batch each; `--layout` picks options such
            as overlap=1).
torch-ddp2  torch DistributedDataParallel with gloo on 2 processes started with
            torch.multiprocessing (MASTER_ADDR=127.0.0.1, a free port), half the batch each.

The time of a sample is the slowest rank's; figures are medians after a warm-up. run_all.py
divides ours by torch's. Without torch installed every mode prints a skip message and
writes {"skipped": reason}.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys

import numpy as np

from _common import median_times, mpi_sync, write_json

DIMS = [1024, 2048, 2048, 1024]
BATCH = 512
QUICK_DIMS, QUICK_BATCH = [256, 512, 512, 256], 128
TINY_DIMS, TINY_BATCH = [16, 32, 16], 16
LR = 1e-3


def torch_or_none():
    try:
        import torch

        return torch
    except ImportError:
        return None


def problem(dims, batch, seed=0):
    """The shared model and data: (ms.MLP, params float64, x, t) as float32 arrays."""
    import mpishard as ms

    model = ms.MLP(dims, activation="relu")
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, dims[0])).astype(np.float32)
    t = rng.standard_normal((batch, dims[-1])).astype(np.float32)
    return model, model.init(seed=seed), x, t


# -- ours ----------------------------------------------------------------------------------------
def our_step(dims, batch, layout="single", comm=None):
    """A closure running one of our train steps + SGD update, and the engine."""
    import mpishard as ms

    model, params, x, t = problem(dims, batch)
    if layout == "single":
        from mpi4py import MPI

        engine = ms.make_engine(model, "single", dtype=np.float32, comm=MPI.COMM_SELF)
    else:
        engine = ms.make_engine(model, layout, dtype=np.float32, comm=comm)
    engine.load_checkpoint(params)
    opt = ms.optim.SGD(engine, lr=LR)
    xl, tl = engine.shard_batch(x), engine.shard_batch(t)
    loss_fn = ms.losses.MSE()
    losses = []

    def step():
        loss, grads = engine.train_step(xl, tl, loss_fn)
        opt.step(grads)
        losses.append(loss)
    return step, losses, engine


# -- torch ---------------------------------------------------------------------------------------
def torch_model(torch, dims, params):
    layers = []
    for i in range(len(dims) - 1):
        lin = torch.nn.Linear(dims[i], dims[i + 1])
        with torch.no_grad():                          # ours is (in, out), torch's (out, in)
            lin.weight.copy_(torch.from_numpy(params[f"layer_{i}/weights"].T.copy()))
            lin.bias.copy_(torch.from_numpy(params[f"layer_{i}/bias"]))
        layers.append(lin)
        if i < len(dims) - 2:
            layers.append(torch.nn.ReLU())
    return torch.nn.Sequential(*layers).float()


def torch_step(torch, model, x, t):
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    xt, tt = torch.from_numpy(x), torch.from_numpy(t)
    losses = []

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xt), tt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return step, losses


def run_single(dims, batch, samples):
    torch = torch_or_none()
    if torch is None:
        return {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    torch.set_num_threads(1)
    ours, our_losses, _ = our_step(dims, batch)
    _, params, x, t = problem(dims, batch)
    theirs, their_losses = torch_step(torch, torch_model(torch, dims, params), x, t)
    t_ours, t_torch = median_times([ours, theirs], samples)
    k = min(len(our_losses), len(their_losses))
    rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(our_losses[:k], their_losses[:k]))
    return {"dims": dims, "batch": batch, "dtype": "float32", "threads": 1,
            "torch_version": torch.__version__, "ours_s": t_ours, "torch_s": t_torch,
            "ratio": t_ours / t_torch, "max_loss_rel_diff": rel}


def run_ours_dp2(dims, batch, samples, layout):
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    step, losses, engine = our_step(dims, batch, layout, comm)
    (t,) = median_times([step], samples, sync=mpi_sync(comm))
    return {"dims": dims, "batch": batch, "layout": layout, "ranks": comm.Get_size(),
            "ours_s": t, "first_loss": losses[0],
            "bucket_plan": engine.grad_sync.describe()}


def _ddp_worker(rank, world, port, dims, batch, samples, queue):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    _, params, x, t = problem(dims, batch)
    rows = batch // world
    model = torch.nn.parallel.DistributedDataParallel(torch_model(torch, dims, params))
    step, losses = torch_step(torch, model, x[rank * rows:(rank + 1) * rows],
                              t[rank * rows:(rank + 1) * rows])

    def sync(dt):
        if dt is None:
            dist.barrier()
            return None
        v = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(v, op=dist.ReduceOp.MAX)
        return float(v[0])
    (tm,) = median_times([step], samples, sync=sync)
    if rank == 0:
        queue.put({"torch_s": tm, "first_loss": losses[0]})
    dist.destroy_process_group()


def run_torch_ddp2(dims, batch, samples):
    torch = torch_or_none()
    if torch is None:
        return {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    import torch.multiprocessing as mp

    with socket.socket() as s:            # a free local port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_ddp_worker, args=(2, port, dims, batch, samples, queue), nprocs=2, join=True)
    res = queue.get(timeout=60)
    res.update(dims=dims, batch=batch, ranks=2, backend="gloo", threads_per_rank=1,
               torch_version=torch.__version__)
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["single", "ours-dp2", "torch-ddp2"])
    p.add_argument("--quick", action="store_true", help="smaller MLP, fewer samples")
    p.add_argument("--tiny", action="store_true", help="a toy size for the smoke test")
    p.add_argument("--layout", default="dp=2", help="ours-dp2: the layout (options allowed)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dims, batch = (TINY_DIMS, TINY_BATCH) if args.tiny else \
        (QUICK_DIMS, QUICK_BATCH) if args.quick else (DIMS, BATCH)
    samples = 3 if args.tiny else 5 if args.quick else 9
    if args.mode == "single":
        res = run_single(dims, batch, samples)
    elif args.mode == "ours-dp2":
        res = run_ours_dp2(dims, batch, samples, args.layout)
    else:
        res = run_torch_ddp2(dims, batch, samples)
    rank = 0
    if args.mode == "ours-dp2":
        from mpi4py import MPI

        rank = MPI.COMM_WORLD.Get_rank()
    if rank == 0:
        if "skipped" in res:
            print(f"skipped: {res['skipped']}")
        else:
            print(json.dumps({k: v for k, v in res.items() if k != "bucket_plan"}))
        write_json(args.json, res)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

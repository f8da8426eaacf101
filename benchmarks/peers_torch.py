"""Peers: our train step against PyTorch CPU on the same model, batch, dtype and threads.

    python benchmarks/peers_torch.py single [--quick] [--json out.json]
    mpiexec -n 2 python -m mpi4py benchmarks/peers_torch.py ours-dp2 [--quick] [--json ...]
    python benchmarks/peers_torch.py torch-ddp2 [--quick] [--json ...]
    mpiexec -n 2 python -m mpi4py benchmarks/peers_torch.py gpt2 [--tiny] [--json ...]

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
gpt2        gpt.py's GPT at 2 ranks, one mpiexec job: torch.distributed (gloo, env://
            rendezvous on 127.0.0.1) runs on the same MPI ranks, and per peer our layout and
            torch's run a full step (forward, cross-entropy, backward, AdamW) with the same
            weights, global batch, float32 and one thread per rank, all six sides alternated
            sample by sample: dp=2,overlap=1 vs DistributedDataParallel, fsdp=2 vs FSDP2
            (`fully_shard` per block and the root, resharding after forward like ours), tp=2
            vs DTensor tensor parallel (`parallelize_module`: qkv and fc ColwiseParallel, the
            two output projections RowwiseParallel, qkv stored per head group so a rank holds
            whole heads, as ours does; torch's embedding and head stay replicated where ours
            are vocab-parallel). Before timing, each torch peer's gathered gradients and the
            first 3 steps' losses of both sides are compared with torch in one process on the
            whole batch; a difference past float32 rounding raises instead of timing.

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

from _common import median_times, mpi_sync, sample_times, write_json

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


def _free_port() -> int:
    """A free local port for torch's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torch_ddp2(dims, batch, samples):
    torch = torch_or_none()
    if torch is None:
        return {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    import torch.multiprocessing as mp

    port = _free_port()
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    mp.spawn(_ddp_worker, args=(2, port, dims, batch, samples, queue), nprocs=2, join=True)
    res = queue.get(timeout=60)
    res.update(dims=dims, batch=batch, ranks=2, backend="gloo", threads_per_rank=1,
               torch_version=torch.__version__)
    return res


# -- GPT at 2 ranks: ours against PyTorch's distributed peers, alternated in one job ------------
GPT_PEERS = {  # peer: (our layout, what torch runs)
    "ddp": ("dp=2,overlap=1", "DistributedDataParallel"),
    "fsdp": ("fsdp=2", "fully_shard (FSDP2) per block and the root"),
    "tp": ("tp=2", "parallelize_module: qkv, fc ColwiseParallel; proj, mlp_proj RowwiseParallel"),
    # no communication: each rank's step alone on its rows, the compute under dp and fsdp
    "local": ("single", "the module alone on this rank's rows"),
}
GPT_LR = 1e-4
CHECKED_STEPS = 3        # the first steps' losses compared against torch in one process
LOSS_RTOL, GRAD_RTOL = 1e-5, 1e-4     # float32: a peer further off trains something else


def init_torch_distributed(torch, comm):
    """A gloo process group over the MPI ranks (env:// rendezvous on 127.0.0.1, rank 0's free
    port broadcast) and its 1-D CPU device mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(comm.bcast(_free_port() if comm.Get_rank() == 0 else None))
    dist.init_process_group("gloo", init_method="env://", rank=comm.Get_rank(),
                            world_size=comm.Get_size())
    return init_device_mesh("cpu", (comm.Get_size(),))


def torch_gpt_peer(torch, peer, model, params, mesh):
    """gpt.py's torch GPT with our weights, wrapped as torch's `peer` on `mesh`."""
    import gpt

    world = mesh.size()
    net, _ = gpt.torch_gpt(torch, model, params, qkv_groups=world if peer == "tp" else 1)
    if peer == "local":
        return net
    if peer == "ddp":
        return torch.nn.parallel.DistributedDataParallel(net)
    if peer == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for block in net.blocks:
            fully_shard(block, mesh=mesh)
        return fully_shard(net, mesh=mesh)
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)

    plan = {"qkv": ColwiseParallel(), "fc": ColwiseParallel(), "proj": RowwiseParallel(),
            "mlp_proj": RowwiseParallel()}
    for block in net.blocks:
        parallelize_module(block, mesh, plan)
    return net


def _rows(peer, a, rank, world):
    """This rank's share of the global batch: dp, fsdp and local split the rows, tp sees
    them all."""
    if peer == "tp":
        return a
    n = a.shape[0] // world
    return a[rank * n:(rank + 1) * n]


def torch_train_step(torch, net, vocab, x, t):
    """A closure running torch's full step (zero_grad, forward, cross-entropy, backward,
    AdamW.step) and the list of its losses (this rank's)."""
    opt = torch.optim.AdamW(net.parameters(), lr=GPT_LR)
    xt, tt = torch.from_numpy(x), torch.from_numpy(t).reshape(-1)
    losses = []

    def step():
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(net(xt).reshape(-1, vocab), tt)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return step, losses


def our_train_step(model, params, layout, comm, x, t):
    """Our full step (engine.train_step + ms.optim.AdamW.step) and its losses (global; on
    `x`'s rows alone under layout 'single', which runs on COMM_SELF)."""
    import mpishard as ms
    from mpi4py import MPI

    comm = MPI.COMM_SELF if layout == "single" else comm
    engine = ms.make_engine(model, layout, dtype=np.float32, comm=comm)
    engine.load_checkpoint(params)
    opt = ms.optim.AdamW(engine, lr=GPT_LR)
    xl, tl, loss_fn = engine.shard_batch(x), engine.shard_batch(t), ms.losses.CrossEntropy()
    losses = []

    def step():
        loss, grads = engine.train_step(xl, tl, loss_fn)
        opt.step(grads)
        losses.append(loss)
    return step, losses


def full_grads(torch, net, world) -> dict:
    """Every parameter's whole gradient in our names' torch form (DDP's 'module.' prefix
    dropped, DTensor shards gathered, tp's blocked qkv put back in q | k | v order)."""
    import gpt
    from torch.distributed.tensor import DTensor

    out = {}
    for name, p in net.named_parameters():
        g = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        g = g.detach().numpy()
        name = name.removeprefix("module.")
        if ".qkv." in name and world > 1:       # (3D, D) / (3D,): blocked along dim 0
            g = gpt.qkv_unblocked(g.T, world).T if g.ndim == 2 else gpt.qkv_unblocked(g, world)
        out[name] = g
    return out


def check_torch_peer(torch, peer, model, params, mesh, x, t, want_grads) -> float:
    """Max over parameters of max |grad - single's| / max |single's| after one forward and
    backward of torch's `peer` on the global batch (its shards averaged as the peer does)."""
    rank, world = mesh.get_rank(), mesh.size()
    net = torch_gpt_peer(torch, peer, model, params, mesh)
    xt = torch.from_numpy(_rows(peer, x, rank, world))
    tt = torch.from_numpy(_rows(peer, t, rank, world)).reshape(-1)
    torch.nn.functional.cross_entropy(net(xt).reshape(-1, model.vocab_size), tt).backward()
    got = full_grads(torch, net, world if peer == "tp" else 1)
    assert set(got) == set(want_grads), sorted(set(got) ^ set(want_grads))
    return max(float(np.abs(got[k] - w).max() / np.abs(w).max()) for k, w in want_grads.items())


def run_gpt_peers(size, samples, warmup=CHECKED_STEPS):
    """Under mpiexec -n 2: for each of GPT_PEERS, our layout's step and torch's, every side
    alternated sample by sample (each sample's time the slowest rank's). Before timing each
    distributed torch peer's gradients are checked against torch in one process; the first
    CHECKED_STEPS losses of every side (local: the first) against torch in one process's
    AdamW steps."""
    import gpt
    from mpi4py import MPI

    torch = torch_or_none()
    if torch is None:
        return {"skipped": "torch is not installed (pip install -e '.[bench]')"}
    torch.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    model, params, x, t = gpt.problem(size)
    mesh = init_torch_distributed(torch, comm)
    ref, _ = gpt.torch_gpt(torch, model, params)          # torch in one process, whole batch
    ref_step, ref_losses = torch_train_step(torch, ref, model.vocab_size, x, t)
    ref_step()
    want_grads = {k: p.grad.detach().numpy().copy() for k, p in ref.named_parameters()}
    for _ in range(CHECKED_STEPS - 1):
        ref_step()
    fns, losses, grad_diff = [], {}, {}
    for peer, (layout, _) in GPT_PEERS.items():
        if peer != "local":           # local: each rank's gradients are of its rows alone
            grad_diff[peer] = check_torch_peer(torch, peer, model, params, mesh, x, t,
                                               want_grads)
        xs, ts = (x, t) if peer != "local" else (_rows(peer, x, rank, world),
                                                 _rows(peer, t, rank, world))
        ours, losses[("ours", peer)] = our_train_step(model, params, layout, comm, xs, ts)
        net = torch_gpt_peer(torch, peer, model, params, mesh)
        theirs, losses[("torch", peer)] = torch_train_step(
            torch, net, model.vocab_size, _rows(peer, x, rank, world), _rows(peer, t, rank, world))
        fns += [ours, theirs]
    times = sample_times(fns, samples, warmup=warmup, sync=mpi_sync(comm))
    import torch.distributed as dist

    dist.destroy_process_group()
    res = {"model": dict(size), "ranks": world, "dtype": "float32", "threads_per_rank": 1,
           "backend": "gloo", "torch_version": torch.__version__, "samples": samples,
           "optimizer": f"AdamW(lr={GPT_LR})", "single_torch_losses": ref_losses, "peers": {}}
    for i, (peer, (layout, api)) in enumerate(GPT_PEERS.items()):
        ours_t, theirs_t = times[2 * i], times[2 * i + 1]
        # the global loss: each rank's on its rows (equal counts) averaged, or the same on
        # every rank; local: its ranks part after the first step (each updates on its rows)
        checked = 1 if peer == "local" else CHECKED_STEPS
        diffs = {side: max(abs(comm.allreduce(a) / world - b) / abs(b)
                           for a, b in zip(losses[(side, peer)][:checked], ref_losses))
                 for side in ("ours", "torch")}
        ours_s, torch_s = float(np.median(ours_t)), float(np.median(theirs_t))
        res["peers"][peer] = {
            "layout": layout, "torch": api, "ours_s": ours_s, "torch_s": torch_s,
            "ratio": ours_s / torch_s,
            "ratio_paired": float(np.median(np.asarray(ours_t) / np.asarray(theirs_t))),
            "ours_loss_rel_diff": diffs["ours"], "torch_loss_rel_diff": diffs["torch"],
            "torch_max_grad_rel_diff": grad_diff.get(peer)}
        if max(diffs.values()) > LOSS_RTOL or grad_diff.get(peer, 0.0) > GRAD_RTOL:
            raise RuntimeError(f"{peer}: the two sides do not train the same model: "
                               f"{res['peers'][peer]}")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["single", "ours-dp2", "torch-ddp2", "gpt2"])
    p.add_argument("--quick", action="store_true", help="smaller MLP, fewer samples")
    p.add_argument("--tiny", action="store_true", help="a toy size for the smoke test")
    p.add_argument("--layout", default="dp=2", help="ours-dp2: the layout (options allowed)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    dims, batch = (TINY_DIMS, TINY_BATCH) if args.tiny else \
        (QUICK_DIMS, QUICK_BATCH) if args.quick else (DIMS, BATCH)
    samples = 3 if args.tiny else 5 if args.quick else 9
    if args.mode == "gpt2":
        import gpt

        res = run_gpt_peers(gpt.SIZES["tiny" if args.tiny else "full"], samples)
    elif args.mode == "single":
        res = run_single(dims, batch, samples)
    elif args.mode == "ours-dp2":
        res = run_ours_dp2(dims, batch, samples, args.layout)
    else:
        res = run_torch_ddp2(dims, batch, samples)
    rank = 0
    if args.mode in ("ours-dp2", "gpt2"):
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

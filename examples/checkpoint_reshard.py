"""Save a sharded checkpoint under one layout, resume it under others, export safetensors.

    mpiexec -n 4 python -m mpi4py examples/checkpoint_reshard.py
    mpiexec -n 4 python -m mpi4py examples/checkpoint_reshard.py --out ckpts --steps 20

On 4 ranks: train an MLP for `--steps` steps of clipped AdamW under dp=2,tp=2, saving a
checkpoint (parameters + AdamW state) half way. Then resume it under dp=2,tp=2, pp=2 and tp=2
(pairs of ranks), fsdp=4 and single (each rank alone), finish the run there, and compare with
the uninterrupted run: the parameters right after loading are equal bit for bit, and the
finished loss curve matches (bit for bit on the same layout, float64 1e-9 elsewhere). Rank 0
prints one row per layout, the checkpoint as `python -m mpishard inspect` shows it, and writes
`model.safetensors` (one consolidated file, PyTorch names with --torch-names) into --out
(default: a temporary directory, removed at the end). The job exits
with status 1 if any comparison fails.
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.train.optim import AdamW, clip_grad_norm

RTOL = 1e-9


def make(layout, comm, dims, lr):
    model = ms.MLP(dims, activation="tanh")
    e = ms.SingleDevice(model) if layout == "single" else ms.make_engine(model, layout, comm=comm)
    e.load_checkpoint(model.init(seed=0))
    return e, AdamW(e, lr=lr, weight_decay=0.01)


def run(engine, opt, batches, start, stop):
    """Steps start..stop-1 on their batches (the data position is the step); the losses."""
    losses = []
    for step in range(start, stop):
        x, t = batches[step]
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                        ms.losses.MSE())
        clip_grad_norm(engine, grads, max_norm=1.0)
        opt.step(grads)
        losses.append(loss)
    return losses


def host(engine):
    return {k: np.array(engine.backend.to_host(v)) for k, v in engine.gather_params().items()}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", help="directory for the checkpoints (default: a temporary one)")
    p.add_argument("--dims", default="12,16,16,4")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--lr", type=float, default=0.01)
    p.add_argument("--torch-names", action="store_true", help="safetensors with nn.Sequential "
                   "names ('0.weight', (out, in))")
    args = p.parse_args()
    world = MPI.COMM_WORLD
    rank = world.Get_rank()
    if world.Get_size() != 4:
        raise SystemExit("run on 4 ranks: mpiexec -n 4 python -m mpi4py "
                         "examples/checkpoint_reshard.py")
    dims = [int(d) for d in args.dims.split(",")]
    out = args.out or world.bcast(tempfile.mkdtemp(prefix="mpishard-") if rank == 0 else None)
    os.makedirs(out, exist_ok=True)
    path, cut = os.path.join(out, "checkpoint"), args.steps // 2
    rng = np.random.default_rng(1)
    batches = [(rng.standard_normal((16, dims[0])), rng.standard_normal((16, dims[-1])))
               for _ in range(args.steps)]

    # the uninterrupted run, and the one that saves half way
    e, opt = make("dp=2,tp=2", world, dims, args.lr)
    whole = run(e, opt, batches, 0, args.steps)
    final = host(e)
    e, opt = make("dp=2,tp=2", world, dims, args.lr)
    first = run(e, opt, batches, 0, cut)
    at_cut = host(e)
    ms.checkpoint.save(path, e, opt, step=cut, extra={"losses": first})

    pairs = world.Split(rank // 2, rank)
    rows, ok = [], True
    for layout, comm in [("dp=2,tp=2", world), ("pp=2", pairs), ("tp=2", pairs),
                         ("fsdp=4", world), ("single", None)]:
        e, opt = make(layout, comm, dims, args.lr)
        step = ms.checkpoint.restore(path, e, opt)
        loaded = host(e)
        bitwise = all(np.array_equal(loaded[k], at_cut[k]) for k in at_cut)
        losses = ms.checkpoint.load(path).extra["losses"] + run(e, opt, batches, step,
                                                                  args.steps)
        got = host(e)
        d_loss = float(np.max(np.abs(np.subtract(losses, whole))))
        d_par = max(float(np.max(np.abs(got[k] - final[k]))) for k in final)
        tol = 0.0 if layout == "dp=2,tp=2" else RTOL
        scale = max(float(np.max(np.abs(v))) for v in final.values())
        good = bitwise and d_loss <= tol * max(whole) and d_par <= tol * scale
        ok &= good
        n = 1 if comm is None else comm.Get_size()
        rows.append(f"{layout:<10} {n:>5}  {'bit for bit' if bitwise else 'DIFFERENT':<12} "
                    f"{d_loss:>12.3e} {d_par:>12.3e}  {'ok' if good else 'FAIL'}")
    ok = world.allreduce(ok, op=MPI.LAND)

    if rank == 0:
        print(f"trained {dims} for {args.steps} steps under dp=2,tp=2, saved at step {cut}\n")
        print(f"{'resumed in':<10} {'ranks':>5}  {'params':<12} {'max dloss':>12} "
              f"{'max dparam':>12}")
        print("\n".join(rows))
        print()
        print(ms.checkpoint.describe(path))
        st = os.path.join(out, "model.safetensors")
        ms.checkpoint.export_safetensors(path, st, names="torch" if args.torch_names
                                         else "mpishard")
        print(f"\nwrote {st} ({os.path.getsize(st)} bytes)")
    world.Barrier()
    if args.out is None and rank == 0:
        shutil.rmtree(out)                         # a temporary directory: leave nothing
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

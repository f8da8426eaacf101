"""FSDP / ZeRO stages 1-3 next to plain data parallelism, checked against one device.

    mpiexec -n 4 python -m mpi4py examples/fsdp_train.py
    mpiexec -n 4 python -m mpi4py examples/fsdp_train.py --dims 784,512,256,10 --markdown

With N = the world size, the same MLP is trained for a few steps of clipped AdamW on a
synthetic regression batch under dp=N and fsdp=N with zero=1, 2 and 3, and (on every rank, on
its own) under `single`. Rank 0 prints the loss per step, then one row per layout: the bytes a
rank holds (engine.memory_report: parameters, gradients, AdamW state, the largest gathered
weight buffer) and the bytes it sent in the last step (engine.comm_bytes). The job exits with
status 1 if any layout's losses or final parameters differ from single's (float64, rtol 1e-9).
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
import mpishard.train.optim  # noqa: F401  (ms.optim)

RTOL = 1e-9


def train(engine, x, t, steps, lr):
    """`steps` steps of clipped AdamW; returns the losses, the optimizer and the bytes this
    rank sent in the last step."""
    opt = ms.optim.AdamW(engine, lr=lr, weight_decay=0.01)
    xl, tl = engine.shard_batch(x), engine.shard_batch(t)
    losses = []
    for _ in range(steps):
        engine.reset_comm_stats()
        loss, grads = engine.train_step(xl, tl, ms.losses.MSE())
        ms.optim.clip_grad_norm(engine, grads, max_norm=1.0)
        opt.step(grads)
        losses.append(loss)
    return losses, opt, sum(engine.comm_bytes.values())


def max_rel_diff(got: dict, want: dict) -> float:
    return max(float(np.abs(got[k] - want[k]).max()) / max(float(np.abs(want[k]).max()), 1e-300)
               for k in want)


def human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1024


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dims", default="64,96,48,10", help="MLP widths, comma separated")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=32, help="global batch (divisible by ranks)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    say = print if rank == 0 else (lambda *a, **k: None)

    model = ms.MLP([int(d) for d in args.dims.split(",")], activation="relu")
    params = model.init(seed=0)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((args.batch, model.d_in))
    t = rng.standard_normal((args.batch, model.d_out))

    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    ref_losses, _, _ = train(ref, x, t, args.steps, args.lr)
    ref_params = ref.gather_params()
    say(f"{model!r}, {model.num_params()} parameters, float64, {n} ranks, global batch "
        f"{args.batch}")
    say("single  loss per step: " + " ".join(f"{v:.6f}" for v in ref_losses))

    layouts = [f"dp={n}"] + [f"fsdp={n},zero={z}" for z in (1, 2, 3)]
    rows, ok = [], True
    for layout in layouts:
        engine = ms.make_engine(model, layout)
        engine.load_checkpoint(params)
        losses, opt, sent = train(engine, x, t, args.steps, args.lr)
        diff = max(max_rel_diff(engine.gather_params(), ref_params),
                   max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses)))
        ok &= diff <= RTOL
        say(f"{layout:<14} loss per step: " + " ".join(f"{v:.6f}" for v in losses)
            + f"   max rel diff vs single {diff:.1e}")
        rows.append((layout, engine.memory_report(opt), sent))

    header = ["layout", "params", "grads", "optimizer", "gathered peak", "activations peak",
              "total", "total vs dp", "sent per step"]
    dp_total = rows[0][1]["total"]
    table = [[layout, *(human(r[k]) for k in ("params", "grads", "optimizer", "gathered_peak",
                                              "activations_peak", "total")),
              f"{r['total'] / dp_total:.2f}", human(sent)] for layout, r, sent in rows]
    say(f"\nmemory per rank (rank 0), after {args.steps} steps:")
    if args.markdown:
        say("| " + " | ".join(header) + " |")
        say("|" + "|".join("---" for _ in header) + "|")
        for row in table:
            say("| " + " | ".join(row) + " |")
    else:
        widths = [max(len(str(c)) for c in col) for col in zip(header, *table)]
        for row in [header] + table:
            say("  ".join(str(c).rjust(w) for c, w in zip(row, widths)))

    all_ok = comm.allreduce(int(ok), op=MPI.MIN)      # small control data
    say("every layout matches single" if all_ok else "MISMATCH against single")
    return 0 if all_ok else 1


if __name__ == "__main__":
    sys.exit(main())

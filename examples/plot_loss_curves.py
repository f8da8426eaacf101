"""Training loss curves of several layouts on one PNG: they lie on top of each other.

    mpiexec -n 4 python -m mpi4py examples/plot_loss_curves.py --png loss_curves.png
    mpiexec -n 2 python -m mpi4py examples/plot_loss_curves.py --steps 40 --png curves.png

The same model, data, seed and optimizer (digits, 64 -> 128 -> 128 -> 64 -> 10, AdamW, cosine
schedule, clipping at 1.0) trained with `ms.trainer.Trainer` under `single` and each layout that
fits the world size: by default dp=N, tp=N, dp=2,tp=N/2, pp=N and fsdp=N (those that the
model or this build does not support are skipped with the reason). `single` runs on every rank's
COMM_SELF. Rank 0 prints each layout's largest relative departure from `single` and draws the
curves, with the single-device one underneath as a thick grey line.
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.train.data import load_dataset
from mpishard.train.lr import cosine_schedule
from mpishard.train.optim import AdamW
from mpishard.train.trainer import Trainer


def default_layouts(n):
    if n == 1:
        return []
    out = [f"dp={n}", f"tp={n}"]
    if n >= 4 and n % 2 == 0:
        out.append(f"dp=2,tp={n // 2}")
    return out + [f"pp={n}", f"fsdp={n}"]


def run(layout, args, data):
    model = ms.MLP(args.model, activation="relu")
    dtype = np.dtype(args.dtype)
    engine = ms.SingleDevice(model, dtype=dtype) if layout == "single" else \
        ms.make_engine(model, layout, dtype=dtype)
    engine.load_checkpoint(model.init(seed=args.seed))
    opt = AdamW(engine, lr=args.lr)
    trainer = Trainer(engine, opt, data, batch=args.batch, steps=args.steps, clip=1.0,
                      schedule=cosine_schedule(args.lr, args.steps, warmup_steps=args.steps // 10),
                      seed=args.seed, progress=False, log_every=0)
    return trainer.fit()


def plot(curves, path, title):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    styles = ["-", "--", ":", "-.", (0, (5, 1)), (0, (1, 1))]
    for i, (layout, m) in enumerate(curves.items()):
        steps = np.arange(1, len(m["loss_history"]) + 1)
        if layout == "single":
            ax.plot(steps, m["loss_history"], color="0.75", lw=5, label="single", zorder=1)
        else:
            ax.plot(steps, m["loss_history"], ls=styles[i % len(styles)], lw=1.4, zorder=2,
                    label=f"{layout} (test acc {m['test_accuracy']:.3f})")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (global batch mean)")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=None,
                   help="layouts to compare with single (default: by world size)")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.003)
    p.add_argument("--model", type=lambda s: [int(v) for v in s.split(",")],
                   default=[64, 128, 128, 64, 10])
    p.add_argument("--dataset", default="digits",
                   choices=("digits", "synthetic-classification"))
    p.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", default="loss_curves.png")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    data = load_dataset(args.dataset, d_in=args.model[0], d_out=args.model[-1], seed=args.seed)
    if (data.d_in, data.d_out) != (args.model[0], args.model[-1]):
        p.error(f"--model {args.model} does not fit {args.dataset} ({data.d_in} features, "
                f"{data.d_out} classes)")
    curves = {"single": run("single", args, data)}
    for layout in args.layouts or default_layouts(comm.Get_size()):
        try:
            if ms.parse_layout(layout).world_size != comm.Get_size():
                raise ValueError(f"needs {ms.parse_layout(layout).world_size} ranks, the world "
                                 f"has {comm.Get_size()}")
            curves[layout] = run(layout, args, data)
        except (ValueError, ImportError) as exc:     # raised the same on every rank
            if rank0:
                print(f"skipping {layout}: {exc}")
    if rank0:
        ref = np.array(curves["single"]["loss_history"])
        print(f"{'layout':<12}{'final loss':>12}{'test acc':>10}{'max rel diff vs single':>24}")
        for layout, m in curves.items():
            d = float(np.max(np.abs(np.array(m["loss_history"]) - ref) / np.abs(ref)))
            print(f"{layout:<12}{m['final_loss']:>12.6f}{m['test_accuracy']:>10.4f}{d:>24.2e}")
        plot(curves, args.png, f"{args.dataset} {'-'.join(map(str, args.model))}, AdamW + cosine, "
             f"batch {args.batch}, {args.dtype}, {comm.Get_size()} rank(s)")
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

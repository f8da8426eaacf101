"""A 784 -> 512 -> 256 -> 128 -> 10 classifier: how much parameter memory each rank holds under
each layout, as a table and a bar chart next to the unsharded model.

    mpiexec -n 4 python -m mpi4py examples/seed_memory_placement.py --png memory.png
    python examples/seed_memory_placement.py --layouts dp=4 tp=4 pp=4 fsdp=4 dp=2,tp=2

The numbers come from the placement plan (`rank_memory`, the `plan` command's per-rank memory:
which stage holds a parameter and how it is split on each mesh axis), so any layout can be shown
on any number of ranks. For every layout whose size equals the world size, the script also
builds the real engine, loads the weights, and checks that the bytes each rank actually holds
equal the plan's (exit status 1 if not). Rank 0 prints and draws.

    dp=4      every rank holds the whole model (replicas)
    tp=4      Megatron: W0, W2 split by columns, W1, W3 by rows; the row layers' biases are
              replicated, so the ranks together hold a little more than one model
    pp=4      layer i on rank i: the 784 x 512 layer makes rank 0 the heaviest
    fsdp=4    every parameter split (padded) along its first dimension: a quarter each
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.comm.mesh import AXES, coordinates, parse_layout
from mpishard.costs.rank_costs import rank_memory

DIMS = [784, 512, 256, 128, 10]
DEFAULT_LAYOUTS = ["dp=4", "tp=4", "pp=4", "fsdp=4", "dp=2,tp=2"]


def plan_memory(model, layout, itemsize):
    """rows[rank] = {layer prefix: parameter count held}, from the plan alone (no MPI)."""
    layout = parse_layout(layout)
    rows = []
    for rank in range(layout.world_size):
        held = {}
        for name, shape in rank_memory(model, layout, rank, itemsize)["shapes"].items():
            prefix = name.split("/")[0]
            held[prefix] = held.get(prefix, 0) + int(np.prod(shape))
        rows.append({"coords": coordinates(layout, rank), "params": held,
                     "bytes": sum(held.values()) * itemsize})
    return rows


def coord_text(layout, coords):
    active = parse_layout(layout).active_axes
    return ",".join(f"{a}{coords[a]}" for a in AXES if a in active) or "-"


def print_table(model, layout, rows, full_bytes):
    layers = [f"layer_{i}" for i in range(model.n_layers)]
    head = f"{'rank':>4}  {'coords':<10}" + "".join(f"{name:>10}" for name in layers) + \
        f"{'MiB':>9}{'% of model':>12}"
    print(f"\n{layout}: parameters held per rank")
    print(head)
    print("-" * len(head))
    for r, row in enumerate(rows):
        counts = "".join(f"{row['params'].get(name, 0):>10,}" for name in layers)
        print(f"{r:>4}  {coord_text(layout, row['coords']):<10}{counts}"
              f"{row['bytes'] / 2**20:>9.3f}{100 * row['bytes'] / full_bytes:>11.1f}%")
    total = sum(row["bytes"] for row in rows)
    print(f"{'all':>4}  {'':<10}" + " " * 10 * len(layers) +
          f"{total / 2**20:>9.3f}{100 * total / full_bytes:>11.1f}%")


def measured_bytes(model, layout, dtype):
    """Build the engine, load the weights, all-gather each rank's actual parameter bytes."""
    engine = ms.make_engine(model, layout, dtype=dtype)
    engine.load_checkpoint(model.init(seed=0))
    local = sum(int(p.nbytes) for p in engine.params.values())
    return [int(v) for v in engine.backend.to_host(
        engine.all_gather(np.array([local], dtype=np.int64)))]


def plot(results, full_bytes, path, dtype_name):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.2 + 1.6 * (len(results) + 1), 4.2))
    x0 = 0
    ticks, labels = [], []
    ax.bar([x0], [full_bytes / 2**20], width=0.7, color="0.55")
    ticks.append(x0)
    labels.append("unsharded")
    x0 += 1.5
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (layout, rows) in enumerate(results.items()):
        xs = [x0 + 0.8 * r / max(1, len(rows)) for r in range(len(rows))]
        ax.bar(xs, [row["bytes"] / 2**20 for row in rows], width=0.7 / max(1, len(rows)),
               color=colors[i % len(colors)])
        ticks.append(x0 + 0.4 - 0.4 / max(1, len(rows)))
        labels.append(f"{layout}\n(ranks 0..{len(rows) - 1})")
        x0 += 1.5
    ax.axhline(full_bytes / 2**20, color="0.3", lw=0.8, ls="--")
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=8)
    ax.set_ylabel(f"parameter memory per rank (MiB, {dtype_name})")
    ax.set_title("784-512-256-128-10 classifier: parameters held by each rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layouts", nargs="+", default=DEFAULT_LAYOUTS)
    p.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    p.add_argument("--png", default="memory_placement.png", help="bar chart path ('' for none)")
    args = p.parse_args()
    comm = MPI.COMM_WORLD
    rank0 = comm.Get_rank() == 0
    dtype = np.dtype(args.dtype)
    model = ms.MLP(DIMS, activation="relu")
    full_bytes = model.num_params() * dtype.itemsize
    if rank0:
        print(f"model {'->'.join(map(str, DIMS))}: {model.num_params():,} parameters, "
              f"{full_bytes / 2**20:.3f} MiB in {dtype.name} (unsharded, one device)")
    results, status = {}, 0
    for layout in args.layouts:
        try:
            rows = plan_memory(model, layout, dtype.itemsize)
        except (ValueError, ImportError) as exc:            # the same on every rank
            if rank0:
                print(f"\nskipping {layout}: {exc}")
            continue
        results[layout] = rows
        if rank0:
            print_table(model, layout, rows, full_bytes)
        if parse_layout(layout).world_size == comm.Get_size():
            got = measured_bytes(model, layout, dtype)
            want = [row["bytes"] for row in rows]
            ok = got == want
            status |= 0 if ok else 1
            if rank0:
                print(f"measured on this run ({comm.Get_size()} ranks): "
                      f"{[f'{b / 2**20:.3f}' for b in got]} MiB "
                      f"{'= the plan' if ok else f'!= the plan {want}'}")
    if rank0 and args.png and results:
        plot(results, full_bytes, args.png, dtype.name)
        print(f"\nwrote {args.png}")
    return status


if __name__ == "__main__":
    sys.exit(main())

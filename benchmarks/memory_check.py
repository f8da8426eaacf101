"""Predicted peak memory per rank (costs/peak_memory.rank_peak) against the measured peak.

    OMP_NUM_THREADS=1 python benchmarks/memory_check.py            # every layout below
    OMP_NUM_THREADS=1 python benchmarks/memory_check.py --only gpt2-fsdp4 --json out.json

Each case runs its own `mpiexec -n N` job of this file's `--worker` mode: every rank reads its
resident size right after start-up (imports and MPI initialised, and one step of a toy model of
the same kind run: the CPU kernels' JIT compiled, `warm_up`), resets the high-water mark
there (/proc/self/clear_refs, train/memory.py), builds the engine, loads parameters shard by
shard (a `Filled` stand-in: no rank ever holds the full model), and runs `--steps` AdamW
training steps (train_step + optimizer step). Its measured peak is VmHWM minus that start-up
resident size. A case with a compute dtype runs the CPU's rounding emulation of it
(`compute_dtype=`), priced by costs/storage.py's `storage_for(..., "cpu")`. The table gives,
per rank, predicted and measured MiB and the error (predicted / measured - 1); the target is
within 15% on each rank.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.health.signals import remove_singleton_segment_at_exit
from mpishard.comm.mesh import parse_layout
from mpishard.costs.peak_memory import rank_peak
from mpishard.costs.storage import storage_for
from mpishard.train.memory import reset_high_water_mark, status_bytes

GPT2 = {"kind": "gpt", "vocab": 50257, "seq": 256, "d": 768, "heads": 12, "layers": 12}
GPT_MID = {"kind": "gpt", "vocab": 8192, "seq": 256, "d": 512, "heads": 8, "layers": 4}
MLP_BIG = {"kind": "mlp", "dims": [1024, 4096, 4096, 4096, 1024]}
MLP_WIDE = {"kind": "mlp", "dims": [2048, 8192, 8192, 2048]}
GPT_CI = {"kind": "gpt", "vocab": 8192, "seq": 128, "d": 384, "heads": 6, "layers": 4}
MLP_CI = {"kind": "mlp", "dims": [1024, 2048, 2048, 1024]}
LLAMA = {"kind": "llama", "vocab": 8192, "seq": 256, "d": 512, "heads": 8, "layers": 4,
         "kv_heads": 4, "d_ff": 1408}
QWEN2 = {**LLAMA, "kind": "qwen2", "kv_heads": 2}
MIXTRAL = {**LLAMA, "kind": "llama", "d_ff": 1024, "experts": 4, "top_k": 2}
LLAMA_CI = {**LLAMA, "seq": 128, "d": 384, "heads": 6, "kv_heads": 2, "d_ff": 1024}

# name -> (model, layout, global batch, ranks[, compute dtype: the CPU's rounding emulation])
CASES = {
    "gpt2-single": (GPT2, "single", 2, 1),
    "gpt2-fsdp4": (GPT2, "fsdp=4", 4, 4),
    "gpt2-tp2-pp2": (GPT2, "tp=2,pp=2", 4, 4),
    "gpt2-dp2-tp2": (GPT2, "dp=2,tp=2", 4, 4),
    "gpt2-fsdp2-zero2": (GPT2, "fsdp=2,zero=2", 4, 2),
    "gpt2-pp2-gpipe": (GPT2, "pp=2,schedule=gpipe,microbatches=4", 4, 2),
    "gpt2-tp2-recompute": (GPT2, "tp=2,recompute=1", 4, 2),
    "gpt-mid-dp2": (GPT_MID, "dp=2", 8, 2),
    "mlp-big-single": (MLP_BIG, "single", 4096, 1),
    "mlp-big-tp2": (MLP_BIG, "tp=2", 4096, 2),
    "mlp-big-fsdp4": (MLP_BIG, "fsdp=4", 4096, 4),
    "mlp-wide-dp2-pp2": (MLP_WIDE, "dp=2,pp=2,microbatches=4", 4096, 4),
    "llama-single": (LLAMA, "single", 8, 1),
    "llama-tp2": (LLAMA, "tp=2", 8, 2),
    "llama-fsdp2-attn": (LLAMA, "fsdp=2,recompute=attn", 8, 2),
    "llama-tp2-sp-recompute": (LLAMA, "tp=2,sequence_parallel=1,recompute=1", 8, 2),
    "llama-pp2-gpipe": (LLAMA, "pp=2,schedule=gpipe,microbatches=4", 8, 2),
    "qwen2-dp2": (QWEN2, "dp=2", 8, 2),
    "mixtral-ep2": (MIXTRAL, "ep=2", 8, 2),
    "gpt2-single-bf16": (GPT2, "single", 2, 1, "bfloat16"),
    "gpt2-fsdp2-bf16": (GPT2, "fsdp=2", 4, 2, "bfloat16"),
    "llama-tp2-bf16": (LLAMA, "tp=2", 8, 2, "bfloat16"),
    # smaller ones for CI (tests/costs/test_peak_memory.py): about 100-300 MB per rank
    "ci-gpt-tp2": (GPT_CI, "tp=2", 4, 2),
    "ci-gpt-pp2-gpipe": (GPT_CI, "pp=2,schedule=gpipe,microbatches=4", 8, 2),
    "ci-mlp-fsdp2": (MLP_CI, "fsdp=2", 2048, 2),
    "ci-llama-tp2-sp": (LLAMA_CI, "tp=2,sequence_parallel=1", 4, 2),
    "ci-gpt-dp2-bf16": (GPT_CI, "dp=2", 4, 2, "bfloat16"),
}
BIG = [name for name in CASES if not name.startswith("ci-")]
TARGET = 0.15


def build_model(spec):
    if spec["kind"] == "mlp":
        return ms.MLP(spec["dims"], activation="relu")
    shape = (spec["vocab"], spec["seq"], spec["d"], spec["heads"], spec["layers"])
    if spec["kind"] == "gpt":
        return ms.GPT(*shape)
    kw = {"n_kv_heads": spec["kv_heads"], "d_ff": spec["d_ff"]}
    if spec.get("experts"):
        kw.update(n_experts=spec["experts"], top_k=spec["top_k"])
    return {"llama": ms.Llama, "qwen2": ms.Qwen2}[spec["kind"]](*shape, **kw)


class Filled:
    """A full parameter of `shape` that is never materialised: slicing it gives a small random
    block of the slice's shape (what store.load keeps on a rank)."""

    def __init__(self, shape, seed):
        self.shape, self.dtype, self.seed = tuple(shape), np.dtype(np.float32), seed
        self.ndim = len(self.shape)

    def __getitem__(self, key):
        view = np.lib.stride_tricks.as_strided(np.zeros(1, np.float32), self.shape,
                                               (0,) * self.ndim)[key]
        rng = np.random.default_rng(self.seed)
        return (0.02 * rng.standard_normal(view.shape)).astype(np.float32)

    def __array__(self, dtype=None, copy=None):
        return self[tuple(slice(None) for _ in self.shape)]


def batch_arrays(spec, model, rows):
    rng = np.random.default_rng(1)
    if spec["kind"] == "mlp":
        return (rng.standard_normal((rows, spec["dims"][0])).astype(np.float32),
                rng.integers(0, spec["dims"][-1], rows), ms.losses.CrossEntropy())
    ids = rng.integers(0, spec["vocab"], (rows, spec["seq"] + 1))
    return ids[:, :-1], ids[:, 1:], ms.losses.CrossEntropy()


def warm_up(spec) -> None:
    """One float32 training step of a toy model of `spec`'s kind on this rank alone: the
    kernels the run will call are compiled (numba's, with the `cpu-fused` extra: its JIT's
    memory is a fixed cost of the process, not of the model) before the baseline is read."""
    toy = {**spec, "dims": [8, 16, 8]} if spec["kind"] == "mlp" else \
        {**spec, "vocab": 64, "seq": 8, "d": 16, "heads": 2, "layers": 1, "kv_heads": 2,
         "d_ff": 32}
    model = build_model(toy)
    engine = ms.make_engine(model, "single", dtype=np.float32, comm=MPI.COMM_SELF)
    engine.load_checkpoint(model.init(0))
    x, t, loss = batch_arrays(toy, model, 4)
    _, grads = engine.train_step(x, t, loss)
    ms.optim.AdamW(engine, lr=1e-4).step(grads)
    engine.close()


def worker(spec, layout, batch, steps, compute=None) -> None:
    """One rank: its peak above the start-up resident size, gathered on rank 0 as JSON."""
    comm = MPI.COMM_WORLD
    warm_up(spec)
    baseline = status_bytes("VmRSS")
    reset_high_water_mark()
    model = build_model(spec)
    engine = ms.make_engine(model, layout, dtype=np.float32, comm=comm, compute_dtype=compute)
    engine.load_checkpoint({n: Filled(s, i) for i, (n, s) in
                            enumerate(model.param_shapes().items())})
    opt = ms.optim.AdamW(engine, lr=1e-4)
    x, t, loss = batch_arrays(spec, model, batch)
    xl, tl = engine.shard_batch(x), engine.shard_batch(t)
    del x, t
    for _ in range(steps):
        _, grads = engine.train_step(xl, tl, loss)
        opt.step(grads)
    peak = status_bytes("VmHWM") - baseline
    peaks = comm.gather(peak, root=0)
    engine.close()
    if comm.Get_rank() == 0:
        print("MEMORY_CHECK " + json.dumps(peaks), flush=True)


def measure(spec, layout, batch, ranks, steps=2, compute=None) -> list:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    mpiexec = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    cmd = [mpiexec if os.path.exists(mpiexec) else "mpiexec", "-n", str(ranks),
           sys.executable, os.path.abspath(__file__), "--worker", json.dumps(spec), layout,
           str(batch), str(steps), compute or "none"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    for line in out.stdout.splitlines():
        if line.startswith("MEMORY_CHECK "):
            return json.loads(line.split(" ", 1)[1])
    raise RuntimeError(f"{layout}: no result\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")


def check(name, steps=2) -> list:
    """[{case, layout, rank, predicted, measured, error}] of one case."""
    spec, layout, batch, ranks, *compute = CASES[name]
    compute = compute[0] if compute else None
    model = build_model(spec)
    measured = measure(spec, layout, batch, ranks, steps, compute)
    storage = storage_for("float32", compute, "cpu")
    rows = []
    for r, got in enumerate(measured):
        pred = rank_peak(model, parse_layout(layout), r, batch, itemsize=4,
                         storage=storage)["total"]
        rows.append({"case": name, "layout": layout, "compute": storage.name, "rank": r,
                     "predicted": pred, "measured": got, "error": pred / got - 1})
    return rows


def table(rows) -> str:
    lines = ["| case | layout | compute | rank | predicted MiB | measured MiB | error |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['case']} | {r['layout']} | {r['compute']} | {r['rank']} | "
              f"{r['predicted'] / 2**20:.0f} | "
              f"{r['measured'] / 2**20:.0f} | {100 * r['error']:+.1f}% |" for r in rows]
    worst = max(abs(r["error"]) for r in rows)
    lines.append(f"\nworst |error| {100 * worst:.1f}% (target {100 * TARGET:.0f}%)")
    return "\n".join(lines)


def main(argv=None) -> int:
    # the driver runs as an MPI singleton: Open MPI would leave its segment in /dev/shm
    remove_singleton_segment_at_exit(MPI.COMM_WORLD)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="*", choices=sorted(CASES), help="these cases only "
                   "(default: every case but the ci- ones)")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--json", help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = []
    for name in args.only or BIG:
        rows += check(name, args.steps)
        print(table(rows[-CASES[name][3]:]).split("\n\n")[0].split("\n", 2)[-1], flush=True)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0 if all(abs(r["error"]) <= TARGET for r in rows) else 1


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        worker(json.loads(sys.argv[2]), sys.argv[3], int(sys.argv[4]), int(sys.argv[5]),
               None if sys.argv[6] == "none" else sys.argv[6])
    else:
        sys.exit(main())

"""End-to-end step time of two source trees of mpishard, paired in one run.

    python benchmarks/ab_steps.py --a /tmp/wt-base --b . --ranks 1 2 4 --rounds 5 --json ab.json

For each rank count N, each round launches `mpiexec -n N python -m mpi4py ab_steps.py
--worker` once per tree with `PYTHONPATH=<tree>`, A then B in even rounds and B then A in odd
ones, so both trees see the same load; a launch times every case of its rank count and prints
one JSON line. Cases (the engine's public API only: `ms.make_engine`, `engine.shard_batch`,
`engine.train_step`, `ms.optim.AdamW`, so both trees run this same script):

    gpt   ms.GPT(vocab 256, seq 64, d_model 128, 4 heads, 4 layers), batch 8 per data rank
          (--gpt-size big: seq 128, d_model 256)
    mlp   ms.MLP([1024, 1024, 1024]) with MSE, batch 64 per data rank

at layouts `single` (1 rank), `dp=N` (N > 1 ranks), and `tp=2`, `fsdp=2` (2 ranks). A step is
`train_step` then `AdamW.step`, timed as the slowest rank's after a barrier on two clocks: wall
time, and CPU time (user + system, `time.process_time`), which other jobs' load on a shared
machine disturbs far less (a rank's polling while it waits counts as CPU time when it runs).
Reported per case and clock: the median over rounds of each launch's median step, and B/A as
the median of the paired per-round ratios. OMP_NUM_THREADS (default 1, --threads) is set for
both trees alike, so neither tree's own thread policy decides the comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from kernels import true_kernel_env

HERE = Path(__file__).resolve()
GPT_SIZES = {"small": dict(vocab_size=256, seq_len=64, d_model=128, n_heads=4, n_layers=4),
             "big": dict(vocab_size=256, seq_len=128, d_model=256, n_heads=4, n_layers=4)}


def cases_for(n: int, only=None) -> list:
    """(model, layout) cases run at `n` ranks; `only`: those whose "model layout" contains one
    of these strings."""
    layouts = ["single"] if n == 1 else [f"dp={n}"] + (["tp=2", "fsdp=2"] if n == 2 else [])
    return [(model, layout) for layout in layouts for model in ("gpt", "mlp")
            if not only or any(o in f"{model} {layout}" for o in only)]


# -- worker: runs under mpiexec with PYTHONPATH=<tree> ----------------------------------------
def worker(args) -> None:
    import numpy as np
    from mpi4py import MPI

    import mpishard as ms

    world = MPI.COMM_WORLD
    n = world.Get_size()
    dtype = np.dtype(args.dtype)
    out = {"mpishard": str(Path(ms.__file__).resolve().parent.parent), "cases": {}}
    for model_name, layout in cases_for(n, args.only):
        rng = np.random.default_rng(0)
        if model_name == "gpt":
            model = ms.GPT(**GPT_SIZES[args.gpt_size])
            per_rank, loss = 8, ms.losses.CrossEntropy()
        else:
            model = ms.MLP([1024, 1024, 1024])
            per_rank, loss = 64, ms.losses.MSE()
        engine = ms.make_engine(model, layout, dtype=dtype)
        engine.load_checkpoint(model.init(seed=0))
        rows = per_rank * engine.data_parallel_size
        if model_name == "gpt":
            x = rng.integers(0, model.vocab_size, (rows, model.seq_len))
            t = rng.integers(0, model.vocab_size, (rows, model.seq_len))
        else:
            x = rng.standard_normal((rows, 1024))
            t = rng.standard_normal((rows, 1024))
        x, t = engine.shard_batch(x), engine.shard_batch(t)
        opt = ms.optim.AdamW(engine, lr=1e-4)
        times: dict = {"wall": [], "cpu": []}
        for i in range(args.warmup + args.steps):
            world.Barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            _, grads = engine.train_step(x, t, loss)
            opt.step(grads)
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            if i >= args.warmup:
                times["wall"].append(world.allreduce(dt, op=MPI.MAX))
                times["cpu"].append(world.allreduce(dc, op=MPI.MAX))
        out["cases"][f"{model_name} {layout}"] = {k: statistics.median(v)
                                                  for k, v in times.items()}
        del engine, opt, grads
    if world.Get_rank() == 0:
        print("AB_RESULT " + json.dumps(out), flush=True)


# -- driver ----------------------------------------------------------------------------------
def launch(tree: Path, n: int, args) -> dict:
    env = dict(true_kernel_env(os.environ), PYTHONPATH=str(tree),
               OMP_NUM_THREADS=str(args.threads))
    for var in ("OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "BLIS_NUM_THREADS"):
        env.pop(var, None)
    cmd = [args.mpiexec, "-n", str(n), sys.executable, "-m", "mpi4py", str(HERE), "--worker",
           "--dtype", args.dtype, "--gpt-size", args.gpt_size, "--steps", str(args.steps),
           "--warmup", str(args.warmup)] + (["--only", *args.only] if args.only else [])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=str(tree),
                          timeout=args.launch_timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("AB_RESULT ")]
    if proc.returncode or not lines:
        raise RuntimeError(f"{' '.join(cmd)} in {tree} failed (rc {proc.returncode}):\n"
                           f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    res = json.loads(lines[-1][len("AB_RESULT "):])
    if Path(res["mpishard"]) != tree:
        raise RuntimeError(f"imported mpishard from {res['mpishard']}, not {tree}")
    return res["cases"]


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", type=Path, help="tree A (the baseline)")
    p.add_argument("--b", type=Path, help="tree B")
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=5, help="timed steps per case and launch")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    p.add_argument("--gpt-size", default="small", choices=sorted(GPT_SIZES))
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS for both trees")
    p.add_argument("--only", nargs="+", help='only the cases whose "model layout" contains '
                   'one of these, e.g. --only "mlp dp"')
    p.add_argument("--mpiexec", default=str(Path(sys.executable).parent / "mpiexec"))
    p.add_argument("--launch-timeout", type=float, default=900)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return worker(args)
    if args.a is None or args.b is None:
        p.error("--a and --b are required")
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    samples: dict = {}              # (case, clock) -> {"a": [...], "b": [...]} per round
    for n in args.ranks:
        for r in range(args.rounds):
            for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
                for case, clocks in launch(trees[side], n, args).items():
                    for clock, t in clocks.items():
                        samples.setdefault((f"{case} @{n}", clock),
                                           {"a": [], "b": []})[side].append(t)
    rows: dict = {}
    for (case, clock), s in samples.items():
        ratios = [b / a for a, b in zip(s["a"], s["b"])]
        rows.setdefault(case, {})[clock] = {
            "a_ms": 1e3 * statistics.median(s["a"]), "b_ms": 1e3 * statistics.median(s["b"]),
            "b_over_a": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
            "a_samples_ms": [1e3 * v for v in s["a"]],
            "b_samples_ms": [1e3 * v for v in s["b"]]}
    res = {"a": str(trees["a"]), "b": str(trees["b"]), "dtype": args.dtype,
           "gpt_size": args.gpt_size, "threads": args.threads, "rounds": args.rounds,
           "steps": args.steps, "cases": rows}
    print(f"A = {trees['a']}\nB = {trees['b']}\n{args.dtype}, OMP_NUM_THREADS={args.threads}, "
          f"{args.rounds} rounds x {args.steps} steps")
    print(f"| {'case':<18} | clock | {'A ms':>8} | {'B ms':>8} | {'B/A':>6} | "
          f"{'B/A range':>13} |")
    print(f"|{'-' * 20}|-------|{'-' * 10}|{'-' * 10}|{'-' * 8}|{'-' * 15}|")
    for case, clocks in rows.items():
        for clock, row in clocks.items():
            lo, hi = row["ratio_range"]
            print(f"| {case:<18} | {clock:<5} | {row['a_ms']:8.2f} | {row['b_ms']:8.2f} | "
                  f"{row['b_over_a']:6.3f} | {lo:6.3f}-{hi:6.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()

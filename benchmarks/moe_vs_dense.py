"""A small mixture-of-experts Llama (Mixtral-style) under dp=2,ep=2 next to the dense Llama of
the same ACTIVE parameters under dp=4, on the same 4 ranks and the same batches: validation
loss per step and step time, paired step by step in one run.

    mpiexec -n 4 python -m mpi4py benchmarks/moe_vs_dense.py              # a few minutes
    mpiexec -n 4 python -m mpi4py benchmarks/moe_vs_dense.py --tiny       # seconds
    mpiexec -n 4 python -m mpi4py benchmarks/moe_vs_dense.py --json out.json --steps 80

Data: the Python standard library's source as bytes (train/text.py's default corpus, read
from the interpreter), the first --corpus-bytes of it; both models see the same windows (the
Trainer's DistributedBatcher with the same seed and global batch).

The models: ms.Llama(n_experts=E, top_k=k, d_ff=F) and ms.Llama(d_ff=k F), otherwise equal.
Each token runs k experts of 3 D F weights, so both run 3 D k F MLP weights per token (the
router's D E more in the MoE); the MoE holds E F / (k F) = E / k times the MLP weights. Both
train in float32 with the library's Trainer (AdamW, global-norm clipping, cosine schedule),
from their own init(seed=0).

Timing, paired: step i of the MoE (all ranks, rank 0's wall time) then step i of the dense
model; the ratio is the median of the per-step ratios (the first step of each left out). The
expert load of the MoE's last step is printed (trainer.expert_load, train/expert_load.py).
The MoE trains with the load-balancing loss (--aux-coef, default 0.01; validation losses are
the cross-entropy alone).

Measured (2 shared cores, 4 ranks, float32; `--steps 200 --eval-every 25`): the MoE (E=4,
top-2, F=96: 205,632 parameters, 131,904 active per token) against the dense Llama (F=192:
131,392), validation loss (nats/byte) moe / dense 5.5586 / 5.5218 at step 0, 3.0963 / 3.0867
at 25, 2.2592 / 2.2219 at 100, 2.0273 / 2.0023 at 200 (the default 60 steps: 2.6013 /
2.5720); step time moe 0.130 s, dense 0.066 s, moe / dense 1.98 (median of paired steps;
2.00 at 60 steps). Expert load of the last step: 1001-1074 assignments per expert over both
blocks (of 4096), the worst block's busiest expert at 1.80x the mean. At this size the MoE's
1.56x parameters do not buy a lower loss in 200 steps, and its step pays the routing, the
four all_to_all_v per block and the experts' per-expert GEMMs of a few hundred rows.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms
from _common import write_json
from llama_vs_torch import BETAS, CLIP, EPS, WEIGHT_DECAY, idle_barrier
from mpishard.train.lr import cosine_schedule
from mpishard.train.optim import AdamW
from mpishard.train.text import text_dataset
from mpishard.train.trainer import Trainer

SIZES = {"full": dict(d_model=64, n_heads=4, n_kv_heads=2, n_layers=2, seq_len=64, d_ff=96,
                      n_experts=4, top_k=2, batch=16, corpus_bytes=400_000),
         "tiny": dict(d_model=16, n_heads=4, n_kv_heads=2, n_layers=2, seq_len=16, d_ff=16,
                      n_experts=4, top_k=2, batch=8, corpus_bytes=40_000)}


def models(size, vocab, aux_coef=0.0):
    """(the MoE, the dense model of the same active MLP weights)."""
    common = dict(vocab_size=vocab, seq_len=size["seq_len"], d_model=size["d_model"],
                  n_heads=size["n_heads"], n_layers=size["n_layers"],
                  n_kv_heads=size["n_kv_heads"])
    moe = ms.Llama(**common, d_ff=size["d_ff"], n_experts=size["n_experts"],
                   top_k=size["top_k"], router_aux_loss_coef=aux_coef)
    return moe, ms.Llama(**common, d_ff=size["top_k"] * size["d_ff"])


def active_params(model) -> int:
    """Weights a token runs through: all but the experts a token does not pick."""
    total = 0
    for name, shape in model.param_shapes().items():
        n = int(np.prod(shape))
        total += n * model.top_k // model.n_experts if "/moe/experts/" in name else n
    return total


def trainer_of(model, layout, data, size, steps, lr, comm):
    engine = ms.make_engine(model, layout, dtype=np.float32, comm=comm)
    engine.load_checkpoint(model.init(seed=0))
    schedule = cosine_schedule(lr, steps, warmup_steps=max(1, steps // 10), min_lr=lr / 10)
    return Trainer(engine, AdamW(engine, lr=lr, betas=BETAS, eps=EPS,
                                 weight_decay=WEIGHT_DECAY),
                   data, batch=size["batch"], steps=steps, clip=CLIP, schedule=schedule,
                   progress=False, log_every=0, seed=0)


def run(size, steps, eval_every, lr, comm, aux_coef=0.01) -> dict:
    rank = comm.Get_rank()
    data = text_dataset(size["seq_len"], max_bytes=size["corpus_bytes"])
    moe, dense = models(size, data.n_classes, aux_coef)
    sides = {"moe": trainer_of(moe, "dp=2,ep=2", data, size, steps, lr, comm),
             "dense": trainer_of(dense, "dp=4", data, size, steps, lr, comm)}
    times = {k: [] for k in sides}
    rows = []

    def evaluate(step):
        row = {"step": step, **{f"{k}_val": t.evaluate()["test_loss"] for k, t in sides.items()}}
        rows.append(row)
        if rank == 0:
            print(f"step {step:4d}  val loss  moe {row['moe_val']:.4f}  dense "
                  f"{row['dense_val']:.4f}", flush=True)

    evaluate(0)
    for step in range(steps):
        for name, trainer in sides.items():
            idle_barrier(comm)
            t0 = time.perf_counter()
            trainer.train_step()
            idle_barrier(comm)
            times[name].append(time.perf_counter() - t0)
        if (step + 1) % eval_every == 0 or step + 1 == steps:
            evaluate(step + 1)
    load = sides["moe"].expert_load
    for trainer in sides.values():
        trainer.engine.close()
    if rank != 0:
        return {}
    med = {k: float(np.median(v[1:])) for k, v in times.items()}
    ratio = float(np.median(np.array(times["moe"][1:]) / np.array(times["dense"][1:])))
    count = {k: sum(int(np.prod(s)) for s in m.param_shapes().values())
             for k, m in (("moe", moe), ("dense", dense))}
    return {"world_size": comm.Get_size(), "layouts": {"moe": "dp=2,ep=2", "dense": "dp=4"},
            "moe": repr(moe), "dense": repr(dense), "params": count,
            "active_params": {"moe": active_params(moe), "dense": count["dense"]},
            "batch": size["batch"], "seq_len": size["seq_len"], "steps": steps, "lr": lr,
            "curve": rows, "step_s": med, "step_time_ratio": ratio, "expert_load": load}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="toy size (seconds)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (60; tiny 10)")
    p.add_argument("--eval-every", type=int, default=None, help="(10; tiny 5)")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--aux-coef", type=float, default=0.01, help="the MoE's "
                   "router_aux_loss_coef (0.01)")
    p.add_argument("--json", help="write the results here")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        raise SystemExit("run on 4 ranks: mpiexec -n 4 python -m mpi4py "
                         "benchmarks/moe_vs_dense.py")
    size = SIZES["tiny" if args.tiny else "full"]
    steps = args.steps or (10 if args.tiny else 60)
    res = run(size, steps, args.eval_every or (5 if args.tiny else 10), args.lr, comm,
              args.aux_coef)
    if comm.Get_rank() == 0:
        print(f"\nMoE   {res['moe']} on dp=2,ep=2: {res['params']['moe']} parameters, "
              f"{res['active_params']['moe']} active per token")
        print(f"dense {res['dense']} on dp=4: {res['params']['dense']} parameters")
        print(f"batch {res['batch']} x {res['seq_len']} bytes, {res['steps']} AdamW steps, "
              f"float32")
        print(f"{'step':>6} {'moe val':>10} {'dense val':>10}")
        for r in res["curve"]:
            print(f"{r['step']:>6} {r['moe_val']:>10.4f} {r['dense_val']:>10.4f}")
        print(f"step time: moe {res['step_s']['moe']:.3f} s, dense {res['step_s']['dense']:.3f}"
              f" s; moe / dense (median of paired steps) {res['step_time_ratio']:.2f}")
        print(f"expert load of the last step: {res['expert_load']}")
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    sys.exit(main())

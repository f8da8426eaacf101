"""Is `--layout auto`'s choice within 10% of the fastest measured candidate?

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE OPENBLAS_NUM_THREADS=1 \\
        mpiexec -n 4 python -m mpi4py benchmarks/layout_auto_check.py \\
        [--calibration cal.json] [--top 12] [--rounds 7] [--json out.json]

For each model (an MLP and a small GPT), the candidates of this world size that fit
(cli/plan.plan_layouts; no memory limit) are ranked as `--layout auto` ranks them
(cli/auto_layout.choose_layout: the rule of thumb, and with --calibration the predicted time
too); the `--top` of the rule's ranking, the calibrated choice and every pp-free dp/fsdp/tp
layout are built, warmed up and measured paired and interleaved (plan_time.measure_steps:
each round runs one train_step + AdamW step of every layout in turn, a layout's time the
median over the rounds of the slowest rank's step), with the host heap kept as `train` keeps
it. Rank 0 prints each layout's measured
time and the choice's gap to the fastest measured: the target is a gap of at most 10%.
"""
from __future__ import annotations

import argparse
import json

import numpy as np
from mpi4py import MPI

from mpishard.cli.auto_layout import choose_layout
from mpishard.cli.model_flag import model_from_flag
from mpishard.cli.plan_time import measure_steps, step_fn
from mpishard.comm.mesh import parse_layout
from mpishard.health.signals import remove_singleton_segment_at_exit
from mpishard.costs.calibration import load_calibration
from mpishard.health.heap import keep_host_heap

MODELS = {"mlp": ("784,512,512,10", None, 256),          # name: (--model, --gpt, batch)
          "gpt": ("gpt", "d_model=128,n_heads=4,n_layers=4,seq_len=64,"
                                              "vocab_size=256", 16)}


def check(name, spec, gpt, batch, comm, calibration, top, rounds) -> dict:
    model = model_from_flag(spec, "relu", gpt=gpt)
    world = comm.Get_size()
    rule = choose_layout(model, world, 2 ** 50, batch)
    timed = choose_layout(model, world, 2 ** 50, batch, calibration=calibration) \
        if calibration else None
    fit = rule["ranked"]["fit"]
    chosen = [r["layout"] for r in fit[:top]]
    extra = [r["layout"] for r in fit if parse_layout(r["layout"]).size("pp") == 1
             and not any(k in r["layout"] for k in ("cp", "sequence_parallel"))]
    if timed:
        extra.append(timed["layout"])
    layouts = list(dict.fromkeys(chosen + extra))
    steps = [step_fn(model, parse_layout(text), batch, np.float32, comm) for text in layouts]
    measured, _ = measure_steps(steps, comm, rounds)
    times = dict(zip(layouts, measured))
    best = min(times, key=times.get)
    out = {"model": name, "world_size": world, "rounds": rounds, "measured_s": times,
           "fastest": best, "rule_choice": rule["layout"],
           "rule_gap": times[rule["layout"]] / times[best] - 1}
    if timed:
        out.update(calibrated_choice=timed["layout"],
                   calibrated_gap=times[timed["layout"]] / times[best] - 1)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--calibration")
    p.add_argument("--top", type=int, default=8, help="the rule's best K are measured (8)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (7)")
    p.add_argument("--models", default=",".join(MODELS), help="comma-separated MODELS keys")
    p.add_argument("--json")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    remove_singleton_segment_at_exit(comm)     # run alone, Open MPI leaves its segment
    keep_host_heap("keep")                     # the steps `train` runs (and --calibrate times)
    calibration = load_calibration(args.calibration) if args.calibration else None
    results = [check(name, *MODELS[name], comm, calibration, args.top, args.rounds)
               for name in args.models.split(",")]
    if comm.Get_rank() == 0:
        for r in results:
            spec, gpt, batch = MODELS[r["model"]]
            print(f"{r['model']} {spec} {gpt or ''} batch {batch} at {r['world_size']} ranks, "
                  f"median of {r['rounds']} rounds:")
            for text, t in sorted(r["measured_s"].items(), key=lambda kv: kv[1]):
                marks = [m for m, k in (("rule", "rule_choice"), ("calibrated",
                                                                   "calibrated_choice"))
                         if r.get(k) == text]
                print(f"  {text:<40}{t * 1e3:9.2f} ms  {' '.join(marks)}")
            print(f"  rule's choice {r['rule_choice']}: {100 * r['rule_gap']:+.1f}% vs fastest "
                  f"{r['fastest']}" + (f"; calibrated choice {r['calibrated_choice']}: "
                                       f"{100 * r['calibrated_gap']:+.1f}%"
                                       if "calibrated_gap" in r else ""))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""`make bench`: every benchmark, as ratios measured in one run, into results.json + results.md.

    python benchmarks/run_all.py --mpiexec ".venv/bin/mpiexec"            # ~12-15 min here
    python benchmarks/run_all.py --mpiexec "mpirun --oversubscribe" --quick  # ~2 min
    python benchmarks/run_all.py --tiny --parts collectives,scaling-dp \\
        --out /tmp/r.json --md /tmp/r.md                                      # smoke test

Parts (each a subprocess, so thread settings apply from the start and a crash in one part
is recorded without losing the others):

    mfu          benchmarks/mfu.py: float32 train_step GFLOP/s over plain matmul GFLOP/s,
                 single rank, three model sizes (the largest is the headline)
    collectives  benchmarks/collectives.py at 2 and 4 ranks: engine vs raw mpi4py calls; per
                 kind the worst ratio at >= 1 MiB (each the median of trials) and its trials'
                 range
    peers        benchmarks/peers_torch.py: the MLP's single step vs torch, dp=2 vs torch DDP
                 (gloo); the GPT at 2 ranks (one mpiexec job, torch over gloo on the same
                 ranks, every side alternated): dp=2 vs DDP, fsdp=2 vs FSDP2 (fully_shard),
                 tp=2 vs DTensor tensor parallel (parallelize_module), full AdamW steps
    gpt          benchmarks/gpt.py: the issue's GPT, single rank: MFU against plain matmul on
                 the same GEMMs, and the step time over PyTorch CPU eager's (same weights)
    kernels      benchmarks/kernels.py: the peers' GPT job on numpy's own kernel and with
                 OPENBLAS_CORETYPE=Haswell forced, alternated in 5 rounds (ratio medians)
    gpt-small    benchmarks/gpt_small.py: gpt_mfu_fraction of a GPT-2-small-shaped step at one
                 rank, and where the step's time goes (a profile by function)
    planner      `python -m mpishard plan ... --validate K --json` at 8 ranks: the planner's
                 predicted step times against measured ones (calibrated in the first job, the
                 calibration reused by the second), an MLP and a GPT
    scaling-dp   benchmarks/scaling.py dp / tp (2 ranks) and pp (4 ranks; with zb1p's
    scaling-tp   measured bubble over 1F1B's)
    scaling-pp

results.json's `meta.commit` is the commit measured (`-dirty` when tracked files differed
from it), named again in results.md's first line.

Every child runs numpy's BLAS on the kernel the CPU supports: OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE are removed from its environment (benchmarks/kernels.py; tests and CI keep
them), and every result records the BLAS it ran on (numpy's and PyTorch's, under 'blas';
results.json's meta.blas is a child's: benchmarks/kernels.py's).
Every child gets OMP_NUM_THREADS = OPENBLAS_NUM_THREADS = MKL_NUM_THREADS = BLAS_THREADS
(default 1: ranks share the cores; the Makefile exports the same), and torch runs with
torch.set_num_threads(1), so both sides use one thread per rank.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import kernels
from bench_parts import (PARTS, mfu_one, part_collectives, part_gpt, part_mfu, part_peers,
                         part_planner, part_scaling)
from bench_report import TARGETS, failures, headline, kept_sections, markdown, spreads
from bench_runner import HERE, Runner, meta


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mpiexec", default=os.environ.get("MPIEXEC", "mpiexec"),
                   help="launcher and its flags, e.g. '.venv/bin/mpiexec' or "
                        "'mpirun --oversubscribe'")
    p.add_argument("--quick", action="store_true", help="smaller sizes, collectives to 16 MiB")
    p.add_argument("--tiny", action="store_true", help="toy sizes (the smoke test)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    p.add_argument("--out", default=str(HERE / "results.json"))
    p.add_argument("--md", default=str(HERE / "results.md"))
    p.add_argument("--part-timeout", type=int, default=600, help="seconds per subprocess")
    p.add_argument("--verbose", action="store_true", help="print each part's output tail")
    p.add_argument("--mfu-one", default=None, help=argparse.SUPPRESS)
    p.add_argument("--json", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.argv = argv
    if args.mfu_one is not None:                         # child mode for one MFU size
        return mfu_one(args.mfu_one, args.json)
    parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    bad = [s for s in parts if s not in PARTS]
    if bad:
        p.error(f"unknown parts {bad}; choose from {PARTS}")
    r = Runner(args)
    t0 = time.perf_counter()
    results: dict = {}
    if "mfu" in parts:
        results["mfu"] = part_mfu(r)
    if "collectives" in parts:
        results["collective_overhead"] = part_collectives(r)
    if "peers" in parts:
        results["peers"] = part_peers(r)
    if "kernels" in parts:
        results["kernels"] = kernels.part_kernels(r)
    if "gpt" in parts:
        results["gpt"] = part_gpt(r)
    if "gpt-small" in parts:
        results["gpt_small"] = r.serial("gpt_small.py", timeout=r.args.part_timeout)
    if "planner" in parts:
        results["planner"] = part_planner(r)
    for mode in ("dp", "tp", "pp"):
        if f"scaling-{mode}" in parts:
            results.setdefault("scaling", {})[mode] = part_scaling(r, mode)
    results["headline"] = headline(results)
    results["headline_spread"] = spreads(results)
    results["targets"] = {k: f"{c} {t}" for k, (c, t) in TARGETS.items()}
    results["meta"] = meta(args, r, time.perf_counter() - t0)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    md = markdown(results)
    md += kept_sections(Path(args.md), md)
    Path(args.md).write_text(md)
    print(md)
    print(f"wrote {args.out} and {args.md}")
    failed = failures(results)
    for where, msg in failed:
        print(f"FAILED {where}: {msg}", file=sys.stderr)
    return 1 if failed else 0



if __name__ == "__main__":
    sys.exit(main())

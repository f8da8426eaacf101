"""The parts of `make bench` (benchmarks/run_all.py's docstring lists them): each a function
of the Runner (bench_runner.py) that launches its benchmark and returns its results, with
the sizes each mode (full, quick, tiny) runs.
"""
from __future__ import annotations

import json
import sys
import tempfile
from pathlib import Path

from bench_runner import HERE, Runner

PARTS = ["mfu", "collectives", "peers", "kernels", "gpt", "gpt-small", "planner", "scaling-dp",
         "scaling-tp", "scaling-pp"]
MIB = 1024 * 1024
PLANNER_RANKS = {"full": 8, "quick": 8, "tiny": 4}   # tiny: the smoke test's toy models
PLANNER_MODELS = {  # mode: [(name, --model, batch, layouts validated)]; full: docs/performance.md's
    "full": [("mlp", "784,512,512,10", 256, 12),
             ("gpt", "gpt:vocab=256,seq_len=64,d_model=128,n_heads=4,n_layers=4", 16, 12)],
    "quick": [("mlp", "784,512,512,10", 256, 10),
              ("gpt", "gpt:vocab=256,seq_len=64,d_model=128,n_heads=4,n_layers=4", 16, 10)],
    "tiny": [("mlp", "64,32,32,16", 32, 3),
             ("gpt", "gpt:vocab=64,seq_len=16,d_model=32,n_heads=4,n_layers=2", 8, 3)],
}
MFU_SIZES = {  # (dims, batch): small, medium, and the foundation's MLP([1024, 4096, 1024])
    "full": [([256, 1024, 256], 128), ([512, 2048, 512], 256), ([1024, 4096, 1024], 512)],
    "quick": [([128, 512, 128], 64), ([256, 1024, 256], 128), ([512, 2048, 512], 256)],
    "tiny": [([16, 32, 16], 8), ([32, 64, 32], 16), ([64, 128, 64], 32)],
}
COLLECTIVE_KEYS = {"all_reduce_out": "allreduce_overhead_ratio",
                   "all_reduce": "allreduce_overhead_ratio_default",
                   "all_gather": "allgather_overhead_ratio",
                   "reduce_scatter": "reduce_scatter_overhead_ratio",
                   "all_to_all": "all_to_all_overhead_ratio",
                   "all_to_all_v": "all_to_all_v_overhead_ratio"}


def part_mfu(r: Runner) -> dict:
    sizes = []
    for dims, batch in MFU_SIZES[r.mode]:
        repeats = 3 if r.mode == "tiny" else None     # None: chosen by the child, by size
        res = r.run([sys.executable, HERE / "run_all.py", "--mfu-one",
                     json.dumps([dims, batch, repeats])], timeout=r.args.part_timeout)
        res.update(dims=dims, batch=batch)
        sizes.append(res)
    out = {"sizes": sizes}
    largest = sizes[-1]
    if "mfu_fraction" in largest:
        out["mfu_fraction"] = largest["mfu_fraction"]
    return out


def mfu_one(spec: str, json_path: str) -> None:
    """Child process: measure one MLP size with benchmarks/mfu.py's own measurement."""
    import mfu  # here, in the child: mfu.py starts MPI, which the parent never does

    dims, batch, repeats = json.loads(spec)
    if repeats is None:
        # one sample is one step; small sizes take a few ms, so load bursts on a shared
        # machine need more repeats to drown in the median
        repeats = max(7, min(31, int(2e10 / mfu.flops(mfu.gemm_shapes(dims, batch)))))
    res = mfu.measure(dims=dims, batch=batch, repeats=repeats)
    Path(json_path).write_text(json.dumps(res))


def part_collectives(r: Runner) -> dict:
    out = {}
    ranks = [2] if r.mode == "tiny" else [2, 4]
    extra = ["--max-bytes", str(MIB)] if r.mode == "tiny" else []   # one size the keys use
    for n in ranks:
        out[str(n)] = r.mpi(n, "collectives.py", *extra, timeout=r.args.part_timeout)
    out.update(worst_collectives(out))
    return out


def worst_collectives(by_ranks: dict) -> dict:
    """Per kind, its headline key (COLLECTIVE_KEYS): the worst ratio at >= 1 MiB over the rank
    counts run (each ratio the median of collectives.py's trials), and under 'worst' where it
    was and the range of its trials' ratios (the spread a note should quote)."""
    rows = [row for res in by_ranks.values() if isinstance(res, dict)
            for row in res.get("rows", []) if row["bytes"] >= MIB]
    out: dict = {"worst": {}}
    for kind, key in COLLECTIVE_KEYS.items():
        mine = [row for row in rows if row["kind"] == kind]
        if not mine:
            continue
        w = max(mine, key=lambda row: row["ratio"])
        trials = w.get("trial_ratios") or [w["ratio"]]
        out[key] = w["ratio"]
        out["worst"][key] = {"kind": kind, "ranks": w["ranks"], "bytes": w["bytes"],
                             "ratio": w["ratio"], "trial_ratios": trials,
                             "spread": [min(trials), max(trials)],
                             "bounded_ratio": w.get("bounded_ratio")}
    return out


def part_peers(r: Runner) -> dict:
    out = {"single": r.serial("peers_torch.py", "single", timeout=r.args.part_timeout)}
    single = out["single"]
    if "ratio" in single:
        out["vs_torch_single_step_ratio"] = single["ratio"]
    if "skipped" in single:            # no torch: no point launching the DDP pair
        out["ddp2"] = out["gpt2"] = {"skipped": single["skipped"]}
        return out
    out["gpt2"] = gpt2 = r.mpi(2, "peers_torch.py", "gpt2", timeout=r.args.part_timeout)
    for peer in ("ddp", "fsdp", "tp"):
        if peer in gpt2.get("peers", {}):
            out[f"vs_torch_{peer}_gpt_step_ratio"] = gpt2["peers"][peer]["ratio"]
    if r.mode == "tiny":
        out["ddp2"] = {"skipped": "not run in --tiny mode (starting torch twice is slow)"}
        return out
    ours = {lay: r.mpi(2, "peers_torch.py", "ours-dp2", "--layout", lay,
                       timeout=r.args.part_timeout)
            for lay in ("dp=2,overlap=1", "dp=2")}
    theirs = r.serial("peers_torch.py", "torch-ddp2", timeout=r.args.part_timeout)
    out["ddp2"] = {"ours": ours, "torch": theirs}
    if "torch_s" in theirs and "ours_s" in ours["dp=2,overlap=1"]:
        # DDP's defaults are 25 MB buckets overlapped with the backward: compare like for like
        out["vs_torch_ddp2_step_ratio"] = ours["dp=2,overlap=1"]["ours_s"] / theirs["torch_s"]
        if "ours_s" in ours["dp=2"]:
            out["vs_torch_ddp2_step_ratio_overlap0"] = ours["dp=2"]["ours_s"] / theirs["torch_s"]
    return out


def part_gpt(r: Runner) -> dict:
    res = r.serial("gpt.py", timeout=r.args.part_timeout)
    if "mfu_fraction" in res:
        res["gpt_mfu_fraction"] = res["mfu_fraction"]
    if "vs_torch_ratio" in res:
        # vs_torch_gpt_step_ratio is the name; the older one stays for old readers
        res["vs_torch_gpt_step_ratio"] = res["gpt_vs_torch_step_ratio"] = res["vs_torch_ratio"]
    return res


def part_planner(r: Runner) -> dict:
    """`plan --validate K --json` at PLANNER_RANKS[mode] ranks per model of PLANNER_MODELS: the
    first job calibrates the machine (full and quick; tiny reads the example calibration),
    the next reuses that file. The headline is the worst model's median absolute error and
    best gap."""
    ranks = PLANNER_RANKS[r.mode]
    out: dict = {"ranks": ranks, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        cal = str(HERE.parent / "examples" / "calibration.example.json") \
            if r.mode == "tiny" else str(Path(tmp) / "calibration.json")
        for name, model, batch, k in PLANNER_MODELS[r.mode]:
            source = ["--calibrate", cal] if not Path(cal).exists() else ["--calibration", cal]
            res = r.run(r.mpiexec + ["-n", str(ranks), sys.executable, "-m", "mpi4py",
                                     "-m", "mpishard", "plan", "--model", model,
                                     "--world-size", str(ranks), "--batch",
                                     str(batch), *source, "--validate", str(k), "--top", "1"],
                        timeout=r.args.part_timeout)
            if "validate" in res:
                res = {"model_flag": model, "calibration": source, **{key: res[key] for key in (
                    "model", "parameters", "batch", "predicted_best", "validate", "wall_s")}}
            out["models"][name] = res
        if Path(cal).exists():
            out["calibration"] = json.loads(Path(cal).read_text())
    done = [m["validate"] for m in out["models"].values() if m.get("validate")]
    if len(done) == len(out["models"]):          # every model validated
        out["planner_median_error"] = max(v["median_abs_error"] for v in done)
        out["planner_best_gap"] = max(v["best_gap"] for v in done)
    return out


def part_scaling(r: Runner, mode: str) -> dict:
    n = 4 if mode == "pp" else 2
    return r.mpi(n, "scaling.py", mode, timeout=r.args.part_timeout)


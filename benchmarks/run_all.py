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
import datetime
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gpt_small
import kernels

HERE = Path(__file__).resolve().parent
TARGETS = {  # headline key: (comparison, target)
    "mfu_fraction": (">=", 0.75),
    "allreduce_overhead_ratio": ("<=", 1.10),
    "allreduce_overhead_ratio_default": ("<=", 1.10),
    "allgather_overhead_ratio": ("<=", 1.10),
    "reduce_scatter_overhead_ratio": ("<=", 1.10),
    "all_to_all_overhead_ratio": ("<=", 1.10),
    "all_to_all_v_overhead_ratio": ("<=", 1.10),
    "vs_torch_single_step_ratio": ("<=", 1.0),
    "vs_torch_ddp2_step_ratio": ("<=", 1.0),
    "vs_torch_ddp_gpt_step_ratio": ("<=", 1.0),
    "vs_torch_fsdp_gpt_step_ratio": ("<=", 1.0),
    "vs_torch_tp_gpt_step_ratio": ("<=", 1.0),
    "gpt_mfu_fraction": (">=", 0.85),
    "vs_torch_gpt_step_ratio": ("<=", 1.3),
    "planner_median_error": ("<=", 0.20),
    "planner_best_gap": ("<=", 0.10),
    "zb1p_bubble_ratio": ("<", 1.0),
}
# collectives.py's kind -> its headline key: the worst ratio at >= 1 MiB over 2 and 4 ranks
COLLECTIVE_KEYS = {"all_reduce_out": "allreduce_overhead_ratio",
                   "all_reduce": "allreduce_overhead_ratio_default",
                   "all_gather": "allgather_overhead_ratio",
                   "reduce_scatter": "reduce_scatter_overhead_ratio",
                   "all_to_all": "all_to_all_overhead_ratio",
                   "all_to_all_v": "all_to_all_v_overhead_ratio"}
PART_OF = {**{k: "collective_overhead" for k in COLLECTIVE_KEYS.values()},
           "mfu_fraction": "mfu", "vs_torch_single_step_ratio": "peers",
           "vs_torch_ddp2_step_ratio": "peers", "vs_torch_ddp_gpt_step_ratio": "peers",
           "vs_torch_fsdp_gpt_step_ratio": "peers", "vs_torch_tp_gpt_step_ratio": "peers",
           "gpt_mfu_fraction": "gpt",
           "vs_torch_gpt_step_ratio": "gpt", "gpt_vs_torch_step_ratio": "gpt",
           "planner_median_error": "planner", "planner_best_gap": "planner",
           "zb1p_bubble_ratio": "scaling"}     # headline key -> its part's results key
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



def _cause(output: str, tail: list) -> str:
    """The Python exception lines a crashed part printed (its cause, whatever the launcher
    printed after it: Open MPI's abort banner fills the tail), else the output's last lines."""
    found = re.findall(r"^(?:mpishard: error: )?[A-Za-z_.]*(?:Error|Exception|Timeout)\b.*$",
                       output, re.MULTILINE)
    return " | ".join(dict.fromkeys(found[-3:])) if found else " | ".join(tail[-4:])

class Runner:
    """Launches the parts and collects their JSON."""

    def __init__(self, args):
        self.args = args
        self.mpiexec = shlex.split(args.mpiexec)
        self.env = kernels.true_kernel_env(os.environ)
        threads = os.environ.get("BLAS_THREADS", "1")
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            self.env[var] = os.environ.get(var, threads)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), str(HERE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.mode = "tiny" if args.tiny else "quick" if args.quick else "full"
        self.size_flag = {"tiny": ["--tiny"], "quick": ["--quick"], "full": []}[self.mode]
        self.log = []

    def run(self, cmd, timeout):
        """Run `cmd` with a --json file appended; returns its JSON, or {'error': ...}."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            cmd = [str(c) for c in cmd] + ["--json", str(out)]
            t0 = time.perf_counter()
            print("==> " + " ".join(shlex.quote(c) for c in cmd), flush=True)
            try:
                proc = subprocess.run(cmd, env=self.env, cwd=HERE.parent, timeout=timeout,
                                      capture_output=True, text=True)
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {timeout} s: {' '.join(cmd)}"}
            wall = time.perf_counter() - t0
            self.log.append({"cmd": " ".join(cmd), "rc": proc.returncode, "wall_s": wall})
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            if self.args.verbose or proc.returncode:
                print("\n".join(tail), flush=True)
            if proc.returncode or not out.exists():
                return {"error": f"exit {proc.returncode}: " + _cause(proc.stdout + proc.stderr,
                                                                      tail)}
            res = json.loads(out.read_text())
            res.setdefault("wall_s", wall)
            return res

    def mpi(self, n, script, *extra, timeout):
        return self.run(self.mpiexec + ["-n", str(n), sys.executable, "-m", "mpi4py",
                                        HERE / script, *extra, *self.size_flag], timeout)

    def serial(self, script, *extra, timeout, flags=True):
        return self.run([sys.executable, HERE / script, *extra,
                         *(self.size_flag if flags else [])], timeout)


# -- the parts -----------------------------------------------------------------------------------
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
    import mfu  # benchmarks/mfu.py (the foundation's single-rank MFU benchmark)

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


# -- report --------------------------------------------------------------------------------------
def headline(results: dict) -> dict:
    h = {}
    mfu = results.get("mfu", {})
    if "mfu_fraction" in mfu:
        h["mfu_fraction"] = mfu["mfu_fraction"]
    coll = results.get("collective_overhead", {})
    for key in COLLECTIVE_KEYS.values():
        if key in coll:
            h[key] = coll[key]
    peers = results.get("peers", {})
    for k in ("vs_torch_single_step_ratio", "vs_torch_ddp2_step_ratio",
              "vs_torch_ddp_gpt_step_ratio", "vs_torch_fsdp_gpt_step_ratio",
              "vs_torch_tp_gpt_step_ratio"):
        if k in peers:
            h[k] = peers[k]
    for k in ("gpt_mfu_fraction", "gpt_vs_torch_step_ratio", "vs_torch_gpt_step_ratio"):
        if k in results.get("gpt", {}):
            h[k] = results["gpt"][k]
    if "gpt_mfu_fraction" in results.get("gpt_small", {}):
        h["gpt2_small_mfu_fraction"] = results["gpt_small"]["gpt_mfu_fraction"]
    for k in ("planner_median_error", "planner_best_gap"):
        if k in results.get("planner", {}):
            h[k] = results["planner"][k]
    sc = results.get("scaling", {})
    if "zb1p_bubble_ratio" in sc.get("pp", {}):
        h["zb1p_bubble_ratio"] = sc["pp"]["zb1p_bubble_ratio"]
    if "dp_efficiency" in sc.get("dp", {}):
        h["dp_1_to_2_efficiency"] = sc["dp"]["dp_efficiency"]
    if "tp_speedup" in sc.get("tp", {}):
        h["tp2_speedup"] = sc["tp"]["tp_speedup"]
    return h


def spreads(results: dict) -> dict:
    """headline key -> [min, max] over the repeats its median was taken of (collectives)."""
    worst = results.get("collective_overhead", {}).get("worst", {})
    return {key: w["spread"] for key, w in worst.items()}


def _fmt(v, digits=3):
    """A number for results.md: `digits` decimals, or a format spec such as '.1e'."""
    spec = digits if isinstance(digits, str) else f".{digits}f"
    return "-" if v is None else f"{v:{spec}}" if isinstance(v, float) else str(v)


def _met(v, cmp, target) -> bool:
    return {">=": v >= target, "<=": v <= target, "<": v < target, ">": v > target}[cmp]


def _why(results, key):
    """Why a headline figure is missing: the part's skip or error message."""
    res = results.get(PART_OF.get(key, ""), {})
    for sub in [res] + [v for v in res.values() if isinstance(v, dict)]:
        for k in ("skipped", "error"):
            if k in sub:
                msg = str(sub[k]).replace("|", "/").replace("\n", " ")
                return f"{k}: {msg[:160]}"
    return "not measured"


def markdown(results: dict) -> str:
    meta, h = results["meta"], results["headline"]
    spread = results.get("headline_spread", {})
    lines = [f"Measured at commit `{meta.get('commit', 'unknown')}`, {meta['date']} on "
             f"{meta['machine']} with `{meta['command']}` "
             f"({meta['mode']} mode, {meta['threads_per_rank']} BLAS thread per rank, "
             f"wall {meta['wall_s']:.0f} s).", "",
             kernels.describe(meta.get("blas", {})) + " (OPENBLAS_CORETYPE and "
             "OPENBLAS_L2_SIZE removed from every benchmark command; set here: "
             f"{meta.get('kernel_vars_removed') or 'none'}).", "",
             "| figure | value | target | met |", "| --- | --- | --- | --- |"]
    for key, (cmp, target) in TARGETS.items():
        v = h.get(key)
        if v is None:
            lines.append(f"| `{key}` | {_why(results, key)} | {cmp} {target} | - |")
            continue
        cell = _fmt(v) + (f" ({_fmt(spread[key][0])}-{_fmt(spread[key][1])})"
                          if key in spread else "")
        lines.append(f"| `{key}` | {cell} | {cmp} {target} | "
                     f"{'yes' if _met(v, cmp, target) else 'no'} |")
    for key in ("gpt2_small_mfu_fraction", "dp_1_to_2_efficiency", "tp2_speedup"):
        if key in h:
            lines.append(f"| `{key}` | {_fmt(h[key])} | - | - |")
    lines += ["", "Collective overhead ratios (`allreduce_overhead_ratio` ... "
              "`all_to_all_v_overhead_ratio`): the worst over sizes >= 1 MiB at 2 and 4 ranks, "
              "each the median of collectives.py's trials, in brackets the range of that "
              "size's trials; `allreduce_overhead_ratio` times "
              "`engine.all_reduce(a, out=out)` against `comm.Allreduce(a, out)` on the same "
              "buffers; `allreduce_overhead_ratio_default` times the plain "
              "`engine.all_reduce(a)`, whose result lands in a buffer of the engine's own. "
              "Single-step, DDP and GPT step ratios: ours over torch (below 1: we are faster; "
              "`vs_torch_gpt_step_ratio` is also written as `gpt_vs_torch_step_ratio`; "
              "`vs_torch_{ddp,fsdp,tp}_gpt_step_ratio`: the GPT at 2 ranks, dp=2 over DDP, "
              "fsdp=2 over FSDP2, tp=2 over DTensor tensor parallel, table below). "
              "`planner_*`: the planner's validation at 8 ranks, the worse of the MLP and the "
              "GPT below. `zb1p_bubble_ratio`: zb1p's measured bubble over 1F1B's, same pp "
              "and microbatches (pipeline table below)."]
    mfu = results.get("mfu", {})
    if mfu.get("sizes"):
        lines += ["", "MFU (float32 train_step GFLOP/s over matmul GFLOP/s, one rank):", "",
                  "| MLP dims | batch | mfu_fraction |", "| --- | --- | --- |"]
        for s in mfu["sizes"]:
            v = _fmt(s["mfu_fraction"]) if "mfu_fraction" in s else \
                s.get("error", s.get("skipped"))
            lines.append(f"| {s['dims']} | {s['batch']} | {v} |")
    g = results.get("gpt", {})
    if "mfu_fraction" in g:
        m = g["model"]
        lines += ["", f"GPT (vocab {m['vocab_size']}, d_model {m['d_model']}, "
                  f"{m['n_heads']} heads, {m['n_layers']} layers, seq {m['seq_len']}, "
                  f"batch {m['batch']}, float32, one rank): {g['gflop_per_step']:.2f} GFLOP "
                  f"per step "
                  f"(`{g['flops_formula']}`); ours {g['ours_gflops']:.1f} GFLOP/s vs plain "
                  f"matmul {g['matmul_gflops']:.1f} GFLOP/s on the same GEMMs: "
                  f"`gpt_mfu_fraction` {g['mfu_fraction']:.3f} (paired "
                  f"{g['mfu_fraction_paired']:.3f})."]
        if "vs_torch_ratio" in g:
            cc = g["cross_check"]
            lines += ["", f"Ours over torch {g['torch_version']} eager (SDPA attention): step "
                      f"{g['vs_torch_ratio']:.3f} (paired {g['vs_torch_ratio_paired']:.3f}), "
                      f"with AdamW {g['vs_torch_ratio_adamw']:.3f}, vs torch with written-out "
                      f"attention {g['vs_torch_ratio_manual_attention']:.3f}. Same weights: "
                      f"loss rel. diff {cc['loss_rel_diff']:.1e}, gradients "
                      f"{cc['max_grad_rel_diff']:.1e}, 3 AdamW steps "
                      f"{cc['adamw_loss_rel_diff']:.1e}."]
    lines += _gpt_peer_lines(results.get("peers", {}).get("gpt2", {}))
    if "kernels" in results:
        lines += kernels.markdown_lines(results["kernels"])
    if "gpt_small" in results:
        lines += gpt_small.markdown_lines(results["gpt_small"])
    coll = results.get("collective_overhead", {})
    kinds = tuple(COLLECTIVE_KEYS)
    rows = [(n, v) for n, v in coll.items() if isinstance(v, dict) and "rows" in v]
    if rows:
        lines += ["", "Collectives: engine time over raw mpi4py time on the same input "
                  "(1.0 = no overhead; median of 5 trials on fresh buffers, 7 from 1 MiB); "
                  "`all_reduce_out` "
                  "passes the raw call's own output buffer as `out=`, the others return a "
                  "result the engine allocates (all_gather) or reuses from its pool. From "
                  "1 MiB a second figure: the raw call's non-blocking form waited by a bare "
                  "`while not req.Test(): sched_yield()` loop, over the raw call (`bounded`, "
                  "the floor of any wait that can time out; benchmarks/collectives.py):", "",
                  "| ranks | size | " + " | ".join(kinds) + " |",
                  "| --- | --- | " + " | ".join("---" for _ in kinds) + " |"]
        for n, v in rows:
            sizes = sorted({r["bytes"] for r in v["rows"]})
            for b in sizes:
                if b < 1024 * 1024 and b not in (1024, 64 * 1024):
                    continue
                cells = {r["kind"]: _fmt(r["ratio"]) + (f" / {r['bounded_ratio']:.3f}"
                                                         if "bounded_ratio" in r else "")
                         for r in v["rows"] if r["bytes"] == b}
                size = f"{b // 1024 // 1024} MiB" if b >= 1024 * 1024 else f"{b // 1024} KiB"
                lines.append(f"| {n} | {size} | "
                             + " | ".join(cells.get(k, "-") for k in kinds) + " |")
    worst = coll.get("worst", {})
    if worst:
        lines += ["", "Worst at >= 1 MiB (median of trials, trials' range): " + "; ".join(
            f"{w['kind']} {w['ratio']:.3f} ({w['spread'][0]:.3f}-{w['spread'][1]:.3f}) at "
            f"{w['ranks']} ranks, {w['bytes'] // MIB} MiB"
            + (f", bounded floor {w['bounded_ratio']:.3f}" if w.get("bounded_ratio") else "")
            for w in worst.values()) + "."]
    lines += _planner_lines(results.get("planner", {}))
    sc = results.get("scaling", {})
    pp = sc.get("pp", {})
    if "gpipe" in pp:
        lines += ["", f"Pipeline, pp={pp['ranks']}, {pp['microbatches']} microbatches, "
                  f"MLP {pp['dims'][0]}x{len(pp['dims']) - 1} layers, batch {pp['batch']}; "
                  "bubble measured by the engine (median over the timed steps, their range), "
                  "simulated from the last step's mean F/B/W, and the schedule's own (unit "
                  "times):", "",
                  "| schedule | step ms | vs GPipe | peak stashed | peak activation KiB | "
                  "bubble measured | simulated | schedule |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for name in ("gpipe", "1f1b", "interleaved", "zb1p"):
            if name not in pp:
                continue
            s = pp[name]
            bubble = "- | - | -" if "bubble_measured" not in s else (
                f"{s['bubble_measured']:.3f} ({s['bubble_measured_range'][0]:.3f}-"
                f"{s['bubble_measured_range'][1]:.3f}) | {s['bubble_simulated']:.3f} | "
                f"{s['bubble_schedule']:.3f}")
            lines.append(f"| {name} | {s['step_s'] * 1e3:.1f} | {s['vs_gpipe_time']:.2f} | "
                         f"{s['peak_stashed']} | {s['peak_activation_bytes'] / 1024:.0f} | "
                         f"{bubble} |")
        if "zb1p_bubble_ratio" in pp:
            lines += ["", f"zb1p bubble over 1F1B's: measured {pp['zb1p_bubble_ratio']:.3f}, "
                      f"simulated {pp['zb1p_bubble_ratio_simulated']:.3f}."]
    elif pp:
        lines += ["", f"Pipeline: {pp.get('skipped') or pp.get('error')}"]
    return "\n".join(lines) + "\n"


def _gpt_peer_lines(gpt2: dict) -> list:
    """results.md's table of the GPT at 2 ranks against PyTorch's distributed peers."""
    if "peers" not in gpt2:
        return []
    m = gpt2["model"]
    lines = ["", f"GPT at {gpt2['ranks']} ranks against PyTorch {gpt2['torch_version']}'s "
             f"distributed peers (benchmarks/peers_torch.py gpt2; vocab {m['vocab_size']}, "
             f"d_model {m['d_model']}, {m['n_heads']} heads, {m['n_layers']} layers, seq "
             f"{m['seq_len']}, global batch {m['batch']}, float32, "
             f"{gpt2['threads_per_rank']} thread per rank, {gpt2['optimizer']}; torch over "
             f"{gpt2['backend']} in the same mpiexec job; a sample is a full step, the slowest "
             f"rank's, every side alternated; median of {gpt2['samples']}). Before timing, each "
             "torch peer's gradients and the first steps' losses of both sides are compared "
             "with torch in one process (relative differences; `single`: each rank alone on "
             "its rows, no communication, the compute inside dp and fsdp):", "",
             "| ours | torch | ours ms | torch ms | ours / torch | paired | loss: ours | "
             "loss: torch | grads: torch |", "| --- | --- | --- | --- | --- | --- | --- | "
             "--- | --- |"]
    for r in gpt2["peers"].values():
        lines.append(f"| `{r['layout']}` | {r['torch']} | {r['ours_s'] * 1e3:.1f} | "
                     f"{r['torch_s'] * 1e3:.1f} | {r['ratio']:.3f} | {r['ratio_paired']:.3f} | "
                     f"{r['ours_loss_rel_diff']:.1e} | {r['torch_loss_rel_diff']:.1e} | "
                     f"{_fmt(r['torch_max_grad_rel_diff'], '.1e')} |")
    return lines


def _planner_lines(planner: dict) -> list:
    """results.md's planner table: one row per model validated."""
    models = planner.get("models", {})
    if not models:
        return []
    lines = ["", f"Planner at {planner['ranks']} ranks (`plan --validate K --json`; error: "
             "|predicted - measured| / measured, median over the layouts; gap: how much "
             "slower the predicted best ran than the measured best; drift: the reference "
             "GEMMs' rate during validation over their calibrated rate):", "",
             "| model | batch | layouts | median abs error | error / drift | predicted best | "
             "gap | drift |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in models.items():
        v = m.get("validate")
        if not v:
            why = str(m.get("error", "not measured")).replace("|", "/")[:160]
            lines.append(f"| {name} | - | {why} | - | - | - | - | - |")
            continue
        scaled = v.get("median_abs_error_drift_scaled")
        lines.append(f"| {name} `{m['model_flag']}` | {m['batch']} | "
                     f"{len(v['layouts'])} | {100 * v['median_abs_error']:.1f}% | "
                     f"{'-' if scaled is None else f'{100 * scaled:.1f}%'} | "
                     f"`{v['predicted_best']}` | {100 * v['best_gap']:.1f}% | "
                     f"{_fmt(v.get('drift'), 2)} |")
    cal = planner.get("calibration") or {}
    factors = [name for name in ("step_factor", "optimizer_factor") if cal.get(name)]
    if factors:
        def described(name):
            spread = cal.get(name + "_range", {})
            return f"{name} " + ", ".join(
                f"{kind} {f:.3f}" + (f" (its three timings {spread[kind][0]:.3f}-"
                                     f"{spread[kind][1]:.3f})" if kind in spread else "")
                for kind, f in cal[name].items())
        lines += ["", "Calibration: " + "; ".join(described(n) for n in factors)
                  + f"; concurrency {_fmt(cal.get('concurrency'), 2)}."]
    return lines


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


def kept_sections(path: Path, generated: str) -> str:
    """The `## ` sections of the results.md at `path` that this run does not write (written by
    other benchmarks: serving, memory, flight sweep), kept after the generated text."""
    if not path.exists():
        return ""
    ours = set(re.findall(r"^## (.+)$", generated, re.MULTILINE))
    parts = re.split(r"^(?=## )", path.read_text(), flags=re.MULTILINE)[1:]
    kept = [s for s in parts if s.splitlines()[0][3:].strip() not in ours]
    return "".join("\n" + s.rstrip("\n") + "\n" for s in kept)


def failures(results: dict, where: str = "") -> list:
    """(path, message) of every part (or sub-run) that crashed, timed out or wrote no result
    (Runner.run's {'error': message}; a number under 'error', like the planner's prediction
    errors, is a result); a benchmark that fails makes the whole run fail."""
    found = []
    for key, value in results.items():
        if key == "error" and isinstance(value, str):
            found.append((where or "results", str(value)))
        elif isinstance(value, dict):
            found += failures(value, f"{where}.{key}" if where else key)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                if isinstance(item, dict):
                    found += failures(item, f"{where}.{key}[{i}]")
    return found


def meta(args, r: Runner, wall) -> dict:
    import numpy

    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().splitlines()[0].strip()
    except Exception as exc:      # noqa: BLE001 - informational only
        mpi = f"unknown ({exc})"
    try:
        import importlib.metadata as md

        torch_version = md.version("torch")
    except Exception:             # noqa: BLE001
        torch_version = None
    argv = sys.argv[1:] if args.argv is None else args.argv
    cmd = " ".join(["python benchmarks/run_all.py"] + [shlex.quote(a) for a in argv])
    return {"commit": git_commit(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "numpy": numpy.__version__, "mpi": mpi,
            "torch": torch_version, "mode": r.mode, "parts": args.parts,
            "threads_per_rank": int(r.env["OMP_NUM_THREADS"]),
            "blas": r.run([sys.executable, HERE / "kernels.py"], timeout=300).get("blas"),
            "kernel_vars_removed": {
                k: os.environ[k] for k in kernels.KERNEL_VARS if k in os.environ},
            "mpiexec": args.mpiexec, "command": cmd, "wall_s": wall, "runs": r.log}


def git_commit() -> str:
    """HEAD's hash, '-dirty' when tracked files differ from it; 'unknown' outside git."""
    def git(*argv):
        return subprocess.run(["git", *argv], cwd=HERE.parent, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


if __name__ == "__main__":
    sys.exit(main())

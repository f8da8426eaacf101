"""results.md and the run's verdict from make bench's results (benchmarks/run_all.py): the
headline figures and their targets, the table of them (the detail tables: bench_tables.py),
the sections of results.md other benchmarks wrote, kept, and the parts that failed.
"""
from __future__ import annotations

import re
from pathlib import Path

import kernels
from bench_parts import COLLECTIVE_KEYS
from bench_tables import fmt, detail_lines

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
PART_OF = {**{k: "collective_overhead" for k in COLLECTIVE_KEYS.values()},
           "mfu_fraction": "mfu", "vs_torch_single_step_ratio": "peers",
           "vs_torch_ddp2_step_ratio": "peers", "vs_torch_ddp_gpt_step_ratio": "peers",
           "vs_torch_fsdp_gpt_step_ratio": "peers", "vs_torch_tp_gpt_step_ratio": "peers",
           "gpt_mfu_fraction": "gpt",
           "vs_torch_gpt_step_ratio": "gpt", "gpt_vs_torch_step_ratio": "gpt",
           "planner_median_error": "planner", "planner_best_gap": "planner",
           "zb1p_bubble_ratio": "scaling"}     # headline key -> its part's results key


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
        cell = fmt(v) + (f" ({fmt(spread[key][0])}-{fmt(spread[key][1])})"
                          if key in spread else "")
        lines.append(f"| `{key}` | {cell} | {cmp} {target} | "
                     f"{'yes' if _met(v, cmp, target) else 'no'} |")
    for key in ("gpt2_small_mfu_fraction", "dp_1_to_2_efficiency", "tp2_speedup"):
        if key in h:
            lines.append(f"| `{key}` | {fmt(h[key])} | - | - |")
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
    return "\n".join(lines + detail_lines(results)) + "\n"


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


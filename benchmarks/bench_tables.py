"""results.md's detail tables (bench_report.markdown puts them under the headline table):
MFU sizes, the GPT against PyTorch, the kernels, GPT-2-small, collectives, the planner and
the pipeline schedules.
"""
from __future__ import annotations

import gpt_small
import kernels
from bench_parts import COLLECTIVE_KEYS, MIB


def fmt(v, digits=3):
    """A number for results.md: `digits` decimals, or a format spec such as '.1e'."""
    spec = digits if isinstance(digits, str) else f".{digits}f"
    return "-" if v is None else f"{v:{spec}}" if isinstance(v, float) else str(v)



def detail_lines(results: dict) -> list:
    """The lines of every detail table the results hold, in results.md's order."""
    lines = []
    mfu = results.get("mfu", {})
    if mfu.get("sizes"):
        lines += ["", "MFU (float32 train_step GFLOP/s over matmul GFLOP/s, one rank):", "",
                  "| MLP dims | batch | mfu_fraction |", "| --- | --- | --- |"]
        for s in mfu["sizes"]:
            v = fmt(s["mfu_fraction"]) if "mfu_fraction" in s else \
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
                  f"{g['mfu_fraction_paired']:.3f})"
                  + (f"; host heap: {g['host_heap']}." if "host_heap" in g else ".")]
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
                cells = {r["kind"]: fmt(r["ratio"]) + (f" / {r['bounded_ratio']:.3f}"
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
    return lines


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
                     f"{fmt(r['torch_max_grad_rel_diff'], '.1e')} |")
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
                     f"{fmt(v.get('drift'), 2)} |")
    cal = planner.get("calibration") or {}
    factors = [name for name in ("step_factor", "optimizer_factor", "mesh_factor")
               if cal.get(name)]
    if factors:
        def described(name):
            spread = cal.get(name + "_range", {})
            return f"{name} " + ", ".join(
                f"{kind} {f:.3f}" + (f" (its three timings {spread[kind][0]:.3f}-"
                                     f"{spread[kind][1]:.3f})" if kind in spread else "")
                for kind, f in cal[name].items())
        lines += ["", "Calibration: " + "; ".join(described(n) for n in factors)
                  + f"; concurrency {fmt(cal.get('concurrency'), 2)}."]
    return lines


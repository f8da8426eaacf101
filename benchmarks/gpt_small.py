"""gpt_mfu_fraction of a GPT-2-small-shaped step at one rank, and where its time goes.

    python benchmarks/gpt_small.py [--quick | --tiny] [--json out.json]

The model is GPT-2 small's shape (vocab 50257, d_model 768, 12 heads, 12 layers) on one
sequence of 256 tokens (a quarter of its 1024 context: a step takes seconds on one core
already, and the samples are many), float32, one thread. As benchmarks/gpt.py measures the
issue's small GPT: our train_step (forward, cross-entropy, backward) and the same GEMMs as
plain `a @ b`, alternated sample by sample; gpt_mfu_fraction = t_matmul / t_step, and the
step with AdamW's update after it.

Then a cProfile of a few steps with AdamW: the time spent inside each function itself
(tottime: numpy's operators and ufuncs land in the function that calls them, GEMMs included),
the largest first, as shares of the profiled time. Under the profiler every Python call
costs more, so the shares are a guide to where the non-GEMM time goes, not a measurement.
"""
from __future__ import annotations

import argparse
import cProfile
import os
import pstats

import gpt
from _common import write_json

SIZES = {  # vocab, seq_len, d_model, n_heads, n_layers, batch
    "full": dict(vocab_size=50257, seq_len=256, d_model=768, n_heads=12, n_layers=12,
                 batch=1),
    "quick": dict(vocab_size=50257, seq_len=128, d_model=768, n_heads=12, n_layers=12,
                  batch=1),
    "tiny": dict(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=2, batch=2),
}
TOP = 15            # functions listed in the profile


def profile(size, steps=2) -> dict:
    """{'profiled_s', 'steps', 'top': [{function, tottime_s, share, calls}]} (module
    docstring) of `steps` steps with AdamW after one untimed step."""
    model, params, x, t = gpt.problem(size)
    _, ours_adamw = gpt.closures(None, model, params, x, t, "sdpa")[:2]
    ours_adamw()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(steps):
        ours_adamw()
    pr.disable()
    stats = pstats.Stats(pr).stats
    total = sum(row[2] for row in stats.values())
    rows = sorted(((row[2], row[1], f"{os.path.basename(fn)}:{line}({name})")
                   for (fn, line, name), row in stats.items()), reverse=True)[:TOP]
    return {"profiled_s": total, "steps": steps,
            "top": [{"function": where, "tottime_s": tt, "share": tt / total, "calls": calls}
                    for tt, calls, where in rows]}


def measure(mode: str) -> dict:
    size = SIZES[mode]
    samples = {"full": 5, "quick": 5, "tiny": 2}[mode]
    res = gpt.measure(size, samples, warmup=1, with_torch=False)
    res.pop("torch", None)
    res["gpt_mfu_fraction"] = res["mfu_fraction"]
    res["ours_adamw_over_matmul"] = res["matmul_s"] / res["ours_adamw_s"]
    res["profile"] = profile(size, steps=1 if mode == "tiny" else 2)
    return res


def markdown_lines(res: dict) -> list:
    """results.md's section for run_all.py."""
    head = ["", "## GPT-2-small-shaped step at one rank", ""]
    if "gpt_mfu_fraction" not in res:
        return head + [str(res.get("error") or res.get("skipped") or "not measured")]
    m = res["model"]
    lines = head + [
        f"benchmarks/gpt_small.py: vocab {m['vocab_size']}, seq {m['seq_len']}, d_model "
        f"{m['d_model']}, {m['n_heads']} heads, {m['n_layers']} layers, batch {m['batch']}, "
        f"float32, one thread: {res['gflop_per_step']:.0f} GFLOP per step; plain matmul on "
        f"the same GEMMs {res['matmul_gflops']:.1f} GFLOP/s, ours {res['ours_gflops']:.1f}: "
        f"`gpt_mfu_fraction` {res['gpt_mfu_fraction']:.3f} (paired "
        f"{res['mfu_fraction_paired']:.3f}; median of {res['samples']}); with AdamW's update "
        f"the step keeps {res['ours_adamw_over_matmul']:.3f} of the matmul rate.", "",
        f"Where the step with AdamW goes (cProfile, {res['profile']['steps']} steps, time "
        "inside each function itself, numpy's operators and GEMMs counted in their caller):",
        "", "| function | share | calls |", "| --- | --- | --- |"]
    for row in res["profile"]["top"]:
        lines.append(f"| `{row['function']}` | {100 * row['share']:.1f}% | {row['calls']} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a sequence of 128 tokens")
    p.add_argument("--tiny", action="store_true", help="a toy size for the smoke test")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    res = measure("tiny" if args.tiny else "quick" if args.quick else "full")
    print(f"gpt_mfu_fraction={res['gpt_mfu_fraction']:.3f} (paired "
          f"{res['mfu_fraction_paired']:.3f}), with AdamW {res['ours_adamw_over_matmul']:.3f}")
    for row in res["profile"]["top"]:
        print(f"{100 * row['share']:5.1f}%  {row['calls']:6d}  {row['function']}")
    write_json(args.json, res)


if __name__ == "__main__":
    main()

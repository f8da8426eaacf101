"""The GPU check's parts beyond the reference tests and the step benchmarks (gpu_check.py).

kernels      benchmarks/gpu_kernels_check.py: every hand-written cupy kernel compiled, run
             against its xp path (float64 rtol 1e-12; 16 bits within its stated tolerance)
             and timed beside it. Skipped on the stand-in, which cannot run CUDA C.
autocast     (in gpu_check.py) tests/hf/test_autocast_torch.py against torch.autocast
cudnn        benchmarks/gpu_cudnn_check.py: cuDNN's fused attention (nn/cudnn_attention.py)
             against our 16-bit kernels and a float64 reference, timed beside them; passed
             with a `cudnn_absent` row where the cudnn module does not import
nccl         benchmarks/gpu_comm_check.py at 1 rank (a size-1 NcclCommunicator smoke test)
             and 2 ranks sharing the GPU (staged all-reduce with pinned buffers beside a
             raw host Allreduce of the same size; the multi-GPU part when there are 2+ GPUs)
cli          `train`, `generate` and `bench --layout auto` of the installed CLI with --device
             gpu (the stand-in: --device cpu, the same commands), each a few seconds
profile      benchmarks/gpu_profile.py: the GPT step per unit, fused and not, the kernel
             table of ours and PyTorch's, and the host's side of our step (its JSON lines
             under profile/)

Each is `fn(check, budget) -> record`, as gpu_check.py's parts are: it raises, or returns
status "failed", when what it checks fails.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = "d_model=32,n_heads=4,n_layers=2,seq_len=32"


def bench_lines(lines):
    """The records of a part's `BENCH {json}` lines (every benchmark script prints them)."""
    return [json.loads(line[6:]) for line in lines if line.startswith("BENCH ")]


def part_kernels(check, budget):
    script = ROOT / "benchmarks" / "gpu_kernels_check.py"
    if check.standin:
        return {"status": "skipped", "why": "the stand-in cannot run CUDA C (tests/nn checks "
                "every kernel source compiles with NVRTC)"}
    if not script.exists():
        return {"status": "skipped", "why": f"{script.name} does not exist"}
    rc, lines = check.run([sys.executable, str(script)], budget)
    rows = bench_lines(lines)
    rec = {"kernels": rows}
    bad = [r for r in rows if not r.get("ok", False)]
    if rc or not rows or bad:
        rec.update(status="failed", error=f"exit {rc}; {len(bad)} of {len(rows)} kernels "
                   "failed")
    return rec


def part_cudnn(check, budget):
    script = ROOT / "benchmarks" / "gpu_cudnn_check.py"
    if check.standin:
        return {"status": "skipped", "why": "the stand-in has no cuDNN (tests/nn/"
                "test_cudnn_attention.py checks the graphs on a fake cudnn module)"}
    rc, lines = check.run([sys.executable, str(script)], budget)
    rows = bench_lines(lines)
    rec = {"rows": rows}
    if rc or not rows or not all(r.get("ok") for r in rows):
        rec.update(status="failed", error=f"exit {rc}; {len(rows)} rows")
    return rec


def part_nccl(check, budget):
    script = ROOT / "benchmarks" / "gpu_comm_check.py"
    if not script.exists():
        return {"status": "skipped", "why": f"{script.name} does not exist"}
    extra = ["--standin"] if check.standin else []
    rec = {}
    for n in (1, 2):
        rc, lines = check.run(check.mpi(n, str(script), *extra), budget / 2)
        rows = bench_lines(lines)
        rec[f"ranks{n}"] = rows
        if rc or not rows or any("error" in r for r in rows):
            rec.update(status="failed", error=f"{n} ranks: exit {rc}, {len(rows)} rows")
    return rec


def part_cli(check, budget):
    """train (checkpoint), generate from it (also with bfloat16 compute: its KV cache in 16
    bits) and bench, at 1 rank, tiny, on the device."""
    device = "cpu" if check.standin else "gpu"
    ckpt = check.out / "cli-ckpt"
    cmds = {
        "train": ["train", "--model", "gpt", "--gpt", TINY_GPT, "--steps", "4", "--batch",
                  "4", "--log-every", "2", "--no-progress", "--device", device,
                  "--checkpoint-dir", str(ckpt)],
        "train-bf16": ["train", "--model", "gpt", "--gpt", TINY_GPT, "--steps", "4",
                       "--batch", "4", "--log-every", "2", "--no-progress", "--device",
                       device, "--compute-dtype", "bfloat16"],
        "generate": ["generate", "--checkpoint", str(ckpt), "--prompt", "a", "--max-new-tokens",
                     "8", "--seed", "0", "--device", device],
        "generate-bf16": ["generate", "--checkpoint", str(ckpt), "--prompt", "a",  # a 16-bit
                          "--max-new-tokens", "8", "--seed", "0", "--device", device,  # cache
                          "--compute-dtype", "bfloat16"],
        "bench": ["bench", "--model", "gpt", "--gpt", TINY_GPT, "--steps", "3", "--device",
                  device, "--layout", "auto"]}      # its limit: the GPU's free memory
    for name in ("train", "train-bf16"):       # a bounded evaluation (the whole split took
        cmds[name] += ["--eval-batches", "8"]  # longer than the first H200 run allowed)
    rec, failed = {}, []
    end = time.monotonic() + budget
    for i, (name, args) in enumerate(cmds.items()):  # the first, cold (kernels compile), gets
        later = len(cmds) - 1 - i                     # what the later ones do not need
        rc, lines = check.run(check.mpi(1, "-m", "mpishard", *args),
                              max(end - time.monotonic() - 6 * later, 3))
        rec[name] = {"exit": rc, "tail": lines[-3:],
                     "limit": [line for line in lines if "memGetInfo" in line][:1]}
        if rc:
            failed.append(name)
    if failed:
        rec.update(status="failed", error=f"{', '.join(failed)} failed")
    return rec


def part_profile(check, budget):
    args = [sys.executable, "benchmarks/gpu_profile.py", "--out", str(check.out / "profile"),
            "--budget", str(max(budget - 20, 0.7 * budget)), "--no-exactness",
            "--compute-dtype", "bfloat16"]      # the float32 profile: the H100's, in docs
    args += ["--standin", "--samples", "2"] if check.standin else []
    rc, lines = check.run(args, budget)
    if rc:
        return {"status": "failed", "error": f"exit {rc}", "tail": lines[-5:]}
    return {"out": str(check.out / "profile"), "lines": len(lines)}

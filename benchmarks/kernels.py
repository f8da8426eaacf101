"""The BLAS kernels a benchmark ran on, and the GPT peers on both of numpy's kernels.

    python benchmarks/kernels.py                      # print what this process's BLAS is
    OPENBLAS_CORETYPE=Haswell python benchmarks/kernels.py --json out.json

Benchmarks run numpy's OpenBLAS with the kernel the CPU supports: run_all.py (and `make
bench`) remove KERNEL_VARS from every benchmark command's environment. OPENBLAS_CORETYPE forces
a kernel (Haswell's AVX2 on an AVX-512 CPU runs float32 GEMMs at about half the rate) and
OPENBLAS_L2_SIZE its blocking; an environment sets them because old OpenBLAS builds misbehave
on some processors, so tests and CI keep them: only the benchmarks' own commands drop them.

blas_info() is what each result records: numpy's BLAS as threadpoolctl reports it (library,
version, the kernel it chose: `architecture`) and PyTorch's from `torch.__config__.show()`
(threadpoolctl does not see the MKL PyTorch links statically).

part_kernels() is run_all.py's `kernels` part: benchmarks/peers_torch.py gpt2 (the GPT at 2
ranks, ours against single/DDP/FSDP2/DTensor TP) in ROUNDS rounds, each round one job on
numpy's own kernel and one with OPENBLAS_CORETYPE=Haswell forced, the two jobs' order
alternating round by round; per kernel and peer the median over rounds of each job's
ours/torch ratio (torch's MKL is the same in both: only our side's kernel changes).
"""
from __future__ import annotations

import argparse

import numpy as np

from _common import blas_info, write_json

KERNEL_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
FORCED = {"OPENBLAS_CORETYPE": "Haswell"}       # the setting the benchmarks used to run under
ROUNDS = {"full": 5, "quick": 5, "tiny": 1}
PEER_NAMES = {"local": "single (each rank alone)", "ddp": "DDP", "fsdp": "FSDP2",
              "tp": "DTensor TP"}


def true_kernel_env(env: dict) -> dict:
    """`env` without KERNEL_VARS: numpy's OpenBLAS picks the kernel the CPU supports."""
    return {k: v for k, v in env.items() if k not in KERNEL_VARS}


def describe(info: dict) -> str:
    """One line for results.md: numpy's library, version and kernel; torch's BLAS."""
    np_part = "; ".join(f"{lib['internal_api']} {lib['version']}, kernel "
                        f"{lib['architecture']}" for lib in info.get("numpy") or []) or "none"
    t = info.get("torch")
    t_part = "not installed" if not t else (
        f"{t['version']}: BLAS_INFO={t['blas_info']}, LAPACK_INFO={t['lapack_info']}"
        + (f", {t['library']}" if t.get("library") else "")
        + (f", CPU capability {t['cpu_capability']}" if t.get("cpu_capability") else ""))
    return f"numpy's BLAS: {np_part}. PyTorch's: {t_part}"


def part_kernels(r) -> dict:
    """run_all.py's `kernels` part (module docstring); `r` is run_all's Runner."""
    rounds = ROUNDS[r.mode]
    own_env = r.env
    forced_env = dict(r.env, **FORCED)
    jobs = {"own": [], "forced": []}
    for i in range(rounds):
        order = ("own", "forced") if i % 2 == 0 else ("forced", "own")
        for kernel in order:
            r.env = own_env if kernel == "own" else forced_env
            try:
                jobs[kernel].append(r.mpi(2, "peers_torch.py", "gpt2",
                                          timeout=r.args.part_timeout))
            finally:
                r.env = own_env
    out: dict = {"rounds": rounds, "forced_env": FORCED, "kernels": {}}
    for kernel, results in jobs.items():
        done = [j for j in results if "peers" in j]
        errors = [j["error"] for j in results if "error" in j]
        if errors:
            out["error"] = f"{kernel}: {errors[0]}"
        if not done:
            continue
        per_peer = {}
        for peer in done[0]["peers"]:
            ratios = [j["peers"][peer]["ratio"] for j in done]
            per_peer[peer] = {"layout": done[0]["peers"][peer]["layout"],
                              "ratio": float(np.median(ratios)), "round_ratios": ratios}
        out["kernels"][kernel] = {"blas": done[0].get("blas"), "jobs": len(done),
                                  "peers": per_peer}
    return out


def markdown_lines(res: dict) -> list:
    """results.md's section: the GPT peers' ratio on numpy's own kernel and the forced one."""
    ks = res.get("kernels", {})
    if not ks:
        return ["", "## GPT against PyTorch on both kernels", "",
                str(res.get("error") or res.get("skipped") or "not measured")]
    own, forced = ks.get("own", {}), ks.get("forced", {})

    def kernel(k):
        libs = (k.get("blas") or {}).get("numpy") or [{}]
        return libs[0].get("architecture", "?")
    lines = ["", "## GPT against PyTorch on both kernels", "",
             f"benchmarks/peers_torch.py gpt2 (as the table above) in {res['rounds']} rounds, "
             "each round one job on numpy's own kernel "
             f"({kernel(own)}) and one with OPENBLAS_CORETYPE=Haswell ({kernel(forced)}), "
             "their order alternating; ours over torch's step, the median over rounds (the "
             "rounds' range in brackets). PyTorch's MKL is the same in both jobs.", "",
             f"| peer | ours | forced Haswell kernel | numpy's own kernel ({kernel(own)}) |",
             "| --- | --- | --- | --- |"]

    def cell(k, peer):
        p = k.get("peers", {}).get(peer)
        return "-" if p is None else (f"{p['ratio']:.3f} ({min(p['round_ratios']):.3f}-"
                                      f"{max(p['round_ratios']):.3f})")
    for peer, name in PEER_NAMES.items():
        layout = (own.get("peers", {}).get(peer) or forced.get("peers", {}).get(peer)
                  or {}).get("layout", "-")
        lines.append(f"| {name} | `{layout}` | {cell(forced, peer)} | {cell(own, peer)} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    info = blas_info()
    print(describe(info))
    write_json(args.json, {"blas": info})


if __name__ == "__main__":
    main()

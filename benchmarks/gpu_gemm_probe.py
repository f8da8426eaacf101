"""What this GPU's cupy does with 16-bit and TF32 matmuls: dtypes, numerics, speed.

    python3 benchmarks/gpu_gemm_probe.py [--out probe.json]

The questions the 16-bit compute path (nn/gemm.py, nn/autocast.py Narrow) rests on, each answered by
trying it: does cupy hold ml_dtypes' bfloat16 and cast float32 to it as ml_dtypes does
(nearest even); do matmuls (2-D, batched, on transposed views) of two bfloat16 or float16
arrays run, return that dtype, and equal the emulation (inputs rounded, float32 products and
sums, output rounded) to within one unit in the last place; what cupy's compute type is for
float16 and float32 (and whether TF32 can be set); and the matmul rate of each dtype at the
GPT-2-small step's shapes beside PyTorch's. One JSON object, printed as `PROBE {...}`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import traceback

import numpy as np


def attempt(rec, name, fn):
    try:
        rec[name] = fn()
    except Exception as exc:                    # the answer is that it does not work
        rec[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
        traceback.print_exc(limit=2)


def ulps(got, want, dtype):
    """Largest distance in units of `dtype`'s last place (values already on its grid)."""
    import ml_dtypes
    eps = float(ml_dtypes.finfo(dtype).eps)
    scale = np.maximum(np.abs(want), np.finfo(np.float32).tiny)
    return float(np.max(np.abs(got - want) / (scale * eps)))


def gemm_rate(cp, a, b, reps=10):
    for _ in range(3):
        cp.matmul(a, b)
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    times = []
    for _ in range(reps):
        start.record()
        cp.matmul(a, b)
        stop.record()
        stop.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
    t = float(np.median(times))
    return 2.0 * a.shape[-2] * a.shape[-1] * b.shape[-1] * np.prod(a.shape[:-2]) / t / 1e12


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    import cupy as cp
    import ml_dtypes
    from cupy._core import _routines_linalg as linalg
    rec = {"cupy": cp.__version__, "numpy": np.__version__, "ml_dtypes": ml_dtypes.__version__}
    bf = np.dtype(ml_dtypes.bfloat16)
    rng = np.random.default_rng(0)
    x32 = rng.standard_normal((512, 384)).astype(np.float32)
    y32 = rng.standard_normal((384, 256)).astype(np.float32)

    attempt(rec, "bf16_dtype", lambda: str(cp.dtype(bf)))
    attempt(rec, "bf16_asarray", lambda: str(cp.asarray(x32.astype(bf)).dtype))

    def cast_check():
        u = rng.integers(0, 2**32, 2**22, dtype=np.uint64).astype(np.uint32)
        f = u.view(np.float32)
        f = f[np.isfinite(f)]
        got = cp.asarray(f).astype(bf).get().view(np.uint16)
        want = f.astype(bf).view(np.uint16)
        return {"tested": int(f.size), "differ": int(np.count_nonzero(got != want))}
    attempt(rec, "bf16_cast_vs_ml_dtypes", cast_check)

    def matmul_check(dtype, batched=False, transposed=False):
        a, b = x32, y32
        if batched:
            a = rng.standard_normal((4, 3, 128, 64)).astype(np.float32)
            b = rng.standard_normal((4, 3, 64, 96)).astype(np.float32)
        ad, bd = cp.asarray(a.astype(dtype)), cp.asarray(b.astype(dtype))
        if transposed:   # b given as a transposed view of its contiguous transpose
            bd = cp.ascontiguousarray(bd.swapaxes(-1, -2)).swapaxes(-1, -2)
        got = cp.matmul(ad, bd)
        want = (a.astype(dtype).astype(np.float64) @ b.astype(dtype).astype(np.float64))
        want = want.astype(np.float32).astype(dtype).astype(np.float32)
        return {"out_dtype": str(got.dtype),
                "max_ulps_vs_emulation": ulps(got.astype(cp.float32).get(), want, dtype)}
    for dname, dt in (("bf16", bf), ("fp16", np.dtype(np.float16))):
        attempt(rec, f"{dname}_matmul", lambda dt=dt: matmul_check(dt))
        attempt(rec, f"{dname}_matmul_batched", lambda dt=dt: matmul_check(dt, batched=True))
        attempt(rec, f"{dname}_matmul_transposed",
                lambda dt=dt: matmul_check(dt, batched=True, transposed=True))
    attempt(rec, "bf16_einsum", lambda: str(cp.einsum(
        "bd,df->bf", cp.asarray(x32.astype(bf)), cp.asarray(y32.astype(bf))).dtype))
    attempt(rec, "bf16_times_f32", lambda: str((cp.asarray(x32.astype(bf))
                                               * cp.asarray(x32)).dtype))
    attempt(rec, "bf16_sum", lambda: str(cp.asarray(x32.astype(bf)).sum(axis=0).dtype))
    attempt(rec, "bf16_to_f32_exact", lambda: bool((cp.asarray(x32.astype(bf)).astype(
        cp.float32).get() == x32.astype(bf).astype(np.float32)).all()))
    attempt(rec, "matmul_out_f32_from_bf16", lambda: str(cp.matmul(
        cp.asarray(x32.astype(bf)), cp.asarray(y32.astype(bf)),
        out=cp.empty((512, 256), cp.float32)).dtype))
    attempt(rec, "compute_types", lambda: {d: linalg.compute_type_to_str(
        linalg.get_compute_type(d)) for d in ("e", "f")})

    def tf32_check():
        a, b = cp.asarray(x32), cp.asarray(y32)
        full = cp.matmul(a, b).get()
        linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
        try:
            tf = cp.matmul(a, b).get()
        finally:
            linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_DEFAULT)
        return {"max_rel_diff_tf32_vs_fp32": float(np.max(np.abs(tf - full))
                                                   / np.max(np.abs(full)))}
    attempt(rec, "tf32", tf32_check)

    shapes = {"mlp_up": ((8192, 768), (768, 3072)), "lm_head": ((8192, 768), (768, 50304)),
              "attn_scores": ((96, 1024, 64), (96, 64, 1024)), "square": ((8192, 8192),
                                                                           (8192, 8192))}
    rates = {}
    for sname, (sa, sb) in shapes.items():
        row = {}
        for dname, dt in (("fp32", np.float32), ("bf16", bf), ("fp16", np.float16)):
            def one(dt=dt, sa=sa, sb=sb):
                a = cp.random.standard_normal(sa, dtype=cp.float32).astype(dt)
                b = cp.random.standard_normal(sb, dtype=cp.float32).astype(dt)
                return round(gemm_rate(cp, a, b), 1)
            attempt(row, dname, one)

        def tf32(sa=sa, sb=sb):
            linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_TF32)
            try:
                a = cp.random.standard_normal(sa, dtype=cp.float32)
                b = cp.random.standard_normal(sb, dtype=cp.float32)
                return round(gemm_rate(cp, a, b), 1)
            finally:
                linalg.set_compute_type(np.float32, linalg.COMPUTE_TYPE_DEFAULT)
        attempt(row, "tf32", tf32)

        def cast(sa=sa):
            a = cp.random.standard_normal(sa, dtype=cp.float32)
            cp.cuda.Device().synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                a.astype(bf)
            cp.cuda.Device().synchronize()
            return round(a.nbytes * 1.5 * 10 / (time.perf_counter() - t0) / 1e9, 1)
        attempt(row, "cast_f32_to_bf16_GBps", cast)
        try:
            import torch
            ta = torch.randn(sa, device="cuda", dtype=torch.bfloat16)
            tb = torch.randn(sb, device="cuda", dtype=torch.bfloat16)
            for _ in range(3):
                ta @ tb
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(10):
                ta @ tb
            torch.cuda.synchronize()
            row["torch_bf16"] = round(2.0 * np.prod(sa) * sb[-1] * 10
                                      / (time.perf_counter() - t0) / 1e12, 1)
        except Exception as exc:
            row["torch_bf16"] = {"error": str(exc)[:200]}
        rates[sname] = row
    rec["tflops"] = rates
    line = json.dumps(rec)
    print("PROBE " + line, flush=True)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(rec, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Every hand-written CUDA kernel (mpishard/nn/cuda_ops.py) on a GPU: compiled, run against the
xp path it replaces, and timed beside it.

    python3 benchmarks/gpu_kernels_check.py          # on a GPU node (gpu_check.py's `kernels`)

check_kernels(xp) -> rows, one per kernel and storage dtype. Each case draws its inputs on
the host (fixed seeds, GPT-2-small sizes: 8 x 1024 rows of d 768, the MLP's 3072; causal
attention of 4 x 12 heads, T 1024, Dh 64, forward and backward; the cross entropy on 1024
rows of the 50304 logits, a tenth of the labels ignored, the gradient scaled by 4096/3), stores
them as the dtype (bfloat16 as parallel/bf16.py's uint16 words), and compares the kernel's
outputs with the xp path run in float64 on the same (widened) values, on the device:

    each element within rtol |ref| + rtol max |ref| (test_fused's bound), rtol being
    float64    1e-12 (the sums run in another order)
    float32    1e-5: float32 arithmetic, sums over at most a few thousand terms
    bfloat16   2^-7 + 1e-5, float16 2^-10 + 1e-5: the inputs are the same 16-bit values on
               both sides, the kernel computes in float32 and rounds each output once to 16
               bits (8 / 11 significant bits: at most 2^-8 / 2^-11 of the value), the
               reference is not rounded; twice that bound (plus float32's own error) leaves
               room for an intermediate the kernel stores in 16 bits (bias+GELU's u, from
               which the backward recomputes the derivative).
    float32 outputs of a 16-bit row (statistics, parameter gradients): 1e-5.

AdamW runs on master weights only (float64, float32): the kernel does the xp path's
operations on the same rounded scalars, so it is expected bit for bit ("exact" in the row;
the assertion is the float64 / float32 tolerance). The timing compares the kernel with the
xp path in the storage dtype (float32 for a 16-bit row: what runs without the kernel), the
median of a few synchronised repetitions. Prints one `BENCH {json}` line per row (the GPU
check reads them); exit status 1 when a row fails. Imports without cupy.
"""
from __future__ import annotations

import json
import os
import sys
import time
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mpishard.models.llama.units import RMSNorm, SwiGLU  # noqa: E402
from mpishard.nn import attention as att  # noqa: E402
from mpishard.nn import cuda_ops  # noqa: E402
from mpishard.nn import functional as nn  # noqa: E402
from mpishard.nn.layers import LocalAccess  # noqa: E402
from mpishard.nn.losses import CrossEntropy  # noqa: E402
from mpishard.parallel import bf16  # noqa: E402
from mpishard.train.optim import AdamW  # noqa: E402

ROWS, D, F, VOCAB = 8 * 1024, 768, 3072, 50304
LOSS_ROWS = 1024                # rows of the cross entropy's (LOSS_ROWS, VOCAB) logits
LOSS_SCALE = 4096 / 3           # its gradient scale: a loss scale over 3 microbatches
ATT = (4, 12, 1024, 64)         # B, H, T, Dh of the attention case (causal, offset 0)
RTOL = {"float64": 1e-12, "float32": 1e-5, "bfloat16": 2.0 ** -7 + 1e-5,
        "float16": 2.0 ** -10 + 1e-5}
MODES = tuple(RTOL)
FLOOR = {"float64": 1e-300, "float32": 1e-37, "bfloat16": 1e-37, "float16": 2.0 ** -24}
"""The cross entropy's per-element floor: below the normal range (float16: the spacing of
its subnormals, where its tiny gradients lie)."""


def store(xp, host, mode):
    """A host float64 array on the device as `mode` (bfloat16: uint16 words)."""
    if mode == "bfloat16":
        return xp.asarray(bf16.words_by_ops(np, host))
    return xp.asarray(host.astype(mode))


def widened(xp, a):
    """A device array of any storage dtype as float64 (bfloat16 words exactly)."""
    if a.dtype == np.uint16:
        return bf16.float32_by_ops(xp, a).astype(xp.float64)
    return a.astype(xp.float64)


def layernorm_kernel(xp, x, scale, shift, dy):
    y, mean, rstd = cuda_ops.layernorm_forward(xp, x, scale, shift, nn.LN_EPS)
    return (y, rstd) + cuda_ops.layernorm_backward(xp, dy, x, scale, mean, rstd)


def layernorm_ref(xp, x, scale, shift, dy):
    y, saved = nn.layernorm_forward(x, scale, shift)
    return (y, saved[1][..., 0]) + nn.layernorm_backward(dy, saved, scale)


def rmsnorm_kernel(xp, x, scale, dy):
    y, rstd = cuda_ops.rmsnorm_forward(xp, x, scale, 1e-6)
    return (y,) + cuda_ops.rmsnorm_backward(xp, dy, x, scale, rstd)


def rmsnorm_ref(xp, x, scale, dy):
    s = SimpleNamespace(params={"n/scale": scale}, grads={"n/scale": xp.zeros_like(scale)})
    unit = RMSNorm(LocalAccess(s), "n", 1e-6)
    y = unit.forward(x)
    return y, unit.backward(dy), s.grads["n/scale"]


def gelu_kernel(xp, z, bias, dy):
    y, u = cuda_ops.bias_gelu_forward(xp, z, bias)
    return y, cuda_ops.gelu_backward(xp, dy, u)


def gelu_ref(xp, z, bias, dy):
    y, dydz = nn.gelu_forward(z + bias)
    return y, nn.gelu_backward(dy, dydz)


def swiglu_kernel(xp, a, dy):
    return cuda_ops.swiglu_forward(xp, a), cuda_ops.swiglu_backward(xp, dy, a)


def swiglu_ref(xp, a, dy):
    unit = SwiGLU()
    y = unit.forward(a)
    return y, unit.backward(dy)


def residual_kernel(xp, h, b):
    return (cuda_ops.residual_add(xp, h.copy(), b),)


def residual_ref(xp, h, b):
    out = h.copy()
    out += b.astype(h.dtype)
    return (out,)


def embedding_kernel(xp, dy, ids):
    return (cuda_ops.embedding_backward(xp, dy, ids, VOCAB),)


def embedding_ref(xp, dy, ids):
    return (nn.embedding_backward(dy, ids, VOCAB),)


def attention_kernel(xp, q, k, v, dout):
    out, lse = cuda_ops.attention_forward(xp, q, k, v, offset=0)
    return (out, lse) + cuda_ops.attention_backward(xp, dout, q, k, v, out, lse, offset=0)


def attention_ref(xp, q, k, v, dout):
    out, lse = att.attention_block(q, k, v, offset=0)
    return (out, lse) + att.attention_block_backward(dout, q, k, v, out, lse, offset=0)


def loss_kernel(xp, y, t):
    keep = t != -100
    n = keep.sum()
    rows, g = cuda_ops.cross_entropy(xp, y, xp.where(keep, t, 0), keep, n, LOSS_SCALE)
    return -rows.sum() / n, g


def bad_labels_give_nan(xp, y) -> bool:
    """The loss kernel on labels outside [0, C) in rows 1 (C) and 2 (-5): those rows' loss
    and gradient are nan (no read outside the row), row 0's finite."""
    t = xp.zeros(y.shape[0], dtype=xp.int64)
    t[1], t[2] = y.shape[1], -5
    keep = xp.ones(y.shape[0], dtype=bool)
    rows, g = cuda_ops.cross_entropy(xp, y, t, keep, xp.asarray(float(y.shape[0])), 1.0)
    g = widened(xp, g)
    return bool(xp.isnan(rows[1:3]).all() and xp.isnan(g[1:3]).all()
                and xp.isfinite(rows[0]) and xp.isfinite(g[0]).all())


def loss_ref(xp, y, t):
    value, dy = CrossEntropy().pair(y, t)
    return xp.asarray(value), dy * LOSS_SCALE


def cases(rng):
    """name -> (host inputs, names stored in the mode, kernel(xp, *a), xp path(xp, *a))."""
    x, dy = rng.standard_normal((ROWS, D)) * 2 + 0.3, rng.standard_normal((ROWS, D))
    scale, shift = 1 + 0.1 * rng.standard_normal(D), 0.1 * rng.standard_normal(D)
    z, bias, dz = 3 * rng.standard_normal((ROWS, F)), rng.standard_normal(F), rng.standard_normal(
        (ROWS, F))
    a, da = 3 * rng.standard_normal((ROWS, 2 * F)), rng.standard_normal((ROWS, F))
    ids = rng.integers(0, VOCAB, ROWS)
    ids[:512] = 7                                              # a long run of one token
    qkvd = {n: rng.standard_normal(ATT) for n in ("q", "k", "v", "dout")}
    logits, labels = 3 * rng.standard_normal((LOSS_ROWS, VOCAB)), rng.integers(0, VOCAB,
                                                                                LOSS_ROWS)
    labels[::10] = -100
    return {
        "layernorm": ({"x": x, "scale": scale, "shift": shift, "dy": dy}, "x scale shift dy",
                      layernorm_kernel, layernorm_ref),
        "rmsnorm": ({"x": x, "scale": scale, "dy": dy}, "x scale dy", rmsnorm_kernel,
                    rmsnorm_ref),
        "bias_gelu": ({"z": z, "bias": bias, "dy": dz}, "z bias dy", gelu_kernel, gelu_ref),
        "swiglu": ({"a": a, "dy": da}, "a dy", swiglu_kernel, swiglu_ref),
        "residual_add": ({"h": x, "branch": dy}, "branch", residual_kernel, residual_ref),
        "embedding_bwd": ({"dy": dy, "ids": ids}, "dy", embedding_kernel, embedding_ref),
        "attention": (qkvd, "q k v dout", attention_kernel, attention_ref),
        "cross_entropy": ({"y": logits, "t": labels}, "y", loss_kernel, loss_ref),
    }


def seconds(xp, fn, reps=5):
    fn()
    xp.cuda.Device().synchronize()
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        xp.cuda.Device().synchronize()
        out.append(time.perf_counter() - t0)
    return float(np.median(out))


def compare(xp, got, want, rtol, floor=None):
    """(ok, largest difference / largest magnitude) of each output pair, widened; a float32
    output is held to float32's 1e-5 even in a 16-bit row. floor: each element within rtol
    of itself plus `floor` (the loss's gradient, mostly tiny entries beside a few large
    ones: rtol of the largest would let them all go), not plus rtol of the largest."""
    worst, ok = 0.0, True
    for g, w in zip(got, want):
        rtol_g = min(rtol, RTOL["float32"]) if g.dtype == np.float32 else rtol
        g, w = widened(xp, g).reshape(w.shape), w.astype(xp.float64)
        scale = float(xp.abs(w).max()) or 1.0
        err = xp.abs(g - w)
        slack = rtol_g * scale if floor is None else floor
        ok &= bool((err <= rtol_g * xp.abs(w) + slack).all())
        worst = max(worst, float(err.max()) / scale)
    return ok, worst


def adamw_rows(xp, rng, report):
    shapes = [(D, 3 * D), (3 * D,), (D, D), (D,), (D, F), (F,), (F, D), (D,)] * 2
    lr, betas, eps, wd = 3e-4, (0.9, 0.95), 1e-8, 0.1
    rows = []
    for mode in ("float64", "float32"):
        try:
            row = adamw_row(xp, rng, mode, shapes, lr, betas, eps, wd)
        except Exception as exc:                        # reported, the other rows still run
            row = dict(kernel="adamw", dtype=mode, ok=False, error=f"{type(exc).__name__}: {exc}")
        report(row)
        rows.append(row)
    return rows


def adamw_row(xp, rng, mode, shapes, lr, betas, eps, wd):
    """Two steps of the kernel and of AdamW.update (the real method, on a stand-in self)."""
    host = [[rng.standard_normal(s).astype(mode) for _ in range(3)] for s in shapes]
    mine = [[xp.asarray(p), xp.asarray(g), xp.zeros(p.shape, mode), xp.zeros(p.shape, mode)]
            for p, g, _ in host]
    ref = [[xp.asarray(p), xp.asarray(g)] for p, g, _ in host]
    opt = SimpleNamespace(xp=xp, betas=betas, eps=eps, weight_decay=wd, lr=lr, state={})
    opt.moments, opt.apply = partial(AdamW.moments, opt), partial(AdamW.apply, opt)
    for t in (1, 2):
        cuda_ops.adamw_step(xp, [tuple(b) + (t,) for b in mine], lr, betas, eps, wd)
        for k, (p, g) in enumerate(ref):
            AdamW.update(opt, k, p, g)
    got = [b[0] for b in mine] + [b[2] for b in mine] + [b[3] for b in mine]
    want = ([p for p, _ in ref] + [opt.state[k]["exp_avg"] for k in range(len(ref))]
            + [opt.state[k]["exp_avg_sq"] for k in range(len(ref))])
    ok, worst = compare(xp, got, want, RTOL[mode])
    exact = all(bool((a == b).all()) for a, b in zip(got, want))
    t_k = seconds(xp, lambda: cuda_ops.adamw_step(
        xp, [tuple(b) + (3,) for b in mine], lr, betas, eps, wd))
    t_x = seconds(xp, lambda: [AdamW.update(opt, k, p, g) for k, (p, g) in enumerate(ref)])
    return dict(kernel="adamw", dtype=mode, ok=ok, exact=exact, max_rel_diff=worst,
                rtol=RTOL[mode], kernel_s=t_k, xp_s=t_x, speedup=t_x / t_k, tensors=len(shapes))


def check_kernels(xp, report=lambda row: None) -> list:
    """Rows {kernel, dtype, ok, max_rel_diff, rtol, kernel_s, xp_s, speedup} for every kernel
    and storage dtype (module docstring); a row with `error` where one raised. report(row) is
    called as each row ends (a cut-off run still says what it did)."""
    rng = np.random.default_rng(0)
    fused_was = os.environ.get("MPISHARD_FUSED")
    os.environ["MPISHARD_FUSED"] = "0"              # the xp path: plain xp ops, no fused.py
    try:
        rows = kernel_rows(xp, rng, report) + adamw_rows(xp, rng, report)
    finally:
        if fused_was is None:
            os.environ.pop("MPISHARD_FUSED")
        else:
            os.environ["MPISHARD_FUSED"] = fused_was
    return rows


def kernel_rows(xp, rng, report) -> list:
    rows = []
    for name, (host, stored, kernel, ref) in cases(rng).items():
        for mode in MODES:
            row = dict(kernel=name, dtype=mode, rtol=RTOL[mode])
            try:
                a = [store(xp, v, mode) if k in stored.split() else xp.asarray(v)
                     for k, v in host.items()]
                if name == "residual_add":              # the stream h is A-typed, float32 or 64
                    a[0] = xp.asarray(host["h"].astype(cuda_ops.acc_dtype(a[1].dtype)))
                ref_in = [widened(xp, v) if v.dtype.kind in "fu" and k not in ("ids", "t") else v
                          for k, v in zip(host, a)]
                row["ok"], row["max_rel_diff"] = compare(
                    xp, kernel(xp, *a), ref(xp, *ref_in), RTOL[mode],
                    FLOOR[mode] if name == "cross_entropy" else None)
                if name == "cross_entropy":
                    row["bad_labels_nan"] = bad_labels_give_nan(xp, a[0])
                    row["ok"] = row["ok"] and row["bad_labels_nan"]
                fast = [widened(xp, v).astype(xp.float32) if v.dtype.itemsize == 2 else v
                        for v in a]
                row["kernel_s"] = seconds(xp, lambda: kernel(xp, *a))
                row["xp_s"] = seconds(xp, lambda: ref(xp, *fast))
                row["speedup"] = row["xp_s"] / row["kernel_s"]
            except Exception as exc:                    # reported, the other rows still run
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}")
            report(row)
            rows.append(row)
    return rows


def main() -> int:
    try:
        import cupy
    except ImportError:
        print("gpu_kernels_check: needs cupy and a GPU (on the CPU: tests/nn/test_cuda_kernels.py "
              "and tests/gpu/test_gpu_kernels_check.py)", file=sys.stderr)
        return 2
    rows = check_kernels(cupy, lambda row: print("BENCH " + json.dumps(row), flush=True))
    return 0 if rows and all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())

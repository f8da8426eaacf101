"""cuDNN's fused attention (nn/cudnn_attention.py) on a GPU, against our own 16-bit kernels
and a float64 reference, timed beside them.

    python3 benchmarks/gpu_cudnn_check.py          # on a GPU node (gpu_check.py's `cudnn`)

For bfloat16 and float16, causal attention at a small shape and at GPT-2-small's (B 8, H 12,
T 1024, Dh 64): q, k, v drawn on the host (fixed seed), stored in the 16-bit dtype, dout in
float32 (what merge_heads_backward hands over). Three runs on the same values:

    reference  nn/attention.py's xp path in float64 on the widened 16-bit inputs
    ours       attention.causal_attention_forward/backward under a Narrow cast with
               MPISHARD_CUDNN=0 (nn/fused_low.py's softmax kernels, cuBLAS products)
    cudnn      the same calls with the switch on: cuDNN's flash kernels

Each output's error is max |got - reference| / max |reference| (out, dq, dk, dv; lse: the
largest absolute difference). A row is ok when cuDNN ran (the forward's out is 16-bit and
nothing was refused) and every cuDNN error is within TOL, 8 ulps of the dtype (the GPU check's
layouts-16 tolerance), or within twice ours. `ms_ours`, `ms_cudnn`: forward plus backward, the
median of 5 synchronised repetitions. Prints one `BENCH {json}` line per row; exit status 1
when a row fails, 0 with a `cudnn_absent` row where the module does not import.
"""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_kernels_check import seconds  # noqa: E402
from mpishard.nn import attention as att  # noqa: E402
from mpishard.nn import cudnn_attention as cda  # noqa: E402
from mpishard.nn.autocast import Narrow  # noqa: E402

SHAPES = [(2, 4, 128, 64), (8, 12, 1024, 64)]
ULP = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11}


def emit(row):
    print("BENCH " + json.dumps(row), flush=True)


def inputs(xp, shape, dtype, seed=0):
    import ml_dtypes
    low = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float16)
    rng = np.random.default_rng(seed)
    q, k, v = (xp.asarray(rng.standard_normal(shape).astype(np.float32)).astype(low)
               for _ in range(3))
    dout = xp.asarray(rng.standard_normal(shape).astype(np.float32))
    return q, k, v, dout, low


def both_ways(q, k, v, dout, cast):
    out, lse = att.causal_attention_forward(q, k, v, cast=cast)
    grads = att.causal_attention_backward(dout, q, k, v, out, lse, cast=cast)
    return (out, lse) + tuple(grads)


def with_switch(value, fn):
    before = os.environ.get(cda.SWITCH)
    os.environ[cda.SWITCH] = value
    try:
        return fn()
    finally:
        if before is None:
            os.environ.pop(cda.SWITCH)
        else:
            os.environ[cda.SWITCH] = before


def errors(xp, got, ref):
    names = ("out", "lse", "dq", "dk", "dv")
    err = {}
    for n, g, r in zip(names, got, ref):
        d = xp.abs(g.astype(np.float32).astype(np.float64) - r)
        if n == "lse":
            err[n] = float(d.max())
        else:
            err[n] = float(d.max()) / max(float(xp.abs(r).max()), 1e-30)
    return err


def row(xp, shape, dtype):
    q, k, v, dout, low = inputs(xp, shape, dtype)
    cast = Narrow(low)
    wide = [a.astype(np.float32).astype(np.float64) for a in (q, k, v, dout)]
    out, lse = att.attention_block(*wide[:3], offset=0)
    ref = (out, lse) + tuple(att.attention_block_backward(wide[3], *wide[:3], out, lse,
                                                          offset=0))
    ours = with_switch("0", lambda: both_ways(q, k, v, dout, cast))
    cda.refusals.clear()
    mine = with_switch("1", lambda: both_ways(q, k, v, dout, cast))
    ran = mine[0].dtype == low and not cda.refusals
    e_ours, e_cudnn = errors(xp, ours, ref), errors(xp, mine, ref)
    tol = 8 * ULP[dtype]
    within = {n: e_cudnn[n] <= max(tol, 2 * e_ours[n]) for n in e_cudnn}
    rec = dict(check="cudnn_attention", dtype=dtype, shape=list(shape), cudnn_ran=ran,
               refusals=sorted(set(cda.refusals.values()))[:2], tol=tol,
               err_ours=e_ours, err_cudnn=e_cudnn, within=within,
               ms_ours=1e3 * with_switch("0", lambda: seconds(
                   xp, lambda: both_ways(q, k, v, dout, cast))),
               ms_cudnn=1e3 * with_switch("1", lambda: seconds(
                   xp, lambda: both_ways(q, k, v, dout, cast))))
    rec["speedup"] = rec["ms_ours"] / rec["ms_cudnn"]
    rec["ok"] = bool(ran and all(within.values()))
    return rec


def main() -> int:
    try:
        import cupy
    except ImportError:
        print("gpu_cudnn_check: needs cupy and a GPU", file=sys.stderr)
        return 2
    cudnn = cda.load()
    if cudnn is None:
        try:
            import cudnn as _  # noqa: F401   the reason, for the log
            why = "imported now, not before"
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        emit(dict(check="cudnn_absent", ok=True, why=why))
        return 0
    emit(dict(check="cudnn_module", ok=True, version=getattr(cudnn, "__version__", "?"),
              backend=int(cudnn.backend_version())))
    ok = True
    for dtype in ("bfloat16", "float16"):
        for shape in SHAPES:
            try:
                rec = row(cupy, shape, dtype)
            except Exception as exc:              # reported; the other rows still run
                rec = dict(check="cudnn_attention", dtype=dtype, shape=list(shape), ok=False,
                           error=f"{type(exc).__name__}: {exc}")
            emit(rec)
            ok &= rec["ok"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Where a GPT train step's time goes on one GPU: the step, each unit, PyTorch's kernels.

    python3 benchmarks/gpu_profile.py [--out DIR] [--budget 240] [--samples 5]
    python3 benchmarks/gpu_profile.py --standin ...   the same code on the CPU stand-in, tiny

One process, no mpiexec (MPI.COMM_SELF; mpi4py's singleton). The model is benchmarks/gpu.py's
(ms.GPT vocab 50304, seq 1024, d_model 768, 12 heads, 12 layers, batch 8; TINY on the
stand-in). Each record prints as `PROFILE {json}` when measured and is appended to
DIR/gpu_profile.jsonl (DIR: --out, else $GPU_PROFILE_OUT, else gpu-profile-out):

exactness   tests/nn/test_fused.py run first under pytest (on a GPU: the fused cupy kernels
            against the xp-op versions in float64, rtol 1e-12); a failure is reported loudly
            ("ok": false) and the profile still runs.
step        our engine.train_step with the fused kernels (MPISHARD_FUSED=1) and without (=0:
            the xp ops alone, cuDNN's attention off too),
            and PyTorch's step on the same model and batch (benchmarks/gpt.py torch_gpt, fp32,
            sdpa attention), samples alternating, medians; ratios of the medians. With
            --compute-dtype, ours at that compute_dtype and PyTorch's under autocast to it.
unit        forward and backward of each unit type at the step's shapes, fused and not
            (alternating): embedding, layernorm, the qkv / proj / fc / fc2 linears, the
            attention core, gelu, the tied head, the loss, and the AdamW update of all
            parameters; `per_step_s` = median x how many a step runs (12 layers, 2 layernorms
            each, ...). The device is synchronised around each measured call.
kernels     torch.profiler's top 15 CUDA kernels by device time of one step of PyTorch's,
            and of ours fused and unfused (CUPTI sees cupy's kernels too), per step.
host        ours fused, on the host: `issue_s`, the median time one step's call takes to
            return after a synchronised start (the host's work: Python and launches), beside
            `wall_s`, the same with the device synchronised at its end (issue close to wall:
            the step waits on the host, or the host on the device inside it); and cProfile's
            top functions by own time over 3 steps (a synchronisation inside the step shows
            there as the time of a cupy/cuda call).

Past --budget seconds the remaining parts are skipped with a `skipped` record.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import gpu
import gpu_step
import mpishard as ms
from gpt import model_flops
from mpishard.nn import functional as nn
from mpishard.nn import attention as att

HERE = Path(__file__).resolve().parent


class Recorder:
    def __init__(self, out: Path):
        out.mkdir(parents=True, exist_ok=True)
        self.path = out / "gpu_profile.jsonl"
        self.path.write_text("")

    def __call__(self, **rec):
        line = json.dumps(rec)
        print("PROFILE " + line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def fused(on: bool, fn):
    """fn run with MPISHARD_FUSED set to 1 or 0 (nn/fused.py reads it at each call)."""
    def run():
        os.environ["MPISHARD_FUSED"] = "1" if on else "0"
        return fn()
    return run


def exactness(emit, timeout):
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
           str(HERE.parent / "tests" / "nn" / "test_fused.py")]
    t0 = time.perf_counter()
    try:
        env = {k: v for k, v in os.environ.items()       # its own MPI, not this rank's job;
               if k.startswith(("OMPI_MCA_", "PMIX_MCA_"))     # the site's MCA settings stay
               or not k.startswith(("PMI_", "PMIX_", "HYDRA_", "MPIR_", "OMPI_"))}
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                              cwd=HERE.parent, env=env)
        ok, tail = proc.returncode == 0, (proc.stdout + proc.stderr).strip().splitlines()[-15:]
    except subprocess.TimeoutExpired:
        ok, tail = False, [f"timed out after {timeout} s"]
    emit(part="exactness", ok=ok, seconds=round(time.perf_counter() - t0, 1), tail=tail)
    if not ok:
        print("EXACTNESS FAILED: the fused kernels differ from the xp ops", flush=True)


def step_parts(dev, emit, model, params, x, t, batch, samples, compute=None):
    ce = ms.losses.CrossEntropy()
    engine = gpu.our_engine(dev, model, params, None, compute_dtype=compute)
    xd, td = engine.shard_batch(x), engine.shard_batch(t)
    ours = lambda: engine.train_step(xd, td, ce)               # noqa: E731
    fns = [fused(True, ours), fused(False, ours)]
    try:                                       # a kernel that fails to build costs its half
        fns[0]()
        dev.sync()
    except Exception as exc:
        emit(part="step", fused_error=f"{type(exc).__name__}: {exc}"[:2000])
        print("FUSED STEP FAILED: timing the xp ops twice", flush=True)
        fns[0] = fns[1]
    try:
        import torch
        fns.append(gpu_step.theirs(torch, dev, model, params, x, t, compute)[1])   # no AdamW
    except ImportError:
        torch = None
    times = gpu.timed(dev, fns, samples)
    flops = model_flops(model, batch)
    rec = dict(part="step", compute_dtype=compute or "float32", fused_s=round(times[0], 5),
               unfused_s=round(times[1], 5),
               fused_tflops=round(flops / times[0] / 1e12, 3),
               unfused_tflops=round(flops / times[1] / 1e12, 3),
               speedup_fused=round(times[1] / times[0], 3))
    if torch is not None:
        rec.update(torch_s=round(times[2], 5),
                   ratio_fused_over_torch=round(times[0] / times[2], 3),
                   ratio_unfused_over_torch=round(times[1] / times[2], 3))
    emit(**rec)
    return engine, fns, torch


def unit_cases(dev, model, batch, engine, x, t):
    """(name, pass, count per step, callable) at the step's shapes."""
    xp = dev.xp
    b, tt, d, h, v = batch, model.seq_len, model.d_model, model.n_heads, model.vocab_size
    rng = np.random.default_rng(2)

    def rand(*shape, scale=1.0):
        return xp.asarray((scale * rng.standard_normal(shape)).astype(np.float32))
    ids = xp.asarray(x)
    table, pos = rand(v, d, scale=0.02), rand(tt, d, scale=0.02)
    act, dact = rand(b, tt, d), rand(b, tt, d)
    scale, shift = rand(d), rand(d)
    _, ln_saved = nn.layernorm_forward(act, scale, shift)
    qkv = rand(b, tt, 3 * d)
    q, k, vv = att.split_heads(qkv, h)
    out, lse, p = att.causal_attention_forward(q, k, vv, keep_probs=True)
    dout = rand(b, h, tt, d // h)
    z, dz = rand(b, tt, 4 * d), rand(b, tt, 4 * d)
    _, gelu_saved = nn.gelu_forward(z)
    logits, labels = rand(b, tt, v), xp.asarray(t)
    ce = ms.losses.CrossEntropy()
    cases = [
        ("embedding", "forward", 1, lambda: table[ids] + pos[None]),
        ("embedding", "backward", 1, lambda: nn.embedding_backward(dact, ids, v)),
        ("layernorm", "forward", 2 * model.n_layers + 1,
         lambda: nn.layernorm_forward(act, scale, shift)),
        ("layernorm", "backward", 2 * model.n_layers + 1,
         lambda: nn.layernorm_backward(dact, ln_saved, scale))]
    for name, fan_in, fan_out in (("qkv", d, 3 * d), ("proj", d, d), ("fc", d, 4 * d),
                                  ("fc2", 4 * d, d)):
        xin, w, bias, dy = rand(b, tt, fan_in), rand(fan_in, fan_out), rand(fan_out), \
            rand(b, tt, fan_out)
        cases += [(f"linear_{name}", "forward", model.n_layers,
                   lambda xin=xin, w=w, bias=bias: nn.linear_forward(xin, w, bias)),
                  (f"linear_{name}", "backward", model.n_layers,
                   lambda dy=dy, xin=xin, w=w: nn.linear_backward(dy, xin, w))]
    cases += [
        ("attention_core", "forward", model.n_layers,
         lambda: att.causal_attention_forward(q, k, vv, keep_probs=True)),
        ("attention_core", "backward", model.n_layers,
         lambda: att.causal_attention_backward(dout, q, k, vv, out, lse,
                                               into=att.split_heads_grads(q)[1], probs=p)),
        ("gelu", "forward", model.n_layers, lambda: nn.gelu_forward(z)),
        ("gelu", "backward", model.n_layers, lambda: nn.gelu_backward(dz, gelu_saved)),
        ("head", "forward", 1, lambda: nn.einsum("bd,vd->bv", act.reshape(-1, d), table)),
        ("head", "backward", 1, lambda: (
            nn.einsum("bv,vd->bd", logits.reshape(-1, v), table),
            nn.einsum("bv,bd->vd", logits.reshape(-1, v), act.reshape(-1, d)))),
        ("loss", "forward+backward", 1, lambda: ce(logits, labels))]
    from mpishard.train.optim import AdamW
    opt = AdamW(engine, lr=1e-4)
    cases.append(("adamw", "step", 1, opt.step))
    return cases


def units(dev, emit, model, batch, engine, x, t, samples, t_end):
    os.environ["MPISHARD_FUSED"] = "0"
    for name, what, count, fn in unit_cases(dev, model, batch, engine, x, t):
        if time.perf_counter() > t_end:
            emit(part="unit", unit=name, skipped="budget spent")
            continue
        try:
            fused_s, unfused_s = gpu.timed(dev, [fused(True, fn), fused(False, fn)], samples)
        except Exception as exc:
            emit(part="unit", unit=name, what=what, error=f"{type(exc).__name__}: {exc}"[:500])
            continue
        emit(part="unit", unit=name, what=what, count=count, fused_s=round(fused_s, 6),
             unfused_s=round(unfused_s, 6), per_step_fused_s=round(count * fused_s, 5),
             per_step_unfused_s=round(count * unfused_s, 5))


def kernels(dev, emit, torch, which, fn, steps=2, top=15):
    """torch.profiler's top CUDA kernels of `fn` (one step), per step."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] if dev.standin else [ProfilerActivity.CUDA]
    fn()
    dev.sync()
    with profile(activities=activities) as prof:
        for _ in range(steps):
            fn()
        dev.sync()
    rows = []
    for ev in prof.key_averages():
        dt = getattr(ev, "self_device_time_total", None)
        if dt is None:
            dt = getattr(ev, "self_cuda_time_total", 0)
        if dev.standin:
            dt = ev.self_cpu_time_total
        if dt > 0:
            rows.append((dt, ev.key, ev.count))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    emit(part="kernels", which=which, device_ms_per_step=round(total / steps / 1e3, 3),
         top=[dict(name=k[:120], ms_per_step=round(dt / steps / 1e3, 3), calls=c // steps)
              for dt, k, c in rows[:top]])


def host(dev, emit, fn, steps=3, top=25):
    """The host side of one step of `fn` (the module docstring's `host` part)."""
    import cProfile
    import pstats
    fn()
    dev.sync()
    issue, wall = [], []
    for _ in range(5):
        dev.sync()
        t0 = time.perf_counter()
        fn()
        issue.append(time.perf_counter() - t0)
        dev.sync()
        wall.append(time.perf_counter() - t0)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(steps):
        fn()
    dev.sync()
    prof.disable()
    stats = pstats.Stats(prof).stats             # (file, line, name) -> (cc, nc, tt, ct, ...)
    rows = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    emit(part="host", issue_s=round(float(np.median(issue)), 5),
         wall_s=round(float(np.median(wall)), 5),
         top=[dict(name=f"{Path(f).name}:{line} {name}"[:120], calls=nc // steps,
                   own_ms_per_step=round(1e3 * tt / steps, 3),
                   cum_ms_per_step=round(1e3 * ct / steps, 3))
              for (f, line, name), (cc, nc, tt, ct, _) in rows])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--standin", action="store_true", help="CPU stand-in, tiny sizes")
    p.add_argument("--out", default=os.environ.get("GPU_PROFILE_OUT", "gpu-profile-out"))
    p.add_argument("--budget", type=float, default=240.0, help="seconds, then skip the rest")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--no-exactness", action="store_true")
    p.add_argument("--compute-dtype", choices=("bfloat16", "float16"), default=None,
                   help="ours at this compute_dtype, PyTorch under autocast to it (the step "
                   "and kernels parts; the unit part is float32's, skipped)")
    args = p.parse_args(argv)
    t_end = time.perf_counter() + args.budget
    emit = Recorder(Path(args.out))
    dev = gpu.Device(args.standin)
    emit(part="device", name=dev.name)
    if not args.no_exactness:
        exactness(emit, timeout=120)
    os.environ["MPISHARD_FUSED"] = "0"     # sizing and setup on the xp ops: a fused kernel
    model, params, x, t, batch = gpu.fitting_problem(   # that fails costs only its half
        dev, gpu.TINY if dev.standin else gpu.FULL)
    emit(part="step_size", batch=batch, seq_len=model.seq_len, d_model=model.d_model,
         n_layers=model.n_layers, vocab=model.vocab_size)
    engine, fns, torch = step_parts(dev, emit, model, params, x, t, batch, args.samples,
                                    args.compute_dtype)
    if args.compute_dtype is None:
        units(dev, emit, model, batch, engine, x, t, args.samples, t_end)
    if torch is None:
        emit(part="kernels", skipped="no torch")
    try:
        host(dev, emit, fns[0])
    except Exception as exc:                          # costs only this part
        emit(part="host", error=f"{type(exc).__name__}: {exc}")
    for which, fn in zip(("ours_fused", "ours_unfused", f"torch_{args.compute_dtype or 'fp32'}"),
                         fns):
        if torch is None:
            break
        if time.perf_counter() > t_end:
            emit(part="kernels", which=which, skipped="budget spent")
            continue
        try:
            kernels(dev, emit, torch, which, fn)
        except Exception as exc:                      # a profiler problem costs only this part
            emit(part="kernels", which=which, error=f"{type(exc).__name__}: {exc}")
    os.environ.pop("MPISHARD_FUSED", None)
    return 0


if __name__ == "__main__":
    sys.exit(main())

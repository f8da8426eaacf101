"""GPU benchmark: the GPT-2-small training step in each precision, against PyTorch's, paired.

    mpiexec -n 1 python -m mpi4py benchmarks/gpu_step.py [--budget 240] [--samples 5]
    ... --standin     the same code on the CPU stand-in (tests/device_double.py), tiny sizes

The model is ms.GPT(vocab 50304, seq_len 1024, d_model 768, 12 heads, 12 layers), batch 8,
halved (batch, then seq_len) until a step fits (benchmarks/gpu.py fitting_problem). Each
precision is one record `step`, ours beside PyTorch's GPT (benchmarks/gpt.py `torch_gpt`, the
same weights and batch, its default SDPA attention):

    precision  ours (make_engine keywords)          PyTorch
    float32    dtype float32                        float32, allow_tf32 False
    tf32       tf32=True                            float32, allow_tf32 True
    bfloat16   compute_dtype="bfloat16"             torch.autocast(cuda, bfloat16)
    float16    compute_dtype="float16"              torch.autocast(cuda, float16)

Four callables alternate sample by sample (gpu.py timed: medians, ratios of medians taken in
this one run): ours and PyTorch's full step (forward, loss, backward, then AdamW: ours
train.optim.AdamW, PyTorch's default torch.optim.AdamW) and each `train_step` alone (no
optimizer). `mfu_vs_datasheet`: model FLOPs (gpt.py model_flops) per `train_step` second
over the card's dense datasheet peak for that precision (gpu.py DATASHEET: non-tensor float32
for float32, 16-bit tensor cores for bfloat16 and float16; none for TF32, not in the table).
`peak_gib`: each side's allocator high-water mark over one full step from a released pool
(ours: cupy's pool, tracked by a wrapping allocator for that step only; PyTorch's
max_memory_allocated); `predicted_peak_gib`: costs/peak_memory.rank_peak's total for the same
step, its arrays held as costs/storage.py says for this precision on the GPU (the fused
kernels, cuDNN's attention where it ran; on the stand-in neither), and its ratio to ours.
`attention` names the attention ours ran: with the `cudnn` module
(nvidia-cudnn-frontend) importable, cuDNN's flash kernels in 16 bits (nn/cudnn_attention.py),
and one more bfloat16 record, "bfloat16 own attention", with them switched off
(MPISHARD_CUDNN=0). `loss_ours`, `loss_torch`: the first step's loss on each side, before
any update (the same weights and batch: equal to the precision's rounding). The fused kernels
are on (nn/fused.py); `--unfused` adds MPISHARD_FUSED=0 runs of ours.

Prints one `BENCH {json}` line per measurement, as benchmarks/gpu.py does. The environment
variable GPU_STEP_PRECISIONS (comma-separated record names) keeps only those records.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms
from gpt import model_flops, torch_gpt
from gpu import FULL, TINY, Device, emit, fitting_problem, timed
from mpishard.costs.peak_memory import rank_peak
from mpishard.costs.storage import storage_for
from mpishard.nn import cudnn_attention as cda
from mpishard.nn import fused

PRECISIONS = [("float32", {}, None, False), ("tf32", {"tf32": True}, None, True),
              ("bfloat16", {"compute_dtype": "bfloat16"}, "bfloat16", False),
              ("float16", {"compute_dtype": "float16"}, "float16", False)]


def ours(dev, model, params, x, t, keywords):
    """(full step, train_step only) closures of our single-device engine in `keywords`."""
    engine = ms.make_engine(model, "single", dtype=np.float32, comm=MPI.COMM_SELF,
                            device=dev.backend(MPI.COMM_SELF), report_errors=False, **keywords)
    engine.load_checkpoint(params)
    opt = ms.train.optim.AdamW(engine, lr=1e-4)
    xd, td, ce = engine.shard_batch(x), engine.shard_batch(t), ms.losses.CrossEntropy()

    def step_only():
        return engine.train_step(xd, td, ce)[0]

    def full():
        engine.train_step(xd, td, ce)
        opt.step()
    return full, step_only


def theirs(torch, dev, model, params, x, t, autocast):
    """(full step, forward+backward only) closures of PyTorch's GPT, AdamW at its defaults."""
    net = torch_gpt(torch, model, params)[0].to(dev.torch_device)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-4)
    low = None if autocast is None else getattr(torch, autocast)
    ce = torch.nn.CrossEntropyLoss()
    xt = torch.from_numpy(x).to(dev.torch_device)
    tt = torch.from_numpy(t).reshape(-1).to(dev.torch_device)

    def step_only():
        net.zero_grad(set_to_none=True)
        with torch.autocast(dev.torch_device, dtype=low, enabled=low is not None):
            loss = ce(net(xt).reshape(-1, model.vocab_size), tt)
        loss.backward()
        return loss

    def full():
        step_only()
        opt.step()
    return full, step_only


def peak_bytes(dev, fn, torch=None):
    """The allocator's high-water mark over one call of `fn` (None on the stand-in)."""
    if dev.standin:
        fn()
        return None
    dev.sync()
    if torch is not None:
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        return int(torch.cuda.max_memory_allocated())
    return dev.tracked_peak(fn)


def attention_name(dev, keywords) -> str:
    """The attention our step ran (after it ran: a shape cuDNN refused is in cda.refusals)."""
    if not fused.use(dev.xp):
        return "xp ops (matmul, softmax)"
    if keywords.get("compute_dtype") in ("bfloat16", "float16") and not dev.standin:
        own = "16-bit softmax kernels + cuBLAS 16-bit batched GEMMs (nn/fused_low.py)"
        if cda.load() is None or os.environ.get(cda.SWITCH) == "0":
            return own
        if cda.refusals:
            return f"{own}: cuDNN refused ({sorted(set(cda.refusals.values()))[0][:300]})"
        return "cuDNN's fused flash attention (nn/cudnn_attention.py)"
    return "fused causal softmax + cuBLAS batched GEMMs (nn/fused.py)"


def one_precision(dev, torch, problem, flops, label, keywords, autocast, tf32, samples):
    model, params, x, t, batch = problem
    rec = dict(part="step", precision=label, keywords=keywords, batch=batch)
    cda.refusals.clear()
    fns = list(ours(dev, model, params, x, t, keywords))
    rec["loss_ours"] = float(fns[1]())             # the first step's, before any update
    if torch is not None:
        if not dev.standin:
            torch.backends.cuda.matmul.allow_tf32 = tf32
        fns += list(theirs(torch, dev, model, params, x, t, autocast))
        rec["loss_torch"] = float(fns[3]().item())
    times = timed(dev, fns, samples)
    rec["attention"] = attention_name(dev, keywords)
    rec.update(ours_s=round(times[0], 5), ours_train_step_s=round(times[1], 5),
               ours_tflops=round(flops / times[0] / 1e12, 3))
    sheet = dev.datasheet()
    peak = None if sheet is None or label == "tf32" else sheet[label != "float32"]
    if peak is not None:
        rec["mfu_vs_datasheet"] = round(flops / times[1] / 1e12 / peak, 4)
    if torch is not None:
        rec.update(torch_s=round(times[2], 5), torch_train_step_s=round(times[3], 5),
                   ratio_ours_over_torch=round(times[0] / times[2], 3),
                   ratio_train_step_ours_over_torch=round(times[1] / times[3], 3))
    fns = None
    dev.release()
    full = ours(dev, model, params, x, t, keywords)[0]
    ours_peak = peak_bytes(dev, full)
    full = None
    dev.release()
    torch_peak = None
    if torch is not None:
        full = theirs(torch, dev, model, params, x, t, autocast)[0]
        torch_peak = peak_bytes(dev, full, torch)
        full = None
        dev.release()
    storage = storage_for("float32", keywords.get("compute_dtype"), "gpu",
                          fused=not dev.standin, cudnn=rec["attention"].startswith("cuDNN"))
    predicted = rank_peak(model, ms.parse_layout("single"), 0, batch, storage=storage)["total"]
    rec["predicted_peak_gib"] = round(predicted / 2 ** 30, 3)   # the planner's, as this step
    if ours_peak is not None:                                     # holds its arrays
        rec["ours_peak_gib"] = round(ours_peak / 2 ** 30, 3)
        rec["predicted_over_ours_peak"] = round(predicted / ours_peak, 3)
    if torch_peak is not None:
        rec["torch_peak_gib"] = round(torch_peak / 2 ** 30, 3)
    return rec


def run(dev, budget, samples, unfused=False):
    t_end = time.perf_counter() + budget
    os.environ["MPISHARD_FUSED"] = "0"        # sized on the xp ops (gpu.py's reason)
    problem = fitting_problem(dev, TINY if dev.standin else FULL)
    os.environ.pop("MPISHARD_FUSED", None)
    model, _, _, _, batch = problem
    flops = model_flops(model, batch)
    emit(part="step_size", batch=batch, seq_len=model.seq_len, d_model=model.d_model,
         n_layers=model.n_layers, vocab=model.vocab_size, gflop_per_step=round(flops / 1e9, 1))
    try:
        import torch
    except ImportError:
        torch = None
    runs = [(p, "", {}) for p in PRECISIONS]
    if cda.load() is not None and not dev.standin:          # bfloat16 without cuDNN's attention
        runs.append((PRECISIONS[2], " own attention", {cda.SWITCH: "0"}))
    if unfused:
        runs.append((PRECISIONS[0], " unfused", {"MPISHARD_FUSED": "0"}))
    only = os.environ.get("GPU_STEP_PRECISIONS")              # e.g. "bfloat16,bfloat16 own
    if only:                                                  # attention", for a short rerun
        runs = [r for r in runs if r[0][0] + r[1] in only.split(",")]
    for (label, keywords, autocast, tf32), suffix, env in runs:
        name = label + suffix
        if time.perf_counter() > t_end:
            emit(part="step", precision=name, skipped=f"budget {budget} s spent")
            continue
        before = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        try:
            rec = one_precision(dev, torch, problem, flops, label, keywords, autocast, tf32,
                                samples)
            rec["precision"] = name
        except Exception as exc:                 # reported; the other precisions still run
            rec = dict(part="step", precision=name, error=f"{type(exc).__name__}: {exc}"[:2000])
        finally:
            for key, value in before.items():            # as the caller had them
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            dev.release()
        emit(**rec)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--standin", action="store_true", help="CPU stand-in, tiny sizes")
    p.add_argument("--budget", type=float, default=240.0, help="seconds, then skip the rest")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--unfused", action="store_true", help="also float32 without fused kernels")
    args = p.parse_args(argv)
    return run(Device(args.standin), args.budget, args.samples, args.unfused)


if __name__ == "__main__":
    sys.exit(main())

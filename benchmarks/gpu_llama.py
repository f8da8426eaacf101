"""GPU benchmark: a GPT-2-small-sized Llama's train step against transformers' on one GPU.

    mpiexec -n 1 python -m mpi4py benchmarks/gpu_llama.py [--budget 120] [--samples 5]
    ... --standin     the same code on the CPU stand-in (tests/device_double.py), tiny sizes

The model is ms.Llama(vocab 32000, seq 1024, d_model 768, 12 heads, 4 kv heads (grouped-query
attention), 12 layers, d_ff 2048), batch 8, halved (batch, then seq_len) until a step fits
the GPU's memory (benchmarks/gpu.py fitting_problem). Ours: engine.train_step (forward,
cross-entropy, backward) in float32 with the fused cupy kernels (nn/fused.py, `ours_s`) and
without (MPISHARD_FUSED=0, `ours_unfused_s`). Theirs: transformers' LlamaForCausalLM in
float32 (its default attention) with the same weights (written with ms.hf.save, read with
from_pretrained), forward, the same token-mean cross entropy, backward, on the same batch.
A second record runs ours at compute_dtype="bfloat16" beside transformers' forward under
torch.autocast(bfloat16) (`precision` names which).
The three alternate sample by sample (benchmarks/gpu.py timed, medians, ratios of medians in
this one run). Both losses of one step are reported: the same model, so they agree to float32
rounding. FLOPs: mpishard.models.gpt.costs.gpt_flops (3 x the forward's matmuls).

Prints `BENCH {json}` lines as benchmarks/gpu.py does: `llama_size`, then `llama` (with `error`
where a step failed, `skipped` past --budget).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import mpishard as ms
from gpu import Device, emit, fitting_problem, our_engine, ours_figures, ours_pair, timed
from mpishard.models.gpt.costs import gpt_flops

LLAMA = dict(vocab_size=32000, seq_len=1024, d_model=768, n_heads=12, n_kv_heads=4,
             n_layers=12, d_ff=2048, batch=8)
TINY = dict(vocab_size=33, seq_len=16, d_model=32, n_heads=4, n_kv_heads=2, n_layers=2,
            d_ff=64, batch=2)


def torch_llama(torch, dev, model, params, x, t, autocast=None):
    """(step closure, its loss once) of transformers' LlamaForCausalLM holding `params`, its
    forward under torch.autocast to `autocast` ("bfloat16") when given."""
    from transformers import LlamaForCausalLM
    with tempfile.TemporaryDirectory(prefix="mpishard-gpu-llama-") as tmp:
        path = ms.hf.save(tmp, model, params, dtype="float32")
        net = LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32)
    net = net.to(dev.torch_device).train()
    low = None if autocast is None else getattr(torch, autocast)
    xt = torch.from_numpy(x).to(dev.torch_device)
    tt = torch.from_numpy(t).reshape(-1).to(dev.torch_device)

    def step():
        net.zero_grad()
        with torch.autocast(dev.torch_device, dtype=low, enabled=low is not None):
            loss = torch.nn.functional.cross_entropy(
                net(xt).logits.reshape(-1, model.vocab_size).float(), tt)
        loss.backward()
        return loss
    return step, float(step().item())


def run(dev, budget, samples):
    t_end = time.perf_counter() + budget
    # sized on the xp ops, so a fused kernel that fails costs only the fused half below
    os.environ["MPISHARD_FUSED"] = "0"
    model, params, x, t, batch = fitting_problem(dev, TINY if dev.standin else LLAMA, ms.Llama)
    flops = gpt_flops(model, batch)
    emit(part="llama_size", batch=batch, seq_len=model.seq_len, d_model=model.d_model,
         n_heads=model.n_heads, n_kv_heads=model.n_kv_heads, d_ff=model.d_ff,
         n_layers=model.n_layers, vocab=model.vocab_size, gflop_per_step=round(flops / 1e9, 1))
    for compute in (None, "bfloat16"):
        emit(**one_precision(dev, model, params, x, t, flops, compute, t_end, budget, samples))
    os.environ.pop("MPISHARD_FUSED", None)
    return 0


def one_precision(dev, model, params, x, t, flops, compute, t_end, budget, samples):
    """The `llama` record of ours at compute_dtype `compute` (None: float32) beside
    transformers' in float32, or under torch.autocast to `compute`."""
    rec = dict(part="llama", precision=compute or "float32")
    engine = fns = None
    try:
        os.environ["MPISHARD_FUSED"] = "0"
        engine = our_engine(dev, model, params, compute_dtype=compute)
        fns = ours_pair(dev, engine, x, t, rec)
        loss, _ = engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                                    ms.losses.CrossEntropy())
        rec["loss_ours"] = round(float(loss), 6)
        try:
            import torch
            step, loss_torch = torch_llama(torch, dev, model, params, x, t, compute)
            rec["loss_torch"] = round(loss_torch, 6)
            fns.append(step)
        except ImportError as exc:
            rec["torch"] = f"not measured: {exc}"
        if time.perf_counter() > t_end:
            rec["skipped"] = f"budget {budget} s spent before timing"
        else:
            times = timed(dev, fns, samples)
            ours_figures(rec, times, flops, None)
            if len(times) > 2:
                rec.update(torch_s=round(times[2], 5),
                           ratio_ours_over_torch=round(times[0] / times[2], 3),
                           ratio_unfused_over_torch=round(times[1] / times[2], 3))
    except Exception as exc:
        rec["error"] = f"{type(exc).__name__}: {exc}"[:2000]
    finally:
        engine = fns = None
        dev.release()
    return rec


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--standin", action="store_true", help="CPU stand-in, tiny sizes")
    p.add_argument("--budget", type=float, default=120.0, help="seconds, then skip the rest")
    p.add_argument("--samples", type=int, default=5)
    args = p.parse_args(argv)
    return run(Device(args.standin), args.budget, args.samples)


if __name__ == "__main__":
    sys.exit(main())

"""GPU benchmark helpers (the device, paired timing, the fitting size) and all-reduce bandwidth.

    mpiexec -n 2 python -m mpi4py benchmarks/gpu.py allreduce [--budget 60]
    ... --standin     the same code on the CPU stand-in (tests/device_double.py), tiny sizes

The step in each precision against PyTorch is benchmarks/gpu_step.py, the Llama step
benchmarks/gpu_llama.py; both time with `timed` (callables alternating sample by sample) and
size the problem with `fitting_problem` (batch, then seq_len, halved until a step fits).
allreduce (two ranks sharing the GPU): `engine.all_reduce(a, out=out)` on float32 device
arrays of 1, 16 and 64 MiB, staged through the host and, only where the MPI library says it
is CUDA-aware (comm/gpu.py query_cuda_support), directly; bus bandwidth
2 (n-1)/n bytes / time, the slowest rank's median.

Every measurement prints one line `BENCH {json}` as it finishes; when `--budget` seconds are
spent the rest is skipped with a `BENCH {"skipped": ...}` line, so a cut-off run still says
what it measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpishard as ms
from _common import mpi_sync, sample_times

HERE = Path(__file__).resolve().parent
DATASHEET = {  # dense TFLOP/s: (float32 non-tensor, float16/bfloat16 tensor core), SXM parts
    "H100": (67.0, 989.4), "H200": (67.0, 989.4), "A100": (19.5, 312.0), "L40S": (91.6, 362.1)}
FULL = dict(vocab_size=50304, seq_len=1024, d_model=768, n_heads=12, n_layers=12, batch=8)
TINY = dict(vocab_size=32, seq_len=16, d_model=32, n_heads=4, n_layers=2, batch=2)


def emit(**rec):
    print("BENCH " + json.dumps(rec), flush=True)


class Device:
    """What differs between cupy and the stand-in: the array module, sync, the torch device."""

    def __init__(self, standin):
        self.standin = standin
        if standin:
            sys.path.insert(0, str(HERE.parent / "tests"))
            from device_double import DeviceModule
            self.xp, self.torch_device, self.name = DeviceModule(), "cpu", "stand-in (CPU)"
        else:
            import cupy
            self.xp, self.torch_device = cupy, "cuda"
            self.name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()

    def backend(self, comm, cuda_aware=False):
        from mpishard.comm.backend import Backend
        if self.standin:
            return Backend("gpu", comm, cuda_aware=cuda_aware, array_module=type(self.xp)(
                cuda_aware=cuda_aware))
        return Backend("gpu", comm, cuda_aware=cuda_aware)

    def sync(self):
        if not self.standin:
            self.xp.cuda.Device().synchronize()

    def release(self):
        """Hand the memory pools back between measurements (cupy's and torch's caches)."""
        if not self.standin:
            self.xp.get_default_memory_pool().free_all_blocks()
            try:
                import torch
                torch.cuda.empty_cache()
            except ImportError:
                pass

    def tracked_peak(self, fn):
        """cupy's pool high-water mark over one call of `fn`: a wrapping allocator, set for
        that call only (it costs a Python call per allocation)."""
        pool = self.xp.get_default_memory_pool()
        peak = [pool.used_bytes()]

        def malloc(size):
            mem = pool.malloc(size)
            peak[0] = max(peak[0], pool.used_bytes())
            return mem
        self.xp.cuda.set_allocator(malloc)
        try:
            fn()
            self.sync()
        finally:
            self.xp.cuda.set_allocator(pool.malloc)
        return peak[0]

    def datasheet(self):
        return next((v for k, v in DATASHEET.items() if k in self.name), None)


def timed(dev, fns, samples, warmup=2):
    """Median seconds of each callable, alternating sample by sample; the device is
    synchronised before each sample and inside it (a launch returns before the GPU is done)."""
    def sync(dt):
        dev.sync()
        return dt

    def synced(fn):
        return lambda: (fn(), dev.sync())
    return [float(np.median(t)) for t in sample_times([synced(f) for f in fns], samples, warmup,
                                                      sync)]


def matmul_peak(dev, n, dtype):
    xp = dev.xp
    a = xp.asarray(np.random.default_rng(0).standard_normal((n, n)).astype(dtype))
    b = xp.asarray(np.random.default_rng(1).standard_normal((n, n)).astype(dtype))
    (t,) = timed(dev, [lambda: xp.matmul(a, b)], samples=10, warmup=3)
    return 2.0 * n ** 3 / t / 1e9


def fitting_problem(dev, cfg, make=ms.GPT):
    """(model, params, x, t, batch) at the largest size whose step fits; make(**cfg) builds
    the spec (ms.GPT, ms.Llama)."""
    cfg = dict(cfg)
    while True:
        batch = cfg["batch"]
        spec = {k: v for k, v in cfg.items() if k != "batch"}
        model = make(**spec)
        rng = np.random.default_rng(1)
        x = rng.integers(0, model.vocab_size, (batch, model.seq_len))
        t = rng.integers(0, model.vocab_size, (batch, model.seq_len))
        params = model.init(seed=0)
        try:
            engine = our_engine(dev, model, params, None)
            engine.train_step(engine.shard_batch(x), engine.shard_batch(t),
                              ms.losses.CrossEntropy())
            dev.sync()
            return model, params, x, t, batch
        except Exception as exc:                    # cupy's OutOfMemoryError among them
            if "memory" not in str(exc).lower() or (batch == 1 and cfg["seq_len"] <= 128):
                raise
            emit(part="step", note=f"out of memory at batch {batch} seq {cfg['seq_len']}")
            if batch > 1:
                cfg["batch"] = batch // 2
            else:
                cfg["seq_len"] //= 2
        finally:
            engine = None
            dev.release()


def our_engine(dev, model, params, param_dtype=None, **keywords):
    """A loaded float32 single-device engine (keywords: compute_dtype, tf32, ...)."""
    engine = ms.make_engine(model, "single", dtype=np.float32, comm=MPI.COMM_SELF,
                            device=dev.backend(MPI.COMM_SELF), param_dtype=param_dtype,
                            report_errors=False, **keywords)
    engine.load_checkpoint(params)
    return engine


def with_fused(on, fn):
    """fn run with MPISHARD_FUSED unset (the fused kernels) or "0" (nn/fused.py reads it at
    each call)."""
    def run():
        if on:
            os.environ.pop("MPISHARD_FUSED", None)
        else:
            os.environ["MPISHARD_FUSED"] = "0"
        return fn()
    return run


def ours_pair(dev, engine, x, t, rec):
    """[fused step, unfused step] of `engine`; a fused step that fails is recorded in rec
    (its error) and the unfused one timed in its place."""
    xd, td, ce = engine.shard_batch(x), engine.shard_batch(t), ms.losses.CrossEntropy()
    fns = [with_fused(on, lambda: engine.train_step(xd, td, ce)) for on in (True, False)]
    try:
        fns[0]()
        dev.sync()
    except Exception as exc:
        rec["error"] = f"fused step: {type(exc).__name__}: {exc}"[:2000]
        fns[0] = fns[1]
    return fns


def ours_figures(rec, times, flops, peak):
    """Ours fused (times[0]) and unfused (times[1]) into rec."""
    rec.update(ours_s=round(times[0], 5), ours_unfused_s=round(times[1], 5),
               speedup_fused=round(times[1] / times[0], 3),
               ours_tflops=round(flops / times[0] / 1e12, 3),
               ours_unfused_tflops=round(flops / times[1] / 1e12, 3))
    if peak is not None:
        rec["mfu_vs_cupy_fp32"] = round(flops / times[0] / 1e9 / peak, 4)


def run_allreduce(dev, budget, samples):
    comm = MPI.COMM_WORLD
    t_end = time.perf_counter() + budget
    from mpishard.comm.gpu import query_cuda_support
    aware, why = (True, "stand-in: exercised") if dev.standin else query_cuda_support()
    if comm.Get_rank() == 0:
        emit(part="allreduce_env", cuda_aware=aware, why=why, ranks=comm.Get_size())
    sync = mpi_sync(comm)
    sizes = [1 << 16] if dev.standin else [1 << 20, 16 << 20, 64 << 20]
    for mode in ("staged", "cuda_aware") if aware else ("staged",):
        engine = ms.make_engine(ms.MLP([2, 2]), f"dp={comm.Get_size()}", dtype=np.float32,
                                comm=comm, device=dev.backend(comm, mode == "cuda_aware"),
                                report_errors=False)
        xp = engine.xp
        for nbytes in sizes:
            if comm.allreduce(time.perf_counter() > t_end, op=MPI.LOR):
                if comm.Get_rank() == 0:
                    emit(part="allreduce", mode=mode, bytes=nbytes, skipped="budget spent")
                continue
            a = xp.asarray(np.ones(nbytes // 4, np.float32))
            out = xp.empty_like(a)

            def one():
                engine.all_reduce(a, out=out)
                dev.sync()
            times = [float(np.median(s)) for s in sample_times([one], samples, 2, sync)]
            n = comm.Get_size()
            if comm.Get_rank() == 0:
                emit(part="allreduce", mode=mode, bytes=nbytes, seconds=round(times[0], 6),
                     busbw_gbs=round(2 * (n - 1) / n * nbytes / times[0] / 1e9, 3),
                     correct=bool(float(out[0]) == n))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("what", choices=["allreduce"], help="the step: benchmarks/gpu_step.py")
    p.add_argument("--standin", action="store_true", help="CPU stand-in, tiny sizes")
    p.add_argument("--budget", type=float, default=240.0, help="seconds, then skip the rest")
    p.add_argument("--samples", type=int, default=5)
    args = p.parse_args(argv)
    dev = Device(args.standin)
    return run_allreduce(dev, args.budget, args.samples)


if __name__ == "__main__":
    sys.exit(main())

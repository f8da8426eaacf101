"""What the benchmark scripts share: alternating median timings, the --json result file and
the BLAS each result records (blas_info)."""
from __future__ import annotations

import json
import re
import sys
import time

import numpy as np
from threadpoolctl import threadpool_info


def median_times(fns, samples, warmup=2, sync=None):
    """Median seconds of each callable, alternating them sample by sample. `sync()` is called
    around each sample and returns the slowest rank's time for it (distributed runs)."""
    return [float(np.median(t)) for t in sample_times(fns, samples, warmup, sync)]


def sample_times(fns, samples, warmup=2, sync=None):
    """median_times' samples: for each callable, its list of `samples` seconds (sample i of
    every callable was taken in the same round, so ratios can be paired)."""
    times = [[] for _ in fns]
    for i in range(warmup + samples):
        order = range(len(fns)) if i % 2 == 0 else reversed(range(len(fns)))
        for j in order:
            if sync is not None:
                sync(None)
            t0 = time.perf_counter()
            fns[j]()
            dt = time.perf_counter() - t0
            if sync is not None:
                dt = sync(dt)
            if i >= warmup:
                times[j].append(dt)
    return times


def mpi_sync(comm):
    """`median_times`' sync over an MPI communicator: a barrier before each sample, then the
    slowest rank's time."""
    from mpi4py import MPI

    def sync(dt):
        if dt is None:
            comm.Barrier()
            return None
        return comm.allreduce(dt, op=MPI.MAX)
    return sync


def write_json(path, res):
    """Write `res` to `path` (a script's --json option) with the BLAS it ran on under 'blas'
    (blas_info: torch's only when the script imported torch); nothing when no path was given."""
    if path:
        if isinstance(res, dict):
            res.setdefault("blas", blas_info(with_torch=False))
        with open(path, "w") as f:
            json.dump(res, f, indent=1)


def numpy_blas() -> list:
    """numpy's BLAS libraries as threadpoolctl reports them (the kernel is `architecture`)."""
    keep = ("internal_api", "version", "architecture", "threading_layer", "num_threads",
            "prefix")
    return [{k: lib.get(k) for k in keep} for lib in threadpool_info()
            if lib.get("user_api") == "blas"]


def torch_blas(config: str) -> dict:
    """PyTorch's BLAS from the text of `torch.__config__.show()`: BLAS_INFO, LAPACK_INFO,
    the MKL or OpenBLAS line, and the CPU capability its own kernels use."""
    out = {}
    for key in ("BLAS_INFO", "LAPACK_INFO"):
        m = re.search(rf"\b{key}=([^,\s]+)", config)
        out[key.lower()] = m.group(1) if m else None
    lib = [ln.strip(" -") for ln in config.splitlines()
           if re.search(r"Math Kernel Library|OpenBLAS|\bBLIS\b", ln)]
    out["library"] = lib[0] if lib else None
    m = re.search(r"CPU capability usage:\s*(\S+)", config)
    out["cpu_capability"] = m.group(1) if m else None
    return out


def blas_info(with_torch: bool = True) -> dict:
    """{'numpy': numpy_blas(), 'torch': torch_blas(...) or None}. `with_torch=False` reads
    torch's only when this process already imported it (an import costs seconds)."""
    res = {"numpy": numpy_blas(), "torch": None}
    if with_torch or "torch" in sys.modules:
        try:
            import torch
        except ImportError:
            return res
        res["torch"] = dict(torch_blas(torch.__config__.show()), version=torch.__version__)
    return res

"""What the benchmark scripts share: alternating median timings and the --json result file."""
from __future__ import annotations

import json
import time

import numpy as np


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
    """Write `res` to `path` (a script's --json option); nothing when no path was given."""
    if path:
        with open(path, "w") as f:
            json.dump(res, f, indent=1)

"""All-reduce bandwidth between the ranks of one job: raw mpi4py and the engine, same buffers.

    mpiexec -n 2 python -m mpi4py tests/hpc/allreduce_bw.py [MIB]

Rank 0 prints one JSON line: the hosts (MPI processor names) in rank order, and for
`comm.Allreduce(a, out)` and `engine.all_reduce(a, out=out)` on MIB MiB of float32 per rank
(default 16) the median seconds over 7 timed calls (after 2 warm-ups; a call's time is the
slowest rank's) and the algorithm bandwidth bytes / seconds in GB/s. `make test-hosts`
(tests/hpc/two_hosts.py) runs it across two network-namespace hosts and on one host.
"""
from __future__ import annotations

import json
import statistics
import sys
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms

REPEATS, WARMUP = 7, 2


def timed(comm, call):
    """Median over REPEATS of the slowest rank's time for one call."""
    times = []
    for i in range(WARMUP + REPEATS):
        comm.Barrier()
        t0 = time.perf_counter()
        call()
        dt = comm.allreduce(time.perf_counter() - t0, op=MPI.MAX)
        if i >= WARMUP:
            times.append(dt)
    return statistics.median(times)


def main(argv):
    mib = float(argv[0]) if argv else 16.0
    comm = MPI.COMM_WORLD
    engine = ms.make_engine(ms.MLP([2, 2]), f"dp={comm.size}", comm=comm, dtype=np.float32)
    a = np.full(int(mib * 2**20) // 4, comm.rank + 1.0, dtype=np.float32)
    out = np.empty_like(a)
    raw = timed(comm, lambda: comm.Allreduce(a, out))
    ours = timed(comm, lambda: engine.all_reduce(a, out=out))
    want = comm.size * (comm.size + 1) / 2
    assert float(out[0]) == want and float(out[-1]) == want, (out[0], want)
    hosts = comm.gather(MPI.Get_processor_name(), root=0)
    if comm.rank == 0:
        report = {"ranks": comm.size, "hosts": hosts, "mib": mib,
                  "raw_s": raw, "engine_s": ours,
                  "raw_gbps": a.nbytes / raw / 1e9, "engine_gbps": a.nbytes / ours / 1e9}
        print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])

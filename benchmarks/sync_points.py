"""What a blocking sync point costs after a burst of compute, by ranks per core.

    mpiexec -n 8 python -m mpi4py benchmarks/sync_points.py [--json out.json]

Every rank runs `iters` rounds of [GEMMs for about `chunk` seconds, then a 64-byte
Allreduce on its group of g consecutive ranks (tp's grouping)], against the same rounds
without the Allreduce (one Barrier at the end), alternated over 5 repetitions; the
difference of the two medians, per round, is the sync point's cost, printed with its share
of the chunk. A tp or
cp layout blocks like this inside every block's forward and backward. With a core per rank
the cost is the call's latency and the members' skew (microseconds). On ranks sharing cores a
member that reaches the call waits until its partners are scheduled and have finished their
own chunk: the cost grows with the chunk and with the group. The planner's step time does
not model it (docs/planning-and-tracing.md, "Step time at 8 ranks on 2 cores").
"""
from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

CHUNKS = (0.5e-3, 2e-3)
ROUNDS, REPEATS = 30, 5


def gemms_for(a, seconds: float) -> int:
    """How many a @ a take about `seconds` on this rank now (every rank measuring at once)."""
    t0, count = time.perf_counter(), 0
    while time.perf_counter() - t0 < 0.2:
        a @ a
        count += 1
    return max(1, round(seconds / (0.2 / count)))


def rounds(comm, a, reps: int, group) -> float:
    """Seconds of ROUNDS rounds of `reps` GEMMs, each round ending in an Allreduce on
    `group` (None: no call; one Barrier at the end)."""
    small, out = np.zeros(16, np.float32), np.zeros(16, np.float32)
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        for _ in range(reps):
            a @ a
        if group is not None:
            group.Allreduce(small, out)
    comm.Barrier()
    return time.perf_counter() - t0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", help="also write the rows to this file (rank 0)")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    a = np.random.default_rng(rank).standard_normal((256, 256), dtype=np.float32)
    rows = []
    for chunk in CHUNKS:
        reps = comm.bcast(gemms_for(a, chunk), root=0)
        for g in (n for n in (2, 4, 8) if n <= size):
            group = comm.Split(rank // g, rank)
            times = {"sync": [], "none": []}
            for _ in range(REPEATS):
                times["sync"].append(rounds(comm, a, reps, group))
                times["none"].append(rounds(comm, a, reps, None))
            group.Free()
            per_round = float(np.median(times["none"])) / ROUNDS
            cost = (float(np.median(times["sync"])) - float(np.median(times["none"]))) / ROUNDS
            rows.append({"ranks": size, "group": g, "chunk_s": per_round, "sync_s": cost,
                         "share": cost / per_round})
            if rank == 0:
                print(f"{size} ranks, group {g}: a {per_round * 1e3:.2f} ms chunk, its sync "
                      f"point {cost * 1e3:+.3f} ms ({100 * cost / per_round:+.1f}%)", flush=True)
    if args.json and rank == 0:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

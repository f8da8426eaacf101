"""Collective overhead: the engine's collectives against raw mpi4py buffer calls.

    mpiexec -n 2 python -m mpi4py benchmarks/collectives.py [--quick] [--json out.json]

For every size (bytes of each rank's input, 1 KiB .. 64 MiB; 16 MiB with --quick) and kind:

    all_reduce      engine.all_reduce(a)            vs  comm.Allreduce(a, out)
    all_reduce_out  engine.all_reduce(a, out=out)   vs  comm.Allreduce(a, out)
    all_gather      engine.all_gather(a)            vs  comm.Allgather(a, out)
    reduce_scatter  engine.reduce_scatter(a)        vs  comm.Reduce_scatter_block(a, out)
    all_to_all      engine.all_to_all(a)            vs  comm.Alltoall(a, out)
    all_to_all_v    engine.all_to_all_v(a, counts)  vs  comm.Alltoallv(a, out) (equal counts;
                    the engine learns its receive counts, as a user's call does; the raw
                    call is handed them)

on the same float32 buffers and the same communicator (the engine's 'dp' group, which spans
the world). The raw calls get their output preallocated once; the engine is called as a user
calls it. One sample is `inner` back-to-back calls between barriers, its time the slowest
rank's; the sides take turns sample by sample (so background load hits them alike), and
the ratio is the median over samples of the paired ratio engine / raw, after a warm-up. This
is repeated in 5 trials (7 from 1 MiB; 3 with --quick), each on fresh buffers, and the figure is
the median of the trials: on this VM two equal 16 MiB buffers can differ by 20% in how fast
MPI writes into them, so a single trial measures where the pages landed, not the engine.
From 1 MiB up a third side takes its turn too, `bounded`, on output buffers of its own (each
side writes into its own: one that follows a side that wrote into its buffers finds them warm,
cases()): the raw call's non-blocking form (Iallreduce, Iallgather, Ireduce_scatter_block,
Ialltoall, Ialltoallv) waited by the least a polled wait must do, `while not req.Test():
sched_yield()` (the watchdog's poll loop without its clock reads). `bounded_ratio` (bounded /
raw) is the floor of a collective whose wait is polled from Python (every collective below
MPI_THREAD_MULTIPLE, and all_to_all_v's probes); above it the engine makes the blocking call,
or for reduce_scatter and all_to_all_v's messages a blocking Waitall, under the guard thread
(mpishard/health/guard.py), which can run below it. `engine_over_bounded` is engine / bounded.
`allreduce_overhead_ratio` is the worst `all_reduce_out` ratio at 1 MiB and up: the engine
writing into the raw call's own output buffer, literally the same buffers on both sides, so
only the engine's code path differs. `allreduce_overhead_ratio_default` is the same for the
plain call, whose result lands in a buffer of the engine's own (see benchmarks/README.md).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms
from _common import write_json

KIB, MIB = 1024, 1024 * 1024
SIZES = [KIB * 4 ** k for k in range(10)]          # 1 KiB, 4 KiB, ..., 64 MiB (262144 KiB)
SIZES = [s for s in SIZES if s <= 64 * MIB]


def _plan(nbytes, quick, tiny=False):
    """(inner calls per sample, samples per side, trials): a sample moves >= 4 MiB per rank.
    From 1 MiB, where the targets are, a full run takes 15 samples and 7 trials instead of 9
    and 5: at 4 ranks on 2 cores one sample's ratio spreads by 0.1-0.2, so the worst of
    eight sizes' medians read high by whichever one the noise pushed up most (two runs of
    the same code, all_to_all at 4 MiB on 2 ranks: 1.139 and 1.217)."""
    inner = max(1, min(200, (4 * MIB) // nbytes))
    if tiny:
        return inner, 3, 1
    if quick:
        return inner, 7, 3
    return (inner, 15, 7) if nbytes >= MIB else (inner, 9, 5)


def _sample(comm, fn, inner):
    """Seconds per call of `inner` calls of `fn` (the slowest rank's), after one untimed call:
    each side is timed in its own steady state, whichever side ran before it (the first call
    after another side's finds its buffers out of cache: 1.1-1.3x at 1 MiB on 4 ranks)."""
    fn()
    comm.Barrier()
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    dt = np.array([(time.perf_counter() - t0) / inner])
    comm.Allreduce(MPI.IN_PLACE, dt, op=MPI.MAX)
    return float(dt[0])


def compare(comm, ours, raw, inner, samples, warmup=2, bounded=None):
    """(median s/call of `ours`, of `raw`, median of the paired ratios ours/raw, and with
    `bounded` the median of the paired ratios bounded/raw), the sides taking turns sample by
    sample so that load drifting over time hits them alike, their order rotating so that
    each follows each other side as often (forwards-then-backwards left `ours` always in
    the middle of three)."""
    sides = [raw, ours] + ([bounded] if bounded is not None else [])
    times = [[] for _ in sides]
    for i in range(warmup + samples):
        k = i % len(sides)
        order = list(range(k, len(sides))) + list(range(k))
        for j in order:
            t = _sample(comm, sides[j], inner)
            if i >= warmup:
                times[j].append(t)
    t_raw, t_ours = times[0], times[1]
    ratios = [o / r for o, r in zip(t_ours, t_raw)]
    floor = (float(np.median([b / r for b, r in zip(times[2], t_raw)]))
             if bounded is not None else None)
    return float(np.median(t_ours)), float(np.median(t_raw)), float(np.median(ratios)), floor


def bounded_wait(req) -> None:
    """The least a wait that can time out does: test, and yield the core between tests."""
    test, pause = req.Test, os.sched_yield
    while not test():
        pause()


def cases(engine, comm, nbytes):
    """kind -> (engine call, raw mpi4py call) on the same buffers."""
    n = comm.Get_size()
    count = max(n, nbytes // 4 // n * n)        # float32 elements, divisible by n
    a = np.random.default_rng(comm.Get_rank()).standard_normal(count).astype(np.float32)
    out, gathered, scattered = (np.empty(size, np.float32)
                                for size in (count, count * n, count // n))
    counts = np.full(n, count // n, dtype=np.int64)        # all_to_all_v: equal blocks, the
    displs = np.arange(n, dtype=np.int64) * (count // n)   # engine exchanging its counts first
    typed = MPI.FLOAT
    v_send, v_recv = [a, counts, displs, typed], [out, counts, displs, typed]
    # `bounded` writes into buffers of its own: sharing the raw call's, it kept them warm
    # for it (2 ranks, 4 MiB all_to_all: engine / raw 1.15-1.18 with them shared, 1.03-1.04
    # apart; the raw call itself 422 -> 488-557 us)
    b_out, b_gathered, b_scattered = (np.empty_like(x) for x in (out, gathered, scattered))
    b_recv = [b_out, counts, displs, typed]
    return {
        "all_reduce": (lambda: engine.all_reduce(a, group="dp"),
                       lambda: comm.Allreduce(a, out),
                       lambda: bounded_wait(comm.Iallreduce(a, b_out))),
        "all_reduce_out": (lambda: engine.all_reduce(a, group="dp", out=out),
                           lambda: comm.Allreduce(a, out),
                           lambda: bounded_wait(comm.Iallreduce(a, b_out))),
        "all_gather": (lambda: engine.all_gather(a, group="dp"),
                       lambda: comm.Allgather(a, gathered),
                       lambda: bounded_wait(comm.Iallgather(a, b_gathered))),
        "reduce_scatter": (lambda: engine.reduce_scatter(a, group="dp"),
                           lambda: comm.Reduce_scatter_block(a, scattered),
                           lambda: bounded_wait(comm.Ireduce_scatter_block(a, b_scattered))),
        "all_to_all": (lambda: engine.all_to_all(a, group="dp"),
                       lambda: comm.Alltoall(a, out),
                       lambda: bounded_wait(comm.Ialltoall(a, b_out))),
        "all_to_all_v": (lambda: engine.all_to_all_v(a, counts, group="dp"),
                         lambda: comm.Alltoallv(v_send, v_recv),
                         lambda: bounded_wait(comm.Ialltoallv(v_send, b_recv))),
    }


def run(quick=False, max_bytes=None, comm=None, tiny=False, min_bytes=0):
    comm = MPI.COMM_WORLD if comm is None else comm
    n = comm.Get_size()
    engine = ms.make_engine(ms.MLP([2, 2]), f"dp={n}", comm=comm, dtype=np.float32)
    comm = engine.mesh.comm("dp")           # raw calls on the very communicator the engine uses
    cap = max_bytes or (64 * KIB if tiny else 16 * MIB if quick else 64 * MIB)
    rows = []
    for nbytes in [s for s in SIZES if min_bytes <= s <= cap]:
        inner, samples, trials = _plan(nbytes, quick, tiny)
        found: dict = {}
        for _ in range(trials):
            # fresh buffers each trial: on this VM a large buffer's speed depends on where
            # its pages landed, by 10-20%, whichever side owns it
            for kind, (ours, raw, bounded) in cases(engine, comm, nbytes).items():
                found.setdefault(kind, []).append(compare(
                    comm, ours, raw, inner, samples, bounded=bounded if nbytes >= MIB else None))
        for kind, res in found.items():
            t_ours, t_raw, ratio = (float(np.median([r[i] for r in res])) for i in range(3))
            row = {"ranks": n, "bytes": nbytes, "kind": kind, "engine_s": t_ours,
                   "raw_s": t_raw, "ratio": ratio, "trials": trials,
                   "trial_ratios": [r[2] for r in res]}
            if res[0][3] is not None:
                row["bounded_ratio"] = float(np.median([r[3] for r in res]))
                row["engine_over_bounded"] = ratio / row["bounded_ratio"]
            rows.append(row)
    def worst(kind):
        return max((r["ratio"] for r in rows if r["kind"] == kind and r["bytes"] >= MIB),
                   default=None)
    return {"ranks": n, "rows": rows,
            "allreduce_overhead_ratio": worst("all_reduce_out"),
            "allreduce_overhead_ratio_default": worst("all_reduce"),
            "worst_ratio_1mib_up": {k: max((r["ratio"] for r in rows
                                            if r["kind"] == k and r["bytes"] >= MIB),
                                           default=None)
                                    for k in KINDS}}


KINDS = ("all_reduce", "all_reduce_out", "all_gather", "reduce_scatter", "all_to_all",
         "all_to_all_v")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="sizes up to 16 MiB, fewer samples")
    p.add_argument("--tiny", action="store_true", help="up to 64 KiB, 3 samples (smoke test)")
    p.add_argument("--max-bytes", type=int, default=None, help="largest size (bytes)")
    p.add_argument("--min-bytes", type=int, default=0, help="smallest size (bytes; e.g. "
                   "1048576 for the sizes the worst ratios are taken over)")
    p.add_argument("--json", default=None, help="write the result here (rank 0)")
    args = p.parse_args(argv)
    res = run(args.quick, args.max_bytes, tiny=args.tiny, min_bytes=args.min_bytes)
    if MPI.COMM_WORLD.Get_rank() == 0:
        for r in res["rows"]:
            print(f"{r['ranks']} ranks {r['bytes'] / KIB:>8.0f} KiB {r['kind']:<15} "
                  f"engine {r['engine_s'] * 1e6:10.1f} us  raw {r['raw_s'] * 1e6:10.1f} us  "
                  f"ratio {r['ratio']:.3f}" + (f"  bounded/raw {r['bounded_ratio']:.3f}"
                                                if "bounded_ratio" in r else ""))
        print(f"allreduce_overhead_ratio_default={res['allreduce_overhead_ratio_default']}")
        print(f"allreduce_overhead_ratio={res['allreduce_overhead_ratio']}")
        print("worst ratio at >= 1 MiB: " + ", ".join(
            f"{k} {v:.3f}" for k, v in res["worst_ratio_1mib_up"].items() if v is not None))
        write_json(args.json, res)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

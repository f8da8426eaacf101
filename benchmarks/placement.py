"""Where a receive buffer starts, against where its send buffer starts (comm/placement.py).

    mpiexec -n 2 python -m mpi4py benchmarks/placement.py [--mib 1] [--json out.json]
    mpiexec -n 4 python -m mpi4py benchmarks/placement.py --ops alltoall,pages

On one node MPICH copies a message of 8 KiB and up straight from the sender's memory with
one kernel call (CMA); how fast that copy runs depends on the distance, within a 4 KiB page,
from the send buffer's first byte to the receive buffer's. For each distance in DELTAS this
times, on buffers made for it (every send buffer starts at the same page offset on every
rank, the SPMD case: ranks allocate alike):

    p2p        comm.Sendrecv around the ring (each rank sends to the next, receives from the
               previous), receive buffer `delta` bytes past the send buffer's page offset
    alltoall   comm.Alltoall, output buffer `delta` bytes past the input's

and then the engine on the same send buffers, as a user calls it:

    engine_p2p       engine.send_async + engine.receive around the ring (a fresh result per
                     call, allocated by the engine at the sender's offset, from the header);
                     beside it `protocol`, the same two messages as raw calls (a header, then
                     the data, received once the header is in) at distance 0
    engine_alltoall  engine.all_to_all(a) (its pooled result, placed at `a`'s offset)

and, as op `pages`, the page size of an all_gather's result: raw comm.Allgather into numpy's
own `np.empty` (which advises huge pages from 4 MiB, wherever glibc mapped it) and into a
buffer of huge pages from a 2 MiB boundary (`empty_at(huge=True)`, what the engine's pool
makes from 2 MiB up; placement.py), both at the input's offset, then engine.all_gather(a).

One sample is `inner` calls between barriers (the slowest rank's time); every side takes its
turn in each round (_common.sample_times) and a side's figure is the median of its samples.
The summary divides the slowest distance by the median of the distances outside 1-31 bytes
(`slow_ratio`) and the engine by the raw call at distance 0 (`engine_over_delta0`), at 16
(`engine_over_delta16`, the heap's distance, where an unplaced buffer could land) and, for
p2p, by its own protocol in raw calls (`engine_over_protocol`); for `pages` huge pages by
numpy's buffer (`huge_over_numpy`) and the engine by the raw call into huge pages
(`engine_over_huge`).
"""
from __future__ import annotations

import argparse

import numpy as np
from mpi4py import MPI

import mpishard as ms
from _common import mpi_sync, sample_times, write_json
from mpishard.comm.p2p import HEADER_WORDS
from mpishard.comm.placement import PAGE, SLOW, empty_at, page_offset

DELTAS = [0, 8, 16, 24, 32, 64, 512, 2048, PAGE - 16]
SEND_OFFSET = 1040               # any: only the distance matters (the sweep found it so)


def _ring(comm, a, out):
    n, me = comm.Get_size(), comm.Get_rank()
    return lambda: comm.Sendrecv(a, (me + 1) % n, 7, out, (me - 1) % n, 7)


def _two_messages(comm, a, out):
    """The engine's protocol written with raw calls: a header, then the data, whose receive
    is posted once the header is in (it names the shape), at distance 0."""
    n, me = comm.Get_size(), comm.Get_rank()
    nxt, prev = (me + 1) % n, (me - 1) % n
    h, h_in = np.zeros(HEADER_WORDS, np.int64), np.zeros(HEADER_WORDS, np.int64)

    def call():
        sends = [comm.Isend(h, nxt, 8), comm.Isend(a, nxt, 9)]
        comm.Recv(h_in, prev, 8)
        comm.Recv(out, prev, 9)
        MPI.Request.Waitall(sends)
    return call


def _pages(engine, comm, a):
    """op `pages`: raw Allgather into numpy's own buffer and into huge pages, and the engine."""
    n, at = comm.Get_size(), page_offset(a)
    numpy_out = empty_at(np, a.size * n, np.float32, at)     # a slice of numpy's np.empty
    huge_out = empty_at(np, a.size * n, np.float32, at, huge=True)
    return {"numpy": lambda: comm.Allgather(a, numpy_out),
            "huge": lambda: comm.Allgather(a, huge_out),
            "engine": lambda: engine.all_gather(a, group="dp")}


def _distances(engine, comm, op, a):
    """ops `p2p` and `alltoall`: the raw call at every distance in DELTAS, and the engine."""
    n, me = comm.Get_size(), comm.Get_rank()
    outs = {d: empty_at(np, a.size, np.float32, (SEND_OFFSET + d) % PAGE) for d in DELTAS}
    if op == "p2p":
        sides = {d: _ring(comm, a, outs[d]) for d in DELTAS}

        def ours():
            fut = engine.send_async(a, (me + 1) % n, tag=7)
            engine.receive((me - 1) % n, tag=7)
            fut.result()
        sides["protocol"] = _two_messages(comm, a, outs[0])
    else:
        sides = {d: (lambda o=outs[d]: comm.Alltoall(a, o)) for d in DELTAS}

        def ours():
            engine.all_to_all(a, group="dp")
    sides["engine"] = ours
    return sides


def measure(engine, comm, op, nbytes, samples, inner):
    """{delta: median seconds per call} for the raw call, plus the engine's call."""
    n, me = comm.Get_size(), comm.Get_rank()
    count = nbytes // 4 // n * n
    a = empty_at(np, count, np.float32, SEND_OFFSET)
    a[...] = me
    if op == "pages":
        sides = _pages(engine, comm, a)
    else:
        sides = _distances(engine, comm, op, a)

    def run(fn):                   # each result dropped before the next call, as a loop
        def calls():               # does (a list of them would keep the pool's buffers held)
            for _ in range(inner):
                fn()
        return calls
    names = list(sides)
    times = sample_times([run(sides[k]) for k in names], samples, sync=mpi_sync(comm))
    return {k: float(np.median(t)) / inner for k, t in zip(names, times)}


def summary(times):
    if "huge" in times:
        return {"huge_over_numpy": times["huge"] / times["numpy"],
                "engine_over_huge": times["engine"] / times["huge"]}
    outside = [times[d] for d in DELTAS if d not in SLOW]
    inside = [times[d] for d in DELTAS if d in SLOW]
    res = {"slow_ratio": max(inside) / float(np.median(outside)),
           "engine_over_delta0": times["engine"] / times[0],
           "engine_over_delta16": times["engine"] / times[16]}
    if "protocol" in times:
        res["engine_over_protocol"] = times["engine"] / times["protocol"]
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=1.0, help="MiB each rank sends per call")
    p.add_argument("--ops", default="p2p,alltoall,pages")
    p.add_argument("--samples", type=int, default=9)
    p.add_argument("--quick", action="store_true", help="5 samples")
    p.add_argument("--tiny", action="store_true", help="64 KiB, 3 samples (the smoke test)")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    if args.tiny:
        args.mib, args.samples = 1 / 16, 3
    elif args.quick:
        args.samples = 5
    comm = MPI.COMM_WORLD
    n = comm.Get_size()
    engine = ms.make_engine(ms.MLP([2, 2]), f"dp={n}", comm=comm, dtype=np.float32)
    nbytes = int(args.mib * (1 << 20))
    inner = max(2, (4 << 20) // nbytes)
    res = {"ranks": n, "bytes": nbytes, "send_offset": SEND_OFFSET, "deltas": DELTAS}
    for op in args.ops.split(","):
        times = measure(engine, engine.mesh.comm("dp"), op, nbytes, args.samples, inner)
        res[op] = {"us": {str(k): round(v * 1e6, 1) for k, v in times.items()},
                   **{k: round(v, 3) for k, v in summary(times).items()}}
    if comm.Get_rank() == 0:
        for op in args.ops.split(","):
            r = res[op]
            if op == "pages":
                print(f"pages, {n} ranks, {args.mib:g} MiB, us: " + ", ".join(
                    f"{k} {v:.0f}" for k, v in r["us"].items()) + "; " + ", ".join(
                    f"{k} {v}" for k, v in r.items() if k != "us"))
                continue
            sweep = ", ".join(f"{d}:{r['us'][str(d)]:.0f}" for d in DELTAS)
            ratios = ", ".join(f"{k} {v}" for k, v in r.items() if k != "us")
            extra = "".join(f"; {k} {r['us'][k]:.0f} us" for k in ("engine", "protocol")
                            if k in r["us"])
            print(f"{op}, {n} ranks, {args.mib:g} MiB, us by distance: {sweep}{extra}; {ratios}")
        write_json(args.json, res)


if __name__ == "__main__":
    main()

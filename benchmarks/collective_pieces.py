"""Where engine.all_to_all's time over raw Alltoall goes, one piece added at a time.

    mpiexec -n 4 python -m mpi4py benchmarks/collective_pieces.py [--mib 1] [--rounds 60]
                                                                   [--trials 6]

Every side is timed as benchmarks/collectives.py times one (`inner` back-to-back calls
between barriers, the slowest rank's time), all sides rotating through each round, and its
ratio paired with the raw call of the same round; a trial's figure is the median over the
rounds, on fresh buffers per trial. With 60 rounds the medians of whole runs repeat within
~0.05 at 4 ranks on 2 cores (trials of 9 samples per side spread by 0.1-0.2).
Sides, each a superset of the one above unless said otherwise:

    pooled     comm.Alltoall into the engine's pooled result buffer (not the raw `out`)
    busy1/3    pooled after 1 / 3 us of busy Python (what CPU time alone costs)
    watched    pooled under the guard's deadline (Watchdog.watched: watch, call, clear)
    guarded    pooled through Watchdog.run (count in, the gate's stamp and look, the guard)
    engine     engine.all_to_all(a) as a user calls it
    ungated    the same on a second engine whose gate is removed (no stamps, no looks)
    inlined    (beside the others) everything the engine's call does for a contiguous
               array, written inline in one function: the pooled result, the arrival
               count and stamp, the look for a missing member every LEARN-th call (the gate
               and the learning as the engine does them), the guard's deadline, the byte
               counter with its time. No argument checks, no calls of the engine's own: the
               least a call that keeps the watchdog and the counters can cost from Python.
"""
from __future__ import annotations

import argparse
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms
from collectives import MIB, _plan, _sample
from mpishard.comm.arrivals import RING, STAMPS
from mpishard.comm.placement import empty_at, page_offset
from mpishard.comm.watchdog import LEARN


def sides(engine, ungated_engine, comm, a, out):
    """name -> the call timed; the first is raw."""
    pool, watchdog = engine.comm.pool, engine.comm.watchdog

    def pooled():
        comm.Alltoall(a, pool.get(a.shape, a.dtype, a))

    def busy(us):
        def call():
            until = time.perf_counter() + us * 1e-6
            while time.perf_counter() < until:
                pass
            pooled()
        return call

    def watched():
        watchdog.watched(comm.Alltoall, (a, pool.get(a.shape, a.dtype, a)), "all_to_all", comm,
                         (0, 0))

    def guarded():
        watchdog.run(comm.Alltoall, comm.Ialltoall, (a, pool.get(a.shape, a.dtype, a)),
                     "all_to_all", comm)

    return {"raw": lambda: comm.Alltoall(a, out), "pooled": pooled, "busy1": busy(1.0),
            "busy3": busy(3.0), "watched": watched, "guarded": guarded,
            "engine": lambda: engine.all_to_all(a, group="dp"),
            "ungated": lambda: ungated_engine.all_to_all(a, group="dp"),
            "inlined": inlined(engine, comm, a)}


def inlined(engine, comm, a):
    """The engine's all_to_all of a contiguous `a` with its watchdog and counters inline
    (module docstring): Comm.all_to_all, Watchdog.guarded and CommStats.count in one body."""
    pool, watchdog, clock = engine.comm.pool, engine.comm.watchdog, time.perf_counter
    index, peers = watchdog.slot(comm)
    cells, guard, lagging = watchdog.cells, watchdog.guard, watchdog.lagging
    counter = engine.comm.stats.kinds.setdefault("all_to_all", [0, 0, 0.0])
    share = (comm.Get_size() - 1) / comm.Get_size()

    def call():
        t0 = clock()
        out = pool.get(a.shape, a.dtype, a)
        count = cells[index] + 1
        now = time.monotonic_ns()
        look = False
        if peers:
            cells[STAMPS + index * RING + count % RING] = now
            cells[index] = count
            if count % LEARN == 0 or index in lagging:
                for view in peers:
                    if view[index] < count:
                        look = watchdog.gate(peers, index, count, "all_to_all", comm)
                        break
        else:
            cells[index] = count
        guard.watched = (now, watchdog.timeout_ns, watchdog.message,
                         ("all_to_all", comm, (index, count)))
        try:
            comm.Alltoall(a, out)
        finally:
            guard.watched = None
        if look:
            watchdog.learn(peers, index, count, now)
        counter[0] += 1
        counter[1] += int(share * a.nbytes)
        counter[2] += clock() - t0
        return out
    return call


def without_gate(engine) -> None:
    """Empty the gate's peers for every group the engine has used (stamps and looks off)."""
    slots = engine.comm.watchdog.slots
    for key, (index, _) in list(slots.items()):
        slots[key] = (index, ())


def run(mib=1.0, rounds=60, trials=6, warmup=2):
    world = MPI.COMM_WORLD
    n = world.Get_size()
    engine = ms.make_engine(ms.MLP([2, 2]), f"dp={n}", comm=world, dtype=np.float32)
    ungated = ms.make_engine(ms.MLP([2, 2]), f"dp={n}", comm=world, dtype=np.float32)
    ungated.all_to_all(np.zeros(n, np.float32), group="dp")
    without_gate(ungated)
    comm = engine.mesh.comm("dp")
    count = max(n, int(mib * MIB) // 4 // n * n)          # float32 elements, divisible by n
    inner = _plan(4 * count, quick=False)[0]              # collectives.py's calls per sample
    found: dict = {}
    for trial in range(trials):
        engine.comm.pool.clear()
        a = np.random.default_rng(comm.Get_rank() + trial).standard_normal(count)
        a = a.astype(np.float32)
        # the raw output at a's page offset, as the engine's results are (collectives.py)
        out = empty_at(np, a.shape, a.dtype, page_offset(a))
        calls = sides(engine, ungated, comm, a, out)
        names = list(calls)
        times: dict = {k: [] for k in names}
        for r in range(warmup + rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                t = _sample(comm, calls[k], inner)
                if r >= warmup:
                    times[k].append(t)
        for k in names[1:]:
            found.setdefault(k, []).append(float(np.median(
                [t / raw for t, raw in zip(times[k], times["raw"])])))
    return {"ranks": n, "mib": mib, "rounds": rounds, "gated": engine.comm.watchdog.gated,
            "ratios": {k: float(np.median(v)) for k, v in found.items()}, "trials": found}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=1.0, help="MiB per rank (default 1)")
    p.add_argument("--rounds", type=int, default=60, help="rounds per trial (default 60)")
    p.add_argument("--trials", type=int, default=6, help="trials (default 6)")
    args = p.parse_args(argv)
    res = run(args.mib, args.rounds, args.trials)
    if MPI.COMM_WORLD.Get_rank() == 0:
        print(f"all_to_all {res['mib']:g} MiB, {res['ranks']} ranks (gated {res['gated']}), "
              f"{res['rounds']} rounds; ratio to raw Alltoall, median [trials]")
        for k, v in res["ratios"].items():
            print(f"  {k:8s} {v:.3f}  [{', '.join(f'{x:.3f}' for x in res['trials'][k])}]")


if __name__ == "__main__":
    main()

"""What the stall watchdog costs when nothing stalls (health/watchdog.py).

    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py benchmarks/watchdog_overhead.py

Within one job, alternating sample by sample after a warm-up (medians; a sample is the
slowest rank's time):
  - all_reduce of 1 MiB (float64, into a reused `out=` buffer): the engine with the watchdog on
    (timeout 600 s: Iallreduce + polling + arrival counter), off (timeout 0: Iallreduce + Wait)
    and raw mpi4py `Allreduce` on the same buffers;
  - one MLP train_step (256-512-512-10, batch 64, float64) under dp=2 and tp=2, on vs off;
  - the CPU a rank burns while waiting 2 s in an all_reduce for a peer that sleeps, on vs off
    (process time / wall time of the waiting rank).
Run against an older tree (PYTHONPATH=that/tree) it measures that tree's engine only
("head": make_engine without timeout=).
"""
import inspect
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms

COMM = MPI.COMM_WORLD
HAS_TIMEOUT = "timeout" in inspect.signature(ms.engine.ShardedEngine.__init__).parameters
SIDES = {"on": 600.0, "off": 0.0} if HAS_TIMEOUT else {"head": None}


def engine(model, layout, timeout):
    kwargs = {} if timeout is None else {"timeout": timeout}
    e = ms.make_engine(model, layout, comm=COMM, **kwargs)
    e.load_checkpoint(model.init(seed=0))
    return e


def slowest(seconds) -> float:
    return COMM.allreduce(seconds, op=MPI.MAX)


def alternate(calls: dict, samples: int, reps: int, warmup: int = 3) -> dict:
    """Median over `samples` of the slowest rank's time per call, sides alternating."""
    times = {k: [] for k in calls}
    for i in range(warmup + samples):
        for name, call in calls.items():
            COMM.Barrier()
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            t = slowest((time.perf_counter() - t0) / reps)
            if i >= warmup:
                times[name].append(t)
    return {k: float(np.median(v)) for k, v in times.items()}


def all_reduce_1mib() -> dict:
    model = ms.MLP([4, 4])
    n = COMM.Get_size()
    x = np.random.default_rng(0).standard_normal(1 << 17)       # 1 MiB of float64
    out = np.empty_like(x)
    calls = {"raw": lambda: COMM.Allreduce(x, out, op=MPI.SUM)}
    for side, timeout in SIDES.items():
        e = engine(model, f"dp={n}", timeout)
        calls[side] = lambda e=e: e.all_reduce(x, out=out)
    return alternate(calls, samples=15, reps=20)


def train_step(layout) -> dict:
    model = ms.MLP([256, 512, 512, 10])
    rng = np.random.default_rng(1)
    x, t = rng.standard_normal((64, 256)), rng.standard_normal((64, 10))
    calls = {}
    for side, timeout in SIDES.items():
        e = engine(model, layout, timeout)
        xs, ts = e.shard_batch(x), e.shard_batch(t)
        calls[side] = lambda e=e, xs=xs, ts=ts: e.train_step(xs, ts, ms.losses.MSE())
    return alternate(calls, samples=15, reps=10)


def idle_wait_cpu() -> dict:
    """CPU seconds per wall second of rank 0 waiting 2 s for rank 1 in an all_reduce."""
    model = ms.MLP([4, 4])
    result = {}
    for side, timeout in SIDES.items():
        e = engine(model, f"dp={COMM.Get_size()}", timeout)
        e.barrier()
        if COMM.Get_rank() == 1:
            time.sleep(2.0)
        c0, t0 = time.process_time(), time.perf_counter()
        e.all_reduce(np.ones(4))
        result[side] = COMM.bcast((time.process_time() - c0) / (time.perf_counter() - t0))
    return result


def main():
    n = COMM.Get_size()
    lines = [f"watchdog overhead, {n} ranks, sides {list(SIDES)} (medians, slowest rank)"]
    r = all_reduce_1mib()
    lines.append("all_reduce 1 MiB: " + ", ".join(f"{k} {v * 1e6:.0f} us" for k, v in r.items())
                 + ", ratio to raw: " + ", ".join(f"{k} {v / r['raw']:.3f}" for k, v in r.items()
                                                  if k != "raw"))
    for layout in (f"dp={n}", f"tp={n}"):
        r = train_step(layout)
        ratio = f", on/off {r['on'] / r['off']:.3f}" if HAS_TIMEOUT else ""
        lines.append(f"train_step {layout}: " + ", ".join(f"{k} {v * 1e3:.3f} ms"
                                                           for k, v in r.items()) + ratio)
    r = idle_wait_cpu()
    lines.append("idle wait (2 s) CPU/wall on the waiting rank: "
                 + ", ".join(f"{k} {v:.2f}" for k, v in r.items()))
    if COMM.Get_rank() == 0:
        print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()

"""Scaling: data parallel 1 -> 2, tensor parallel 2 against one rank, pipeline schedules.

    mpiexec -n 2 python -m mpi4py benchmarks/scaling.py dp [--quick] [--json out.json]
    mpiexec -n 2 python -m mpi4py benchmarks/scaling.py tp [--quick] [--json out.json]
    mpiexec -n 4 python -m mpi4py benchmarks/scaling.py pp [--quick] [--json out.json]

dp   weak scaling: one rank alone runs the single-device step on `batch` rows (the other rank
     waits in a barrier), then both run dp=2 on 2 * `batch` rows; samples alternate.
     efficiency = throughput(dp=2) / (2 * throughput(1 rank)) = t_single / t_dp2, for the
     plain sync (overlap=0) and the overlapped one (overlap=1), both with 25 MiB buckets.
tp   the same global batch on a wide MLP: single-device step on one rank against tp=2;
     speedup = t_single / t_tp2 (2.0 would be perfect).
pp   pp=4, microbatches=8: GPipe, 1F1B, interleaved (virtual_stages=2) and zero-bubble
     ZB-H1 (zb1p) step times, the most microbatch-chunks stashed at once
     (engine.stats['peak_stashed'], max over stages), the peak bytes of saved activations
     (the layers' tapes, measured), max over stages, and each schedule's bubble: measured by
     the engine in every timed step (pipeline.pipeline_bubble's 1 - sum of the stages' busy
     time / (pp x the longest stage's step), median over the samples), simulated with the
     last step's measured mean F/B/W durations (as trace-summary does), and the schedule's
     own with unit times (F = 1, B + W = 2; zb1p's is (p-1)/(3m+p-1)). zb1p_bubble_ratio:
     zb1p's measured bubble over 1F1B's (the target: below 1).

float32; every sample's time is the slowest rank's; medians after a warm-up. A crash is a
crash (non-zero exit; run_all.py then fails); BENCH_FAIL=pp (a comma list of modes) makes
that mode raise, for run_all's test.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.cli.trace_summary import measured_and_simulated
from mpishard.parallel.schedules import make_schedule, simulate
from _common import median_times, mpi_sync, write_json

F32 = np.float32


def _data(dims, batch, seed=0):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((batch, dims[0])).astype(F32),
            rng.standard_normal((batch, dims[-1])).astype(F32))


def _engine(model, layout, comm):
    e = ms.make_engine(model, layout, dtype=F32, comm=comm)
    e.load_checkpoint(model.init(seed=0))
    return e


def _step(engine, x, t):
    xl, tl = engine.shard_batch(x), engine.shard_batch(t)
    loss = ms.losses.MSE()
    return lambda: engine.train_step(xl, tl, loss)


def _alone(comm, fn):
    """Run `fn` on rank 0 only (the other ranks idle in the next barrier)."""
    return (lambda: fn()) if comm.Get_rank() == 0 else (lambda: None)


def run_dp(comm, dims, batch, samples):
    n = comm.Get_size()
    model = ms.MLP(dims, activation="relu")
    x1, t1 = _data(dims, batch)
    x2, t2 = _data(dims, n * batch)
    single = _alone(comm, _step(_engine(model, "single", MPI.COMM_SELF), x1, t1))
    layouts = [f"dp={n}", f"dp={n},overlap=1"]
    steps = [_step(_engine(model, lay, comm), x2, t2) for lay in layouts]
    times = median_times([single] + steps, samples, sync=mpi_sync(comm))
    out = {"dims": dims, "batch_per_rank": batch, "ranks": n, "single_s": times[0]}
    for lay, tm in zip(layouts, times[1:]):
        key = "overlap1" if "overlap=1" in lay else "overlap0"
        out[f"dp_{key}_s"] = tm
        out[f"efficiency_{key}"] = times[0] / tm
    out["dp_efficiency"] = max(out["efficiency_overlap0"], out["efficiency_overlap1"])
    return out


def run_tp(comm, dims, batch, samples):
    n = comm.Get_size()
    model = ms.MLP(dims, activation="relu")
    x, t = _data(dims, batch)
    single = _alone(comm, _step(_engine(model, "single", MPI.COMM_SELF), x, t))
    tp = _step(_engine(model, f"tp={n}", comm), x, t)
    t_single, t_tp = median_times([single, tp], samples, sync=mpi_sync(comm))
    return {"dims": dims, "batch": batch, "ranks": n, "single_s": t_single, "tp_s": t_tp,
            "tp_speedup": t_single / t_tp}


def _nbytes(value):
    if value is None:
        return 0
    if isinstance(value, (tuple, list)):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0))


def _track_tape_bytes(engine):
    """Instrument the layers' tapes (benchmark only): returns a dict whose 'peak' is the most
    bytes of saved activations alive at once on this rank since the last reset."""
    meter = {"now": 0, "peak": 0}
    for layer in engine.layers:
        save, pop = layer.save, layer.pop

        def tracked_save(mb, record, value, save=save):
            save(mb, record, value)
            if record:
                meter["now"] += _nbytes(value)
                meter["peak"] = max(meter["peak"], meter["now"])

        def tracked_pop(mb, pop=pop):
            value = pop(mb)
            meter["now"] -= _nbytes(value)
            return value
        layer.save, layer.pop = tracked_save, tracked_pop
    return meter


def _keep_busy(engine, step):
    """`step`, also keeping this rank's (busy_s, step_s) of each train_step it runs (the
    pipeline executor's engine.stats; no communication inside the timed step)."""
    kept = []

    def run():
        step()
        kept.append((engine.stats["busy_s"], engine.stats["step_s"]))
    return run, kept


def _bubbles(comm, kept, skip):
    """Per step after the first `skip` (the warm-up): 1 - sum of the stages' busy time / (pp x
    the longest stage's step), pipeline.pipeline_bubble over the world (pp = world here)."""
    every = np.array(comm.allgather(kept[skip:]))          # (ranks, steps, [busy, step])
    return 1.0 - every[:, :, 0].sum(axis=0) / (len(every) * every[:, :, 1].max(axis=0))


def _simulated_bubble(comm, engine):
    """The last step's actions on every stage, simulated with their measured mean F/B/W
    durations (trace-summary's `simulated`; per-rank clocks are enough for durations)."""
    rows = comm.allgather(engine.stats["timeline"])
    return measured_and_simulated(rows)[1].bubble_fraction


def run_pp(comm, dims, batch, samples, microbatches=8, warmup=2):
    n = comm.Get_size()
    model = ms.MLP(dims, activation="relu")
    x, t = _data(dims, batch)
    schedules = {"gpipe": ("schedule=gpipe", 1), "1f1b": ("schedule=1f1b", 1),
                 "interleaved": ("schedule=interleaved,virtual_stages=2", 2),
                 "zb1p": ("schedule=zb1p", 1)}
    engines, meters, steps, kept = {}, {}, [], {}
    for name, (opts, _) in schedules.items():
        e = _engine(model, f"pp={n},microbatches={microbatches},{opts}", comm)
        engines[name], meters[name] = e, _track_tape_bytes(e)
        step, kept[name] = _keep_busy(e, _step(e, x, t))
        steps.append(step)
    times = median_times(steps, samples, warmup=warmup, sync=mpi_sync(comm))
    out = {"dims": dims, "batch": batch, "ranks": n, "microbatches": microbatches}
    for (name, e), tm in zip(engines.items(), times):
        v = schedules[name][1]
        bubbles = _bubbles(comm, kept[name], warmup)
        out[name] = {"step_s": tm,
                     "peak_stashed": comm.allreduce(int(e.stats["peak_stashed"]), op=MPI.MAX),
                     "peak_activation_bytes": comm.allreduce(meters[name]["peak"], op=MPI.MAX),
                     "vs_gpipe_time": tm / times[0],
                     "bubble_measured": float(np.median(bubbles)),
                     "bubble_measured_range": [float(bubbles.min()), float(bubbles.max())],
                     "bubble_simulated": _simulated_bubble(comm, e),
                     "bubble_schedule": simulate(make_schedule(name, n, microbatches, v), n,
                                                 microbatches, v).bubble_fraction}
    zb, one = out["zb1p"], out["1f1b"]
    out["zb1p_bubble_ratio"] = zb["bubble_measured"] / one["bubble_measured"]
    out["zb1p_bubble_ratio_simulated"] = zb["bubble_simulated"] / one["bubble_simulated"]
    return out


SIZES = {  # mode: (full, quick, tiny) as (dims, batch)
    "dp": (([1024, 2048, 2048, 1024], 256), ([256, 512, 512, 256], 64), ([16, 32, 16], 8)),
    "tp": (([1024, 4096, 1024], 256), ([256, 2048, 256], 64), ([16, 32, 16], 8)),
    # pp: wide enough that compute fills a stage's busy time (at 256 wide, per-action Python
    # and MPI overhead made every schedule's measured bubble about 0.8, zb1p's no smaller)
    "pp": (([1024] * 9, 512), ([1024] * 9, 256), ([16] * 9, 16)),
}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=list(SIZES))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiny", action="store_true", help="toy sizes for the smoke test")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    dims, batch = SIZES[args.mode][2 if args.tiny else 1 if args.quick else 0]
    samples = 3 if args.tiny else 5 if args.quick else 9
    if args.mode in os.environ.get("BENCH_FAIL", "").split(","):
        # the harness's own test: a benchmark that crashes must fail `make bench`
        raise RuntimeError(f"BENCH_FAIL={os.environ['BENCH_FAIL']}: scaling.py {args.mode} "
                           "made to fail")
    res = {"dp": run_dp, "tp": run_tp, "pp": run_pp}[args.mode](comm, dims, batch, samples)
    if comm.Get_rank() == 0:
        print(json.dumps(res))
        write_json(args.json, res)
    sys.stdout.flush()


if __name__ == "__main__":
    main()

"""`plan --calibrate [FILE]`: measure this machine for the step-time model, on every rank of
the MPI job at once, through the engine's own functions: micro-benchmarks, and the reference
models' steps on all of the job's ranks (dp=N). The kernels'
(costs/calibration.py: gemm, bgemm, concurrency, ops) and, here, what needs an engine:

    fixed         seconds per call that does not grow with size: a tiny MLP's train_step at 1
                  and 5 layers and a tiny GPT's at 1 and 3 blocks (width 4-8): per layer or
                  block (forward + backward) and the rest of the step; AdamW per tensor
    step_factor   per model kind, a mid-size reference model's measured train_step over
                  what the above predict for it; optimizer_factor, the same of its AdamW
                  step: each the median of three timings spread over the run, their range
                  in 'step_factor_range' and 'optimizer_factor_range' (calibrate_steps.py)
    mesh_factor   per model kind (more than one rank), the reference model's whole step
                  (train_step and AdamW, the slowest rank) on dp=N measured over what
                  everything else in the calibration predicts for it, the median of three
                  timings spread over the run (its range in 'mesh_factor_range';
                  calibrate_steps.py); applied to layouts of this many ranks only
    collectives   per kind and group size (2, 4, ... up to the job; the world split into
                  groups, all busy together; the engine with its default watchdog, as it
                  trains; all_reduce and reduce_scatter with op='avg'): seconds per call at
                  32 B, 64 KiB, 1 MiB and 4 MiB per rank against the bytes the engine counts
                  ('collective_points'), and [alpha, beta] fitted through them in relative
                  error (fit_alpha_beta: one point's noise moves the line, not the model)

    host_heap     what keep_host_heap did: the calibration keeps the host heap as the train
                  command does by default, so the steps it times are the ones train runs

Every time is costs/calibration.timed's (windows of >= 0.1 s, repeats in passes over a group),
but mesh_factor's, which are `plan --validate`'s (plan_time.measure_steps: rounds of one step
each, the slowest rank's). About a minute and a half at 8 ranks on the 2-core VM.
The JSON (default ~/.cache/mpishard/calibration.json) belongs to the machine, the rank count
and the BLAS thread count it was measured with (see docs/performance.md: BLAS threads).
"""
from __future__ import annotations

import json
import os

import numpy as np
from mpi4py import MPI

from ..health.heap import keep_host_heap
from ..health.threads import pin_blas_threads
from ..costs.calibration import (VERSION, fit_alpha_beta, measure_gemms, measure_ops, timed,
                                 timed_interleaved)
from ..engine import make_engine
from ..models.mlp.spec import MLP
from ..train.optim import AdamW
from .calibrate_steps import (measure_fixed, measure_mesh_factor, measure_step_factor,
                              mesh_seconds, reference_seconds)

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send")
COMM_SIZES = (32, 2 ** 16, 2 ** 20, 2 ** 22)     # bytes per rank of the calls timed


def timed_alone(fn, comm, window=None, repeats=None) -> float:
    """Seconds per call of `fn` on rank 0 while the other ranks wait as a pipeline stage in
    its bubble does: in a receive from rank 0 of an engine on `comm`, waited by its watchdog
    (which yields for a moment, then sleeps: health/watchdog.py). Not in a blocking collective:
    MPICH spins there, and three spinning ranks on 2 cores left rank 0 the share of a core
    it has with every rank busy (this measured concurrency 1.00 at 4 ranks on 2 cores, where
    a receive's wait gives 2)."""
    engine = make_engine(MLP([2, 2]), f"dp={comm.Get_size()}", comm=comm)
    done = np.zeros(1)
    result = None
    comm.Barrier()
    if comm.Get_rank() == 0:
        result = timed(fn, MPI.COMM_SELF, window, repeats)
        for peer in range(1, comm.Get_size()):
            engine.send(peer, done)
    else:
        engine.receive(0)
    return comm.bcast(result, root=0)


def _collective(engine, kind, a):
    """A call of `kind` on the engine's 'dp' group (send: even ranks to the next odd one)."""
    if kind == "send":
        me, n = engine.comm.rank("dp"), engine.comm.size("dp")
        peer = me ^ 1
        return (lambda: engine.send(peer, a) if me % 2 == 0 else engine.receive(peer)) \
            if peer < n else (lambda: None)
    if kind == "broadcast":
        return lambda: engine.broadcast(a, root=0, group="dp")
    if kind in ("all_reduce", "reduce_scatter"):             # as the gradients go: averaged
        return lambda: getattr(engine, kind)(a, op="avg", group="dp")
    return lambda: getattr(engine, kind)(a, group="dp")


def measure_collectives(comm, dtype) -> tuple:
    """({kind: {group size: [alpha, beta]}} fitted (fit_alpha_beta) to
    {kind: {group size: [[bytes counted per call, seconds per call], ...]}} at COMM_SIZES),
    every point timed in interleaved passes."""
    world, itemsize = comm.Get_size(), np.dtype(dtype).itemsize
    fns, counted = {}, {}
    n = 2
    while n <= world:
        sub = comm.Split(comm.Get_rank() // n, comm.Get_rank())
        engine = make_engine(MLP([2, 2]), f"dp={n}", dtype=dtype, comm=sub)
        for kind in KINDS:
            for nbytes in COMM_SIZES:
                a = np.ones(max(n, nbytes // itemsize // n * n), dtype)
                fn = fns[kind, n, nbytes] = _collective(engine, kind, a)
                engine.reset_comm_stats()
                fn()
                counted[kind, n, nbytes] = float(comm.allreduce(
                    sum(engine.comm_bytes.values()), op=MPI.MAX) or a.nbytes)
        n *= 2                # sub stays: the watchdog frees its window on it at exit
    seconds = timed_interleaved(fns, comm)
    points: dict = {k: {} for k in KINDS}
    for (kind, n, nbytes), t in seconds.items():
        points[kind].setdefault(str(n), []).append([counted[kind, n, nbytes], t])
    fitted = {kind: {n: fit_alpha_beta(p) for n, p in by_n.items()}
              for kind, by_n in points.items()}
    return fitted, points


def blas_threads(pinned) -> str:
    """The BLAS threads per rank the rates were measured with (`pinned`: pin_blas_threads')."""
    if pinned.threads is not None:
        return str(pinned.threads)
    return os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS") or ""


def calibrate(path, dtype=np.float32, comm=None) -> dict:
    """Measure this machine on every rank of `comm` (collective); rank 0 writes `path`. The
    BLAS threads are first shared out as engines share them (health/threads.py): before that, 8
    ranks on 2 cores ran OpenBLAS's 2 threads each and the GEMM rates came out far too slow.
    The host heap is kept (health/heap.py) as the train command keeps it, so the steps timed
    here are the ones it runs: without it a step page-faults its activations in again and
    costs more by an amount that hangs on the process's heap history (a GPT layout measured
    43 ms right after a calibration in the same process and 61-64 ms in a fresh one)."""
    comm = MPI.COMM_WORLD if comm is None else comm
    pinned = pin_blas_threads(comm)
    heap = keep_host_heap("keep")         # as `train` runs (its --host-heap keep)
    cal = {"version": VERSION, "ranks": comm.Get_size(), "dtype": np.dtype(dtype).name,
           "host": os.uname().nodename, "blas_threads": blas_threads(pinned),
           "host_heap": heap.why,
           "load_average": os.getloadavg()[0], **measure_gemms(comm, dtype, timed_alone)}
    samples = [reference_seconds(comm, dtype, timed)]       # three times apart: one bad moment
    meshes = [mesh_seconds(comm, dtype)]                     # does not set a factor
    adamw = AdamW(make_engine(MLP([2, 2]), "single", dtype=dtype, comm=MPI.COMM_SELF), lr=1e-4)
    cal["ops"] = measure_ops(comm, dtype, adamw)
    cal["fixed"] = measure_fixed(comm, dtype, timed, cal["ops"])
    samples.append(reference_seconds(comm, dtype, timed))
    meshes.append(mesh_seconds(comm, dtype))
    cal["collectives"], cal["collective_points"] = measure_collectives(comm, dtype)
    samples.append(reference_seconds(comm, dtype, timed))
    meshes.append(mesh_seconds(comm, dtype))
    itemsize = np.dtype(dtype).itemsize
    cal.update(measure_step_factor(samples, cal, itemsize))
    cal.update(measure_mesh_factor(meshes, cal, comm.Get_size(), itemsize))
    if comm.Get_rank() == 0 and path:
        path = os.path.expanduser(path)
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as f:
            json.dump(cal, f, indent=1)
    return cal

"""The GPU communication paths on a GPU: NCCL's smoke test, the staged all_reduce's bandwidth.

    mpiexec -n 1 python3 benchmarks/gpu_comm_check.py       # gpu_check.py's `nccl` part
    mpiexec -n 2 python3 benchmarks/gpu_comm_check.py
    mpiexec -n 2 python3 benchmarks/gpu_comm_check.py --standin   # the CPU stand-ins

check_comm(comm, standin=False) -> rows, each a dict with `check` and `ok` (or `error`):

nccl_smoke        every rank alone (a size-1 NcclCommunicator, what one lent GPU can run):
                  Comm.all_reduce, all_gather and broadcast of 1 Mi float32 through
                  gpu_comm="nccl" equal the input; the NCCL path was taken (comm_path).
staged_allreduce  at 2 ranks (sharing a GPU): the staged path's all_reduce of 64 MiB
                  float32, pipelined in chunks (pinned buffers), and in one piece, beside a
                  raw host `Allreduce` of the same size in the same run; GB/s of each (bytes
                  / seconds, the median of 5), ratio = staged / host, target ratio >= 0.8
                  (`met`; a target to report, not a failure).
nccl_allreduce    at 2 ranks with a GPU each (2 or more GPUs): the NCCL path's all_reduce of
                  64 MiB, exact, and its GB/s.

--standin runs the same on the test suite's device double and NCCL stand-in
(tests/device_double.py, tests/nccl_double.py: each rank "has" a GPU of its own for the NCCL
parts), so `make test` exercises this script without a GPU. Rank 0 prints one `BENCH {json}`
line per row; exit status 1 when a row fails. Imports without cupy.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))       # the stand-ins, for --standin

from device_double import DeviceModule      # noqa: E402  (plain numpy; no cupy)
from nccl_double import NcclModule          # noqa: E402

from mpishard.comm.backend import Backend                # noqa: E402
from mpishard.comm.collectives import Comm               # noqa: E402
from mpishard.comm.gpu import try_import_cupy            # noqa: E402
from mpishard.comm.mesh import DeviceMesh, parse_layout  # noqa: E402
from mpishard.health.watchdog import Watchdog            # noqa: E402

SIZE = 64 << 20          # bytes of the bandwidth checks
SMOKE = 1 << 20          # elements of the smoke test
REPS = 5
TARGET = 0.8             # staged / raw host Allreduce


def backend_for(comm, gpu_comm, standin, n_devices):
    """A Backend on `gpu_comm` over cupy, or over the stand-ins with `n_devices` GPUs."""
    if not standin:
        return Backend("gpu", comm, gpu_comm=gpu_comm)
    xp = DeviceModule(n_devices=n_devices)
    nccl = NcclModule(xp, world=comm) if gpu_comm == "nccl" else None
    return Backend("gpu", comm, array_module=xp, gpu_comm=gpu_comm, nccl_module=nccl)


def engine_for(comm, backend):
    mesh = DeviceMesh(comm, parse_layout(f"dp={comm.Get_size()}"))
    return Comm(mesh, backend, watchdog=Watchdog(mesh, 120))


def median_seconds(fn, sync, comm) -> float:
    fn()                                            # warm-up: buffers, communicators
    times = []
    for _ in range(REPS):
        sync()
        comm.Barrier()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def nccl_smoke(standin) -> dict:
    """A size-1 NcclCommunicator on this rank's GPU (module docstring)."""
    comm = MPI.COMM_SELF
    backend = backend_for(comm, "nccl", standin, 1)
    engine, xp = engine_for(comm, backend), backend.xp
    host = np.arange(SMOKE, dtype=np.float32)
    a = xp.asarray(host)
    t0 = time.perf_counter()
    ok = (np.array_equal(backend.to_host(engine.all_reduce(a)), host)
          and np.array_equal(backend.to_host(engine.all_gather(a)), host)
          and np.array_equal(backend.to_host(engine.broadcast(a)), host))
    seconds = time.perf_counter() - t0
    engine.close()
    return dict(check="nccl_smoke", ok=bool(ok and backend.comm_path == "nccl"),
                path=backend.comm_path, why=backend.comm_path_reason, seconds=seconds)


def staged_allreduce(comm, standin) -> dict:
    """Staged all_reduce of SIZE bytes, pipelined and in one piece, beside MPI's on host."""
    backend = backend_for(comm, "staged", standin, 1)
    engine, xp = engine_for(comm, backend), backend.xp
    n = SIZE // 4
    a, out = xp.ones(n, dtype=np.float32), xp.empty(n, dtype=np.float32)
    host = np.ones(n, dtype=np.float32)
    seconds = {"host": median_seconds(lambda: comm.Allreduce(MPI.IN_PLACE, host), lambda: None,
                                      comm)}
    pipelined = backend.pipeline.chunk_bytes
    for name, chunk in (("one_piece", SIZE * 4), ("staged", pipelined)):
        backend.pipeline.chunk_bytes = chunk
        seconds[name] = median_seconds(lambda: engine.all_reduce(a, out=out),
                                       backend.synchronize, comm)
    exact = bool(np.array_equal(backend.to_host(out), np.full(n, comm.Get_size(), np.float32)))
    engine.close()
    gbps = {k: SIZE / v / 1e9 for k, v in seconds.items()}
    ratio = gbps["staged"] / gbps["host"]
    return dict(check="staged_allreduce", ok=exact, mib=SIZE >> 20, ranks=comm.Get_size(),
                staged_GBps=gbps["staged"], one_piece_GBps=gbps["one_piece"],
                host_GBps=gbps["host"], ratio=ratio, target=TARGET, met=ratio >= TARGET,
                chunk_mib=pipelined / (1 << 20), chunks=backend.pipeline.chunks)


def nccl_allreduce(comm, standin) -> dict:
    """The NCCL path's all_reduce of SIZE bytes between ranks with a GPU each."""
    backend = backend_for(comm, "nccl", standin, comm.Get_size())
    engine, xp = engine_for(comm, backend), backend.xp
    n = SIZE // 4
    a, out = xp.ones(n, dtype=np.float32), xp.empty(n, dtype=np.float32)
    s = median_seconds(lambda: engine.all_reduce(a, out=out), backend.synchronize, comm)
    exact = bool(np.array_equal(backend.to_host(out), np.full(n, comm.Get_size(), np.float32)))
    engine.close()
    return dict(check="nccl_allreduce", ok=exact, mib=SIZE >> 20, ranks=comm.Get_size(),
                GBps=SIZE / s / 1e9, path=backend.comm_path)


def gpu_count(standin) -> int:
    cupy = None if standin else try_import_cupy()
    if standin:
        return MPI.COMM_WORLD.Get_size()
    try:
        return cupy.cuda.runtime.getDeviceCount() if cupy is not None else 0
    except Exception:
        return 0


def check_comm(comm=None, standin=False, report=lambda row: None) -> list:
    """The rows of the module docstring, for the ranks of `comm` (default COMM_WORLD);
    `report(row)` as each row ends. A row that raised has `error` instead of `ok`."""
    comm = MPI.COMM_WORLD if comm is None else comm
    checks = [("nccl_smoke", lambda: nccl_smoke(standin))]
    if comm.Get_size() == 2:
        checks.append(("staged_allreduce", lambda: staged_allreduce(comm, standin)))
        if gpu_count(standin) >= 2:
            checks.append(("nccl_allreduce", lambda: nccl_allreduce(comm, standin)))
    rows = []
    for name, fn in checks:
        try:
            row = fn()
        except Exception as exc:            # a failed check is a row, the next ones still run
            row = dict(check=name, error=f"{type(exc).__name__}: {exc}")
        row["standin"] = standin
        rows.append(row)
        report(row)
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--standin", action="store_true", help="the CPU stand-ins for cupy and NCCL")
    args = p.parse_args(argv)
    rank = MPI.COMM_WORLD.Get_rank()
    rows = check_comm(standin=args.standin, report=lambda row: rank == 0 and print(
        "BENCH " + json.dumps(row), flush=True))
    failed = [r for r in rows if "error" in r or not r.get("ok")]
    return 1 if MPI.COMM_WORLD.allreduce(len(failed)) else 0


if __name__ == "__main__":
    sys.exit(main())

"""The float64 reference check on a device: every layout's step equals numpy's single device.

    mpiexec -n 1 python -m mpi4py benchmarks/gpu_reference.py            # real cupy
    mpiexec -n 2 python -m mpi4py benchmarks/gpu_reference.py
    mpiexec -n 2 python -m mpi4py benchmarks/gpu_reference.py --standin   # CPU stand-in

For the MLP, the MoE and the GPT, and for each layout of the world size (1 rank: single;
2 ranks: dp=2, tp=2, fsdp=2, pp=2 and, where the model has them, ep=2 (MoE) and cp=2 (GPT)),
one train_step on device arrays (real cupy: `device="gpu"`, the MPI's own CUDA-awareness
answer; --standin: tests/device_double.py's strict stand-in, staged) is compared with the numpy
`SingleDevice` reference: loss, every gathered gradient and the gathered forward, float64,
rtol 1e-9 relative to the largest |reference| (tests/conftest.py's assert_close rule). The MoE
reference routes with groups = the layout's data-parallel size, as tests/parallel/test_moe.py.

Each case prints one line `REF <model> <layout> ok|FAIL <max rel diff or error>` as it ends
(rank 0); a failing case does not stop the others; exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpishard as ms

RTOL = 1e-9
LAYOUTS = {1: ["single"], 2: ["dp=2", "tp=2", "fsdp=2", "pp=2,microbatches=2", "ep=2", "cp=2"]}
ONLY = {"ep=2": "moe", "cp=2": "gpt"}          # layouts only one model kind has
MOE = {"single", "dp=2", "ep=2"}               # an ms.MoE takes single, dp, ep, dp x ep only


def models(n_data):
    """(name, engine spec, reference spec, loss, x, t) for each model kind."""
    rng = np.random.default_rng(0)
    gpt = ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2, n_layers=2)
    yield ("mlp", ms.MLP([6, 8, 8, 4], activation="tanh"), None, ms.losses.MSE(),
           rng.normal(size=(8, 6)), rng.normal(size=(8, 4)))
    yield ("moe", ms.MoE(6, 8, 4, top_k=2), ms.MoE(6, 8, 4, top_k=2, groups=n_data),
           ms.losses.MSE(), rng.normal(size=(16, 6)), rng.normal(size=(16, 6)))
    yield ("gpt", gpt, None, ms.losses.CrossEntropy(),
           rng.integers(0, 16, (4, 8)), rng.integers(0, 16, (4, 8)))


def device_for(comm, standin):
    if not standin:
        return "gpu"
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from device_double import DeviceModule

    from mpishard.comm.backend import Backend
    return Backend("gpu", comm, cuda_aware=False, array_module=DeviceModule())


def max_rel(got, want) -> float:
    got, want = np.asarray(got), np.asarray(want)
    if got.shape != want.shape:
        raise ValueError(f"shape {got.shape} != {want.shape}")
    scale = max(float(np.abs(want).max()) if want.size else 0.0, 1e-300)
    return float(np.abs(got - want).max()) / scale if want.size else 0.0


def one_case(comm, standin, layout, spec, ref_spec, loss, x, t) -> float:
    """The largest relative difference over loss, gradients and forward (collective)."""
    ref = ms.SingleDevice(ref_spec or spec)
    params = (ref_spec or spec).init(seed=3)
    ref.load_checkpoint(params)
    want_loss, want = ref.train_step(x, t, loss)
    want = {k: v.copy() for k, v in want.items()}
    engine = ms.make_engine(spec, layout, comm=comm, device=device_for(comm, standin),
                            report_errors=False)
    engine.load_checkpoint(params)
    to_host = engine.backend.to_host
    xd, td = engine.shard_batch(x), engine.shard_batch(t)
    got_loss, grads = engine.train_step(xd, td, loss)
    worst = max_rel([got_loss], [want_loss])
    full = engine.gather_grads(grads)
    if set(full) != set(want):
        raise ValueError(f"gradient names {sorted(full)} != {sorted(want)}")
    for name in want:
        worst = max(worst, max_rel(to_host(full[name]), want[name]))
    y = to_host(engine.gather_batch(engine.predict(xd)))
    return max(worst, max_rel(y, ref.predict(x)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--standin", action="store_true", help="tests/device_double.py, not cupy")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    n, rank, failed = comm.Get_size(), comm.Get_rank(), 0
    for layout in LAYOUTS.get(n, []):
        n_data = ms.parse_layout(layout).data_parallel_size
        for name, spec, ref_spec, loss, x, t in models(n_data):
            if ONLY.get(layout, name) != name or (name == "moe" and layout not in MOE):
                continue
            t0 = time.perf_counter()
            try:
                err = one_case(comm, args.standin, layout, spec, ref_spec, loss, x, t)
                ok, what = err <= RTOL, f"{err:.2e}"
            except Exception as exc:                   # reported, the next case still runs
                ok, what = False, f"{type(exc).__name__}: {exc}"
            ok = comm.allreduce(ok, op=MPI.LAND)
            failed += not ok
            if rank == 0:
                print(f"REF {name} {layout} {'ok' if ok else 'FAIL'} {what} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
    if not LAYOUTS.get(n):
        print(f"REF no layouts for {n} ranks (1 or 2)", flush=True)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

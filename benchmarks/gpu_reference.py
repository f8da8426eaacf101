"""The float64 reference check on a device: every layout's step equals numpy's single device.

    mpiexec -n 1 python -m mpi4py benchmarks/gpu_reference.py            # real cupy
    mpiexec -n 2 python -m mpi4py benchmarks/gpu_reference.py
    mpiexec -n 2 python -m mpi4py benchmarks/gpu_reference.py --standin   # CPU stand-in

For the MLP, the MoE, the GPT and the Llama (grouped-query: 4 heads, 2 kv heads; vocabulary 17,
odd, so tp pads it), and for each layout of the world size (1 rank: single; 2 ranks: dp=2,
tp=2, fsdp=2, pp=2 and, where the model has them, ep=2 (MoE) and cp=2 (GPT, Llama)), plus a
tied GPT under pp=2 (the embedding on both ends of the pipeline) and a GPT with an odd
vocabulary under tp=2 (padded), one train_step on device arrays (real cupy: `device="gpu"`,
the MPI's own CUDA-awareness answer; --standin: tests/device_double.py's strict stand-in,
staged) is compared with the numpy `SingleDevice` reference: loss, every gathered gradient and
the gathered forward, float64, rtol 1e-9 relative to the largest |reference|
(tests/conftest.py's assert_close rule). The MoE reference routes with groups = the layout's
data-parallel size, as tests/parallel/test_moe.py.

Two more kinds of case (1 rank: single; 2 ranks: tp=2):
generate-gpt, generate-llama   engine.generate of three prompts of unequal length, greedy
             (temperature 0), past seq_len (the cache's window is refilled): the ids equal the
             numpy SingleDevice's, every one.
hf-llama     ms.hf.save of the Llama in bfloat16 (rank 0, a scratch directory), then
             ms.hf.load_into onto a device engine: every gathered parameter equals
             ms.hf.load's (numpy, widened to float64) exactly (difference 0).

Each case prints one line `REF <case> <layout> ok|FAIL <max rel diff or error>` as it ends
(rank 0); a failing case does not stop the others; exit status 1 if any failed.
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpishard as ms

RTOL = 1e-9
PP = "pp=2,microbatches=2"
LAYOUTS = {1: ["single"], 2: ["dp=2", "tp=2", "fsdp=2", PP, "ep=2", "cp=2"]}
NOT_EP = {"single", "dp=2", "tp=2", "fsdp=2", PP, "cp=2"}
RUNS = {"mlp": NOT_EP - {"cp=2"}, "moe": {"single", "dp=2", "ep=2"}, "gpt": NOT_EP,
        "llama": NOT_EP, "gpt-tied": {PP}, "gpt-pad": {"tp=2"}}   # model -> its layouts
EXTRA = {1: "single", 2: "tp=2"}               # the generate and hf cases' layout
PROMPTS = [[1, 2, 3], [4, 5], [6, 7, 8, 9, 10]]   # 5 + 6 new tokens pass seq_len 8


def llama():
    return ms.Llama(vocab_size=17, seq_len=8, d_model=16, n_heads=4, n_kv_heads=2, n_layers=2)


def models(n_data):
    """(name, engine spec, reference spec, loss, x, t) for each model kind."""
    rng = np.random.default_rng(0)
    ce = ms.losses.CrossEntropy()
    yield ("mlp", ms.MLP([6, 8, 8, 4], activation="tanh"), None, ms.losses.MSE(),
           rng.normal(size=(8, 6)), rng.normal(size=(8, 4)))
    yield ("moe", ms.MoE(6, 8, 4, top_k=2), ms.MoE(6, 8, 4, top_k=2, groups=n_data),
           ms.losses.MSE(), rng.normal(size=(16, 6)), rng.normal(size=(16, 6)))
    for name, spec in (("gpt", ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2,
                                      n_layers=2)),
                       ("llama", llama()),
                       ("gpt-tied", ms.GPT(vocab_size=16, seq_len=8, d_model=16, n_heads=2,
                                           n_layers=2, tied=True)),
                       ("gpt-pad", ms.GPT(vocab_size=17, seq_len=8, d_model=16, n_heads=2,
                                          n_layers=2))):
        v = spec.vocab_size
        yield name, spec, None, ce, rng.integers(0, v, (4, 8)), rng.integers(0, v, (4, 8))


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


def within(err):
    return err <= RTOL, f"{err:.2e}"


def generate_case(comm, standin, layout, spec):
    """(ok, what): greedy batched generate on the device equals numpy's ids."""
    params = spec.init(seed=5)
    ref = ms.SingleDevice(spec)
    ref.load_checkpoint(params)
    want = ref.generate([list(p) for p in PROMPTS], 6, temperature=0)
    engine = ms.make_engine(spec, layout, comm=comm, device=device_for(comm, standin),
                            report_errors=False)
    engine.load_checkpoint(params)
    got = engine.generate([list(p) for p in PROMPTS], 6, temperature=0)
    same = sum(a == b for g, w in zip(got, want) for a, b in zip(g, w))
    total = sum(map(len, want))
    return got == want, f"{same}/{total} ids equal"


def hf_case(comm, standin, layout):
    """(ok, what): ms.hf.load_into of a bfloat16 directory onto the device engine equals
    ms.hf.load's arrays exactly."""
    path = tempfile.mkdtemp(prefix="mpishard-gpu-hf-") if comm.Get_rank() == 0 else None
    path = comm.bcast(path)
    try:
        err = None
        if comm.Get_rank() == 0:
            try:
                ms.hf.save(path, llama(), llama().init(seed=7), dtype="bfloat16")
            except Exception as exc:
                err = f"rank 0's ms.hf.save: {type(exc).__name__}: {exc}"
        err = comm.bcast(err)
        if err is not None:                             # every rank raises it, none waits
            raise RuntimeError(err)
        spec, want = ms.hf.load(path)
        engine = ms.make_engine(ms.hf.read_model(path), layout, comm=comm,
                                device=device_for(comm, standin), report_errors=False)
        ms.hf.load_into(engine, path)
        got = engine.gather_params()
        if set(got) != set(want):
            raise ValueError(f"parameter names {sorted(got)} != {sorted(want)}")
        worst = max(max_rel(engine.backend.to_host(got[k]), np.asarray(want[k], np.float64))
                    for k in want)
        return worst == 0.0, f"{worst:.2e} (bfloat16 {len(want)} tensors)"
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(path, ignore_errors=True)


def report(comm, name, layout, case) -> int:
    """Run case() -> (ok, what) on every rank, print rank 0's line; 1 if any rank failed."""
    t0 = time.perf_counter()
    try:
        ok, what = case()
    except Exception as exc:                   # reported, the next case still runs
        ok, what = False, f"{type(exc).__name__}: {exc}"
    ok = comm.allreduce(ok, op=MPI.LAND)
    if comm.Get_rank() == 0:
        print(f"REF {name} {layout} {'ok' if ok else 'FAIL'} {what} "
              f"({time.perf_counter() - t0:.1f} s)", flush=True)
    return int(not ok)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--standin", action="store_true", help="tests/device_double.py, not cupy")
    args = p.parse_args(argv)
    comm = MPI.COMM_WORLD
    n, failed = comm.Get_size(), 0
    for layout in LAYOUTS.get(n, []):
        n_data = ms.parse_layout(layout).data_parallel_size
        for name, spec, ref_spec, loss, x, t in models(n_data):
            if layout in RUNS[name]:
                failed += report(comm, name, layout, lambda: within(one_case(
                    comm, args.standin, layout, spec, ref_spec, loss, x, t)))
    if n in EXTRA:
        layout = EXTRA[n]
        for name, spec in (("gpt", ms.GPT(vocab_size=17, seq_len=8, d_model=16, n_heads=2,
                                          n_layers=2)), ("llama", llama())):
            failed += report(comm, f"generate-{name}", layout,
                             lambda: generate_case(comm, args.standin, layout, spec))
        failed += report(comm, "hf-llama", layout, lambda: hf_case(comm, args.standin, layout))
    if not LAYOUTS.get(n):
        print(f"REF no layouts for {n} ranks (1 or 2)", flush=True)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A mixture-of-experts layer trained under expert parallelism, checked against `single`.

    mpiexec -n 2 python -m mpi4py examples/moe_expert_parallel.py
    mpiexec -n 4 python -m mpi4py examples/moe_expert_parallel.py --layout dp=2,ep=2

The task is synthetic: a hidden "teacher" MoE (top-1, 4 experts) maps x to t, and a student
`ms.MoE(8, 16, 4, top_k=2)` learns to imitate it with AdamW on MSE. Under `ep=N` each rank
holds 4/N experts and its own 64/N tokens; tokens travel to their experts' ranks with
all_to_all_v and come back the same way, and assignments over an expert's capacity are dropped.

Every step the same update is run by the single-device reference (on every rank, COMM_SELF)
with as many capacity groups as the layout has data-parallel ranks, so both drop exactly the
same tokens. Rank 0 prints the loss, the drops and the tokens per expert; the exit status is
non-zero if the losses or, at the end, any parameter differ from `single` (float64, rtol 1e-9).

Options: --layout (default ep=<world size>), --steps N, --top-k K, --capacity-factor C.
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms

RTOL = 1e-9


def rel_diff(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max()) / max(float(np.abs(b).max()), 1e-300)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layout", default=f"ep={MPI.COMM_WORLD.Get_size()}")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument("--lr", type=float, default=0.01)
    args = parser.parse_args()

    def student(groups):
        return ms.MoE(8, 16, 4, top_k=args.top_k, capacity_factor=args.capacity_factor,
                      activation="relu", groups=groups)

    engine = ms.make_engine(student(None), args.layout, dtype=np.float64)
    n_data = engine.data_parallel_size
    single = ms.SingleDevice(student(n_data))       # the same capacity groups as the layout
    params = student(None).init(seed=0)
    engine.load_checkpoint(params)
    single.load_checkpoint(params)
    opt, opt_single = ms.optim.AdamW(engine, lr=args.lr), ms.optim.AdamW(single, lr=args.lr)
    rank0 = engine.device_id == 0

    teacher_model = ms.MoE(8, 32, 4, top_k=1, capacity_factor=None)
    teacher = ms.SingleDevice(teacher_model)
    teacher.load_checkpoint(teacher_model.init(seed=1))
    rng = np.random.default_rng(0)
    mse = ms.losses.MSE()
    if rank0:
        print(f"layout {args.layout!r}: {engine.layout.size('ep')} expert-parallel x "
              f"{n_data // engine.layout.size('ep')} data-parallel ranks, "
              f"{4 // engine.layout.size('ep')} experts per rank")
    ok = True
    for step in range(args.steps):
        x = rng.normal(size=(64, 8))
        t = teacher.predict(x)
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), mse)
        want, want_grads = single.train_step(x, t, mse)
        same = rel_diff(loss, want) <= RTOL and engine.stats["moe_dropped"] == \
            single.stats["moe_dropped"]
        ok &= same
        if rank0:
            print(f"step {step:3d}  loss {loss:.6f}  (single {want:.6f})  dropped "
                  f"{engine.stats['moe_dropped']:3d}/{64 * args.top_k}  kept per expert "
                  f"{engine.stats['moe_kept']}" + ("" if same else "  <-- DIFFERS"))
        opt.step(grads)
        opt_single.step(want_grads)

    got, ref = engine.gather_params(), single.gather_params()
    worst = max(rel_diff(got[n], ref[n]) for n in ref)
    ok &= worst <= RTOL
    if rank0:
        verdict = "matches single" if ok else "DISAGREES with single"
        print(f"after {args.steps} steps: max relative parameter difference {worst:.2e} "
              f"(rtol {RTOL:g}): {verdict}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()

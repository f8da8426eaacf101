"""Soak test (`make soak`, not part of `make test`): a long data-parallel run that must not leak.

    mpiexec -n 2 python -m mpi4py benchmarks/soak.py [--steps 40000] [--checkpoint-every 500]

Trains an MLP on the synthetic regression set under dp=<world size> for --steps optimizer steps
(AdamW, clipping, a sharded checkpoint every --checkpoint-every steps into a temporary
directory) and samples every rank's resident memory (VmRSS) every --sample-every steps. After
the warm-up (the first --warmup-fraction of the steps, and at least past the first checkpoint)
it checks, on every rank:

    memory   the largest VmRSS after the warm-up exceeds VmRSS at its end by < --max-growth (2%)
    requests no MPI request left pending: comm Futures created and not completed
             (comm.p2p.Future.in_flight) and the Comm's pending receives are both 0 at the end
    files    the open file descriptors (/proc/self/fd) are as many at the end as after warm-up

and prints the figures per rank from rank 0; exit code 1 if a check failed on any rank.
The loss/grad-norm/lr histories are a bounded window (train/history.py); their own size (the
deques and the float objects they hold) is printed beside the growth, after warm-up and at the
end, and stays flat once the window is full.
"""
import argparse
import os
import resource
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.checkpoint import Checkpointer
from mpishard.comm.p2p import Future
from mpishard.train.data import synthetic_regression
from mpishard.train.trainer import Callback, Trainer

MB = 1 << 20


def vmrss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def history_bytes(state) -> int:
    """Bytes held by the TrainState's loss/grad-norm/lr histories: the lists and their floats
    (an object in several lists, the lr, counted once)."""
    lists = (state.loss_history, state.grad_norm_history, state.lr_history)
    floats = {id(v): sys.getsizeof(v) for h in lists for v in h}
    return sum(map(sys.getsizeof, lists)) + sum(floats.values())


class Sampler(Callback):
    """VmRSS every `every` steps; VmRSS, open fds and the histories' bytes at the end of the
    warm-up."""

    def __init__(self, every: int, warmup: int):
        self.every, self.warmup = every, warmup
        self.samples, self.warm_rss, self.warm_fds, self.warm_hist = [], None, None, None

    def on_step_end(self, trainer) -> None:
        step = trainer.state.step
        if step == self.warmup:
            self.warm_rss, self.warm_fds = vmrss(), open_fds()
            self.warm_hist = history_bytes(trainer.state)
        if step % self.every == 0:
            self.samples.append((step, vmrss()))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40_000)
    p.add_argument("--checkpoint-every", type=int, default=500)
    p.add_argument("--sample-every", type=int, default=100)
    p.add_argument("--warmup-fraction", type=float, default=0.2)
    p.add_argument("--max-growth", type=float, default=0.02)
    p.add_argument("--dims", default="16,128,128,1")
    p.add_argument("--batch", type=int, default=64)
    return p.parse_args(argv)


def soak(args, comm, directory) -> dict:
    dims = [int(v) for v in args.dims.split(",")]
    model = ms.MLP(dims)
    engine = ms.make_engine(model, f"dp={comm.Get_size()}", dtype=np.float32, comm=comm)
    engine.load_checkpoint(model.init(seed=0))
    opt = ms.optim.AdamW(engine, lr=1e-3)
    data = synthetic_regression(4096, 256, dims[0], dims[-1], seed=0)
    warmup = max(1, int(args.steps * args.warmup_fraction))
    if 0 < args.checkpoint_every < args.steps:          # past the first checkpoint
        warmup = max(warmup, args.checkpoint_every + 1)
    sampler = Sampler(args.sample_every, warmup)
    ckpt = Checkpointer(os.path.join(directory, "ckpt"), args.checkpoint_every)
    trainer = Trainer(engine, opt, data, batch=args.batch, steps=args.steps, clip=1.0,
                      log_every=0, progress=False, callbacks=[sampler, ckpt])
    t0 = time.perf_counter()
    metrics = trainer.fit()
    after = [rss for step, rss in sampler.samples if step > warmup]
    return {"rank": comm.Get_rank(), "warm_rss": sampler.warm_rss,
            "max_rss_after": max(after) if after else sampler.warm_rss, "end_rss": vmrss(),
            "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "warm_fds": sampler.warm_fds, "end_fds": open_fds(),
            "warm_hist": sampler.warm_hist, "end_hist": history_bytes(trainer.state),
            "in_flight": Future.in_flight, "pending_receives": len(engine.comm.pending_receives),
            "wall_s": time.perf_counter() - t0, "final_loss": metrics["final_loss"],
            "warmup": warmup, "trace": sampler.samples[::max(1, len(sampler.samples) // 10)]}


def report(args, rows) -> bool:
    ok = True
    print(f"soak: {args.steps} steps, dp={len(rows)}, model {args.dims}, batch {args.batch}, "
          f"checkpoint every {args.checkpoint_every}, warm-up {rows[0]['warmup']} steps, "
          f"{rows[0]['wall_s']:.1f} s, final loss {rows[0]['final_loss']:.4g}")
    for r in rows:
        growth = (r["max_rss_after"] - r["warm_rss"]) / r["warm_rss"]
        checks = {"memory": growth < args.max_growth,
                  "requests": r["in_flight"] == 0 and r["pending_receives"] == 0,
                  "files": r["end_fds"] <= r["warm_fds"]}
        ok &= all(checks.values())
        print(f"  rank {r['rank']}: VmRSS {r['warm_rss'] / MB:.2f} MB after warm-up, max "
              f"{r['max_rss_after'] / MB:.2f} MB after ({100 * growth:+.2f}%, limit "
              f"{100 * args.max_growth:g}%), end {r['end_rss'] / MB:.2f} MB, peak "
              f"{r['peak_rss'] / MB:.2f} MB; requests in flight {r['in_flight']}, pending "
              f"receives {r['pending_receives']}; fds {r['warm_fds']} -> {r['end_fds']}; "
              f"histories {r['warm_hist'] / MB:.2f} -> {r['end_hist'] / MB:.2f} MB (bounded, "
              f"{100 * (r['end_hist'] - r['warm_hist']) / r['warm_rss']:+.2f}% of VmRSS); "
              + ", ".join(f"{k} {'ok' if v else 'FAILED'}" for k, v in checks.items()))
    print("  rank 0 VmRSS (MB) by step: " + ", ".join(f"{step} {rss / MB:.2f}"
                                                  for step, rss in rows[0]["trace"]))
    print("soak: " + ("passed" if ok else "FAILED"), flush=True)
    return ok


def main(argv=None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    comm = MPI.COMM_WORLD
    directory = tempfile.mkdtemp(prefix="mpishard-soak-") if comm.Get_rank() == 0 else None
    directory = comm.bcast(directory, root=0)
    try:
        row = soak(args, comm, directory)
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(directory, ignore_errors=True)
    rows = comm.gather(row, root=0)
    ok = report(args, rows) if comm.Get_rank() == 0 else True
    return 0 if comm.bcast(ok, root=0) else 1


if __name__ == "__main__":
    code = main()
    if code:                          # finalize first, so mpi4py does not MPI_Abort the exit
        sys.stdout.flush()
        MPI.Finalize()
    sys.exit(code)

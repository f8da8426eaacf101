"""The document's pipeline: a 16 -> 8 -> 1 sigmoid/BCE model cut into two stages.

    mpiexec -n 2 python -m mpi4py examples/pipeline_bce_two_stages.py

Stage 0 (rank 0) holds layer 0, relu(x W0 + b0), and sends the hidden activation to stage 1;
stage 1 (rank 1) holds layer 1, sigmoid(h W1 + b1), computes the BCE loss and sends dL/dh
back. The batch of 32 rows goes through in 4 microbatches on the 1F1B schedule. Every step is
compared with the single-device reference (loss and every gradient, float64, rtol 1e-9), the
plain SGD update `W -= lr * dW` is applied to each stage's own weights, and at the end a
request stream goes through `inference_loop`. Rank 0 prints; the exit status is non-zero if
the pipeline ever disagrees with `single`.

Options: --schedule gpipe|1f1b, --microbatches M, --steps N.
"""
import argparse
import sys

import numpy as np
from mpi4py import MPI

import mpishard as ms

RTOL = 1e-9


def close(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return float(np.abs(a - b).max()) <= RTOL * max(float(np.abs(b).max()), 1e-300)


class Collect:
    def __init__(self):
        self.items = []

    def write(self, arr):
        self.items.append(np.array(arr))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="1f1b", choices=["gpipe", "1f1b"])
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--lr", type=float, default=0.5)
    args = parser.parse_args()

    model = ms.MLP(dims=[16, 8, 1], activation="relu", final_activation="sigmoid")
    params = model.init(seed=0)
    layout = f"pp=2,microbatches={args.microbatches},schedule={args.schedule}"
    engine = ms.make_engine(model, layout, dtype=np.float64)
    engine.load_checkpoint(params)
    single = ms.SingleDevice(model)
    single.load_checkpoint(params)
    rank0 = engine.device_id == 0

    rng = np.random.default_rng(0)                 # a linearly separable toy task
    x = rng.normal(size=(32, 16))
    t = (x @ rng.normal(size=(16, 1)) > 0).astype(np.float64)
    bce = ms.losses.BCE()

    ok = True
    held = engine.mpi_comm.gather(sorted(engine.local_names), root=0)       # control data
    if rank0:
        print(f"{layout} on {engine.num_devices} ranks")
        for s, names in enumerate(held):
            print(f"  stage {s} holds {', '.join(names)}")
    for step in range(args.steps):
        loss, grads = engine.train_step(engine.shard_batch(x), engine.shard_batch(t), bce)
        ref_loss, ref_grads = single.train_step(x, t, bce)
        full = engine.gather_grads(grads)
        ok &= close(loss, ref_loss) and all(close(full[k], ref_grads[k]) for k in ref_grads)
        for name in engine.params:                 # SGD on this stage's own weights
            engine.params[name] -= args.lr * grads[name]
        for name in single.params:
            single.params[name] -= args.lr * ref_grads[name]
        if rank0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss:.6f}  single {ref_loss:.6f}")

    y = engine.gather_batch(engine.predict(engine.shard_batch(x)))
    ok &= close(y, single.predict(x))
    accuracy = float(((y > 0.5) == (t > 0.5)).mean())
    stats = engine.stats
    out = Collect()
    engine.inference_loop((x[i:i + 4] for i in range(0, 32, 4)), out)
    if engine.stage == 1:                          # the last stage wrote the outputs
        ok &= len(out.items) == 8 and close(np.concatenate(out.items), single.predict(x))
    ok = engine.mpi_comm.allreduce(bool(ok), op=MPI.LAND)   # control data
    every = engine.mpi_comm.gather((stats["peak_stashed"], stats["idle_s"], stats["busy_s"]),
                                   root=0)
    if rank0:
        for s, (peak, idle, busy) in enumerate(every):
            print(f"stage {s}: peak stashed microbatches {peak}, idle {idle * 1e3:.2f} ms, "
                  f"busy {busy * 1e3:.2f} ms")
        print(f"accuracy {accuracy:.3f}; pipeline "
              f"{'agrees with' if ok else 'DISAGREES with'} single (rtol {RTOL:g})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

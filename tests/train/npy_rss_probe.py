"""Resident memory of ranks training on `--dataset npy:DIR` (tests/train/test_npy_data.py; by hand):

    mpiexec -n 4 python -m mpi4py tests/train/npy_rss_probe.py DIR [STEPS] [BATCH]

Builds the npy data set, a small MLP under dp=<world size>, runs one warm-up step, then STEPS
more (default: one epoch) and the evaluation, and prints one JSON line from rank 0: the file
size, each rank's VmRSS after warm-up and at the end, and its peak (ru_maxrss), in bytes.
"""
import json
import os
import resource
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import mpishard as ms
from mpishard.train.npy_data import load_npy_dataset
from mpishard.train.trainer import Trainer

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from soak import vmrss  # noqa: E402  (benchmarks/soak.py: VmRSS in bytes)


def main():
    directory = sys.argv[1]
    comm = MPI.COMM_WORLD
    x = np.load(os.path.join(directory, "x.npy"), mmap_mode="r")
    n_classes = 4
    data = load_npy_dataset("npy:" + directory, x.shape[1], n_classes)
    batch = int(sys.argv[3]) if len(sys.argv) > 3 else 256 * comm.Get_size()
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else len(data.x_train) // batch
    del x
    engine = ms.make_engine(ms.MLP([data.d_in, 32, n_classes]), f"dp={comm.Get_size()}",
                            dtype=np.float32)
    engine.load_checkpoint(ms.MLP([data.d_in, 32, n_classes]).init(seed=0))
    trainer = Trainer(engine, ms.optim.SGD(engine, lr=0.01), data, batch=batch,
                      steps=steps + 1, progress=False, log_every=0)
    trainer.train_step()
    warm = vmrss()
    for _ in range(steps):
        trainer.train_step()
    result = trainer.evaluate()
    end = vmrss()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rows = comm.gather({"warm": warm, "end": end, "peak": peak}, root=0)
    if comm.Get_rank() == 0:
        print(json.dumps({"file_bytes": os.path.getsize(os.path.join(directory, "x.npy")),
                          "steps": steps, "batch": batch, "ranks": rows,
                          "test_loss": result["test_loss"]}), flush=True)


if __name__ == "__main__":
    main()

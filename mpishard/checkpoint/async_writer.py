"""Asynchronous saves: this rank's blocks are written by a background thread while training
goes on (`Checkpointer(..., asynchronous=True)`, train --checkpoint-async).

A save at a step boundary, collective, on the main thread: `writer.begin` (the checks, the
fresh `P.tmp-<step>` directory, who writes what: control data), then a host copy of each block
this rank writes (the parameters and optimizer state change in place at the next step), then a
thread writes, fsyncs and hashes them (`writer.write_blocks`, which makes no MPI call).
Training goes on. The save is finished -- every rank's verdict, rank 0's index and atomic swap
(`writer.finish`) -- on the main thread, collectively, at the first of:

- a step boundary at which every rank's thread is done (`ready`: one all-reduce of one int
  per step while a save is pending, so the ranks agree on the step);
- the next save, and the end of training (`finish` joins the thread first).

No MPI call is ever made from the thread. A crash while it writes leaves the tmp directory
without an index, so the previous checkpoint stays the complete one (writer.py's crash
consistency is unchanged: the index and the swap still come last). What it costs: the host
copies of this rank's blocks, held until the write ends, and the copy itself at the step.
"""
from __future__ import annotations

import threading

import numpy as np
from mpi4py import MPI

from ..comm.objects import wait
from .writer import begin, finish, write_blocks


class AsyncSave:
    """One save in flight: begun (collective) when made, written by a thread, finished by
    `finish` (collective)."""

    def __init__(self, path, engine, optimizer=None, step=0, extra=None, assets=None):
        self.plan = plan = begin(path, engine, optimizer, step, extra, assets)
        self.step, self.comm = step, engine.comm
        descs = list(plan["descs"])
        for i in plan["todo"]:             # a host copy the next step cannot change
            kind, name, key, region, arr, scalars = descs[i]
            host = engine.backend.to_host(arr)
            descs[i] = (kind, name, key, region,
                        host.copy() if isinstance(arr, np.ndarray) else host, scalars)
        self.result = None
        self.thread = threading.Thread(target=self._write, args=(descs,), daemon=True,
                                       name="mpishard-checkpoint")
        self.thread.start()

    def _write(self, descs) -> None:
        plan = self.plan
        self.result = write_blocks(plan["rank"], plan["tmp"], descs, plan["todo"],
                                    lambda host: host)

    def ready(self) -> bool:
        """Collective: whether every rank's write has ended (then `finish` does not wait)."""
        mine = np.array([0 if self.thread.is_alive() else 1], dtype=np.int64)
        every = np.empty(1, dtype=np.int64)
        mpi = self.comm.mpi
        wait(self.comm, mpi.Iallreduce(mine, every, op=MPI.MIN), "checkpoint save (async)")
        return bool(every[0])

    def finish(self) -> str:
        """Collective: wait for this rank's write, then the verdict, the index and the swap
        (writer.finish; CheckpointError on every rank when a write failed anywhere)."""
        self.thread.join()
        return finish(self.plan, self.result)

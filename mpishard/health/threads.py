"""BLAS threads per rank: ranks that share a node's cores share them out, not multiply them.

numpy's BLAS (OpenBLAS, MKL) starts one thread per core it sees. Under `mpiexec -n 4` on a
4-core node without binding, each of the 4 ranks starts 4 threads: 16 busy-waiting threads on
4 cores, and a GEMM-bound step runs many times slower than with one thread per rank.
`torchrun` sets OMP_NUM_THREADS=1 for the same reason; here the engine does it from what MPI
knows, when it is built (`blas_threads="auto"`, the default):

    ranks on this node whose CPU sets overlap this rank's  ->  sharing
    threads = max(1, len(this rank's CPU set) // sharing)

so unbound ranks split the node (4 ranks, 4 cores: 1 thread each; 2 ranks, 16 cores: 8), and
ranks a launcher bound to disjoint cores (`srun --cpu-bind=cores`, Open MPI's default binding)
keep all of theirs. It is a logged decision: when "auto" changes a pool, rank 0 logs (logger
"mpishard", WARNING) what it changed and how to turn it off. Nothing is changed when the user
chose: any of THREAD_VARS set in the environment, `blas_threads=None` (leave the pool alone)
or an int (exactly that many). Only numpy's own BLAS is limited (threadpoolctl, which works
after numpy is imported), never above what it started with; the thread pools of other
packages (torch's MKL or OpenMP, say) are left alone.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import numpy as np

from mpi4py import MPI

THREAD_VARS = ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
               "BLIS_NUM_THREADS")
log = logging.getLogger("mpishard")


@dataclass(frozen=True)
class BlasThreads:
    """What `pin_blas_threads` did: `threads` per rank (None: left as it was), the pool size
    `before`, and `why` in words (for logs and `inspect`)."""
    threads: int | None
    before: int | None
    why: str


def cpu_set() -> frozenset:
    """The CPUs this process may run on (its affinity; all CPUs where that is not known)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return frozenset(range(os.cpu_count() or 1))


def threads_for(mine: frozenset, node_sets: list) -> tuple:
    """(threads, sharing): this rank's share of its CPU set among the node's ranks whose sets
    overlap it (itself included)."""
    sharing = sum(1 for other in node_sets if other & mine)
    return max(1, len(mine) // max(1, sharing)), sharing


def is_numpys_blas(path: str, numpy_dir: str = os.path.dirname(np.__file__)) -> bool:
    """Whether the BLAS library at `path` is numpy's: inside numpy's wheel (numpy/ or
    numpy.libs/), or a system or conda library outside every Python package directory (what a
    numpy built against it loads). A BLAS inside another package (torch/lib) is not."""
    path = os.path.realpath(path)
    for own in (numpy_dir, numpy_dir + ".libs"):
        if path.startswith(os.path.realpath(own) + os.sep):
            return True
    return not {"site-packages", "dist-packages"} & set(path.split(os.sep))


def pin_blas_threads(comm, requested="auto", environ=None) -> BlasThreads:
    """Limit numpy's BLAS threads in this process (module docstring); collective over `comm`
    when `requested` is "auto" and no THREAD_VARS is set (every rank of `comm` calls it)."""
    environ = os.environ if environ is None else environ
    if requested is None:
        return BlasThreads(None, None, "blas_threads=None: left as it was")
    if requested != "auto" and (isinstance(requested, bool) or not isinstance(requested, int)
                                or requested < 1):
        raise ValueError(f"blas_threads must be 'auto', None or a positive int, "
                         f"got {requested!r}")
    if requested == "auto":
        chosen = [v for v in THREAD_VARS if environ.get(v, "").strip()]
        if chosen:
            return BlasThreads(None, None, f"{chosen[0]}={environ[chosen[0]]} is set: left "
                                           f"to the BLAS")
    from threadpoolctl import ThreadpoolController  # imported late: it scans loaded libraries

    controller = ThreadpoolController()
    pools = [p for p in controller.info()
             if p["user_api"] == "blas" and is_numpys_blas(p["filepath"])]
    before = max((p["num_threads"] for p in pools), default=None)
    if requested == "auto":
        mine, threads, sharing = node_share(comm)
        why = f"{sharing} rank(s) on this node share this rank's {len(mine)} CPU(s)"
    else:
        threads, why = requested, f"blas_threads={requested}"
    if before is not None:
        threads = min(threads, before)
    if before is None or threads == before:
        return BlasThreads(before, before, why + ": pool unchanged")
    controller.select(filepath=[p["filepath"] for p in pools]).limit(limits=threads)
    if requested == "auto" and comm.Get_rank() == 0:
        log.warning("mpishard: numpy's BLAS threads per rank %d -> %d (%s); "
                    "make_engine(blas_threads=None) or OMP_NUM_THREADS leaves them alone",
                    before, threads, why)
    return BlasThreads(threads, before, why)


def node_share(comm):
    """(this rank's CPUs, its threads_for share, ranks sharing them): collective over `comm`
    (its ranks on this node exchange CPU sets)."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = cpu_set()
        return (mine,) + tuple(threads_for(mine, node.allgather(mine)))
    finally:
        node.Free()

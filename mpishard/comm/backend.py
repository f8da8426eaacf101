"""Array backend: numpy on CPUs, cupy on GPUs, and how buffers reach MPI.

`Backend` bundles the array module `xp` the engines compute with and the rules for handing an
array to mpi4py:

- numpy arrays go to MPI as they are (contiguous buffers, uppercase mpi4py methods).
- device arrays go to a CUDA-aware MPI directly, after the current stream is synchronised so
  the MPI library sees finished data.
- device arrays with an MPI that is not CUDA-aware are staged through host arrays: one copy to
  the host before MPI reads a buffer, one copy back after MPI wrote one (none for a buffer MPI
  only writes, or only reads). Blocking calls reuse one host array per (slot, shape, dtype);
  every in-flight non-blocking request borrows its own from a pool (`lend`) and returns it on
  completion (`release`, which the request's Future calls), so two receives of the same shape
  in flight never share a buffer. Host buffers are pinned where cupy can pin them, and a
  large all_reduce goes in pipelined chunks (`pipeline`: staging.py).

Whether the MPI is CUDA-aware is asked of the library (gpu.query_cuda_support) unless the
caller says (`cuda_aware=True|False`). The device is chosen per node-local rank (gpu.py): the
rank among `comm`'s ranks on the node, or `local_rank=` where the caller knows it better (a
serve replica's engine: its rank among the whole job's ranks on the node).
`array_module=` replaces cupy with another device array module (the test suite's strict CPU
stand-in, tests/device_double.py), `nccl_module=` cupy's NCCL (tests/nccl_double.py). Nothing
here is a global: the engine owns one Backend.

How device arrays travel between GPUs (`gpu_comm`, `--gpu-comm`; `.comm_path` is the path
taken and `.comm_path_reason` why, which `inspect --env` prints):

    nccl    the device collectives and sends go through NCCL (nccl.py); MPI stays the control
            plane. Needs cupy's NCCL (a libnccl) and a GPU of its own for every rank on a node.
    mpi     device arrays go to MPI as they are: a CUDA-aware MPI (`cuda_aware=True`,
            `--cuda-aware yes`, or the library says so).
    staged  device arrays are copied through host buffers for MPI (`cuda_aware=False`,
            `--cuda-aware no` is this path).
    auto    mpi where the MPI is CUDA-aware, else staged (`cuda_aware=` True or False picks
            one). NCCL is opt-in (gpu_comm="nccl") until its known limits are lifted: it has
            not run on a GPU, and NCCL's own set-up and connection waits may escape the
            watchdog (nccl.py, docs/gpus.md).

The choice is agreed by every rank (one path per job). On CPUs the path is "host": numpy
arrays go to MPI as they are, whatever was asked.
"""
from __future__ import annotations

import logging

import numpy as np

from mpi4py import MPI

from .gpu import (device_count, gpu_for_rank, node_local_rank, own_device, query_cuda_support,
                  try_import_cupy)
from .nccl import NcclTransport, try_import_nccl
from .staging import BF16, StagedPipeline, as_words, pinned_empty

log = logging.getLogger("mpishard")

GPU_COMM = ("auto", "nccl", "mpi", "staged")
"""How device arrays travel between GPUs: NCCL, a CUDA-aware MPI, or staged through host
memory; auto: a CUDA-aware MPI, else staged (NCCL is opt-in: module docstring)."""


class Backend:
    """The array module and the MPI hand-off rules for one engine.

    staged: bytes copied through host staging, {"to_host": n, "to_device": n} (host<->device
    copies made for MPI; 0 with a CUDA-aware MPI or on CPU).
    """

    KEEP_PER_SHAPE = 4           # free host buffers the pool keeps per (shape, dtype)

    def __init__(self, device: str = "cpu", comm=None, cuda_aware: bool | None = None,
                 array_module=None, gpu_comm: str = "auto", nccl_module=None,
                 local_rank: int | None = None):
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
        if gpu_comm not in GPU_COMM:
            raise ValueError(f"gpu_comm must be one of {list(GPU_COMM)}, got {gpu_comm!r}")
        self.gpu_comm = gpu_comm
        if cuda_aware not in (None, True, False):
            raise TypeError(f"cuda_aware must be True, False or None, got {cuda_aware!r}")
        module = None
        if device != "cpu":
            module = array_module if array_module is not None else try_import_cupy()
            if device == "gpu" and module is None:
                raise ValueError("device='gpu' needs cupy (pip install -e '.[cuda12]', or "
                                 "'.[cuda13]'; bfloat16 on the tensor cores needs cupy 14: "
                                 "'cupy-cuda12x>=14', Python >= 3.10, docs/gpus.md)")
            if module is not None and device_count(module) == 0:
                if device == "gpu":
                    raise ValueError("device='gpu' but cupy sees no CUDA device")
                module = None
        self.is_gpu = module is not None
        self.xp = module if self.is_gpu else np
        self.name = getattr(self.xp, "__name__", "device") if self.is_gpu else "numpy"
        self.local_rank = 0
        if self.is_gpu and comm is not None:                  # the GPU follows it (gpu.py)
            self.local_rank = node_local_rank(comm) if local_rank is None else int(local_rank)
        self.device_index = None
        if self.is_gpu:
            self.device_index = gpu_for_rank(self.local_rank, device_count(module))
            module.cuda.Device(self.device_index).use()
        if self.is_gpu and gpu_comm == "staged":
            if cuda_aware:
                raise ValueError("gpu_comm='staged' contradicts cuda_aware=True")
            cuda_aware = False
        self.cuda_aware, self.cuda_aware_reason = self._cuda_aware(cuda_aware)
        if nccl_module is None and self.is_gpu and array_module is None and gpu_comm == "nccl":
            nccl_module = try_import_nccl()
        own_gpu = self.is_gpu and gpu_comm == "nccl" and own_device(comm, module,
                                                                     self.device_index)
        self.comm_path, self.comm_path_reason = self._comm_path(
            gpu_comm, cuda_aware, nccl_module, own_gpu, comm)
        self.device_transport = (NcclTransport(nccl_module, self.xp)
                                 if self.comm_path == "nccl" else None)
        self.pipeline = (StagedPipeline(self.xp) if self.is_gpu and not self.cuda_aware
                         else None)                 # large staged all_reduces (staging.py)
        self.staged = {"to_host": 0, "to_device": 0}
        self._staging: dict[tuple, np.ndarray] = {}
        self._free: dict[tuple, list] = {}

    def _cuda_aware(self, override):
        """(hand device arrays to MPI directly?, why)."""
        if not self.is_gpu:
            return False, "arrays are on the host (numpy)"
        if override is not None:
            return override, f"set by the caller (cuda_aware={override})"
        aware, why = query_cuda_support()
        if not aware:
            log.info("MPI is not CUDA-aware (%s): staging device arrays through host memory",
                     why)
        return aware, why

    def _comm_path(self, asked, cuda_aware, nccl, own_gpu, comm):
        """(the GPU communication path, why): module docstring; agreed by every rank."""
        if not self.is_gpu:
            return "host", "arrays are on the host (numpy)"
        if asked == "staged" or (asked == "auto" and cuda_aware is False):
            return "staged", ("asked for (gpu_comm='staged')" if asked == "staged" else
                              "cuda_aware=False (--cuda-aware no) is the staged path")
        if asked == "mpi" or (asked == "auto" and cuda_aware is True):
            if not self.cuda_aware:
                raise ValueError(f"gpu_comm='mpi' needs a CUDA-aware MPI: "
                                 f"{self.cuda_aware_reason}")
            return "mpi", f"CUDA-aware MPI ({self.cuda_aware_reason})"
        if asked == "auto":
            opt_in = "NCCL is opt-in (gpu_comm='nccl')"
            if self.cuda_aware:
                return "mpi", f"CUDA-aware MPI ({self.cuda_aware_reason}); {opt_in}"
            return "staged", f"MPI is not CUDA-aware ({self.cuda_aware_reason}); {opt_in}"
        local = ("no NCCL (cupy.cuda.nccl finds no libnccl)" if nccl is None else
                 "two ranks share a GPU on a node (NCCL refuses it)" if not own_gpu else "")
        why = comm.allreduce(local, op=MPI.MAX) if comm is not None else local
        if why:
            raise ValueError(f"gpu_comm='nccl' is not possible here: {why}")
        return "nccl", ("asked for; every rank has a GPU of its own and cupy.cuda.nccl finds a "
                        "libnccl")

    # -- conversions -------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Put `a` (numpy, cupy, list, memmap) on this backend's device."""
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        """A numpy copy/view of `a` for printing, saving and comparing."""
        if self.is_gpu and not isinstance(a, (np.ndarray, np.generic)):
            return self.xp.asnumpy(a)
        return np.asarray(a)

    def synchronize(self) -> None:
        """Wait for the device's current stream (no-op on CPU)."""
        if self.is_gpu:
            self.xp.cuda.get_current_stream().synchronize()

    # -- MPI hand-off ------------------------------------------------------------------------
    def mpi_buffer(self, a, slot: str | None = "send", read: bool = True):
        """The object to give an mpi4py uppercase call for the contiguous array `a`.

        read: MPI reads `a` (a send buffer, or an in-place one); False for a buffer MPI only
        writes, which then needs no copy to the host. After MPI wrote the buffer, call
        `mpi_finish(buffer, a)`. slot: blocking calls reuse one host array per slot, shape and
        dtype; `slot=None` borrows a host array for a non-blocking request, to be handed back
        with `release(buffer)` once the request completed.
        """
        if not self.is_gpu:
            return as_words(a)
        self.synchronize()             # MPI (or the copy below) sees finished device data
        if self.cuda_aware:
            return as_words(a)
        key = (a.shape, np.dtype(a.dtype).str)
        if slot is None:
            free = self._free.get(key)
            host = free.pop() if free else pinned_empty(self.xp, a.shape, a.dtype)
        else:
            host = self._staging.get((slot,) + key)
            if host is None:
                host = self._staging[(slot,) + key] = pinned_empty(self.xp, a.shape, a.dtype)
        if read:
            a.get(out=host)
            self.staged["to_host"] += a.nbytes
        return as_words(host)

    def mpi_finish(self, buffer, a) -> None:
        """After MPI wrote into `buffer` (from mpi_buffer(a)), make `a` hold the result; the
        stream is synchronised, so the data is in place before it is used or the host
        buffer is reused."""
        if self.is_gpu and not self.cuda_aware:           # staged: buffer is the host copy
            a.set(buffer.view(a.dtype))
            self.staged["to_device"] += a.nbytes
            self.synchronize()

    def release(self, *buffers) -> None:
        """Hand host buffers borrowed with `mpi_buffer(a, slot=None)` back to the pool (a
        device array, or anything else not borrowed, is ignored)."""
        for buf in buffers:
            if isinstance(buf, np.ndarray) and self.is_gpu and not self.cuda_aware:
                if isinstance(buf.base, np.ndarray) and buf.base.dtype == BF16:
                    buf = buf.base                       # as_words' view: the bf16 buffer
                free = self._free.setdefault((buf.shape, buf.dtype.str), [])
                if len(free) < self.KEEP_PER_SHAPE and all(b is not buf for b in free):
                    free.append(buf)

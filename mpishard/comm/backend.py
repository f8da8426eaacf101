"""Array backend: numpy on CPUs, cupy on GPUs, and how buffers reach MPI.

`Backend` bundles the array module `xp` the engines compute with and the rules for handing an
array to mpi4py:

- numpy arrays go to MPI as they are (contiguous buffers, uppercase mpi4py methods).
- cupy arrays go to a CUDA-aware MPI directly, after the current stream is synchronised so the
  MPI library sees finished data.
- cupy arrays with an MPI that is not CUDA-aware are staged through a host array that is kept
  and reused for the next message of the same size and dtype.

The device is chosen per node-local rank (rank i on a node uses GPU i % n_gpus). Nothing here is
a global: the engine owns one Backend, built from its communicator.
"""
from __future__ import annotations

import os

import numpy as np


def _try_import_cupy():
    try:
        import cupy  # noqa: F401

        return cupy
    except Exception:  # ImportError, or a broken CUDA install
        return None


def mpi_is_cuda_aware() -> bool:
    """Ask the MPI library whether it takes device pointers (MPIX_Query_cuda_support)."""
    from mpi4py import MPI

    query = getattr(MPI, "Query_cuda_support", None)
    if query is not None:
        try:
            return bool(query())
        except Exception:
            return False
    return False


class Backend:
    """The array module and the MPI hand-off rules for one engine."""

    def __init__(self, device: str = "cpu", comm=None, cuda_aware: bool | None = None):
        if device not in ("auto", "cpu", "gpu"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'gpu', got {device!r}")
        cupy = _try_import_cupy() if device in ("auto", "gpu") else None
        if device == "gpu" and cupy is None:
            raise ValueError("device='gpu' needs cupy (pip install -e '.[cuda12]')")
        if cupy is not None:
            try:
                n_gpus = cupy.cuda.runtime.getDeviceCount()
            except Exception:
                n_gpus = 0
            if n_gpus == 0:
                if device == "gpu":
                    raise ValueError("device='gpu' but cupy sees no CUDA device")
                cupy = None
        self.is_gpu = cupy is not None
        self.xp = cupy if self.is_gpu else np
        self.name = "cupy" if self.is_gpu else "numpy"
        self.local_rank = 0
        if self.is_gpu:
            if comm is not None:
                from mpi4py import MPI

                node = comm.Split_type(MPI.COMM_TYPE_SHARED)
                self.local_rank = node.Get_rank()
                node.Free()
            cupy.cuda.Device(self.local_rank % cupy.cuda.runtime.getDeviceCount()).use()
        if cuda_aware is None:
            env = os.environ.get("MPISHARD_CUDA_AWARE")
            cuda_aware = (env == "1") if env is not None else (self.is_gpu and mpi_is_cuda_aware())
        self.cuda_aware = bool(cuda_aware) and self.is_gpu
        self._staging: dict[tuple, np.ndarray] = {}

    # -- conversions -------------------------------------------------------------------------
    def asarray(self, a, dtype=None):
        """Put `a` (numpy, cupy, list, memmap) on this backend's device."""
        return self.xp.asarray(a, dtype=dtype)

    def to_host(self, a) -> np.ndarray:
        """A numpy copy/view of `a` for printing, saving and comparing."""
        if self.is_gpu and not isinstance(a, np.ndarray):
            return self.xp.asnumpy(a)
        return np.asarray(a)

    # -- MPI hand-off ------------------------------------------------------------------------
    def mpi_buffer(self, a, slot: str = "send"):
        """Return the object to give to an mpi4py uppercase call for the contiguous array `a`.

        On GPU without CUDA-aware MPI the data is copied into a reused host array; call
        `mpi_finish(buffer, a)` after a receive to copy it back to the device. `slot=None`
        gives a fresh host array (non-blocking sends: several may be in flight at once).
        """
        if not self.is_gpu:
            return a
        self.xp.cuda.get_current_stream().synchronize()
        if self.cuda_aware:
            return a
        if slot is None:
            return a.get()
        key = (slot, a.shape, a.dtype.str)
        host = self._staging.get(key)
        if host is None:
            host = np.empty(a.shape, dtype=a.dtype)
            self._staging[key] = host
        a.get(out=host)
        return host

    def mpi_finish(self, buffer, a) -> None:
        """After MPI wrote into `buffer` (from mpi_buffer(a)), make `a` hold the result."""
        if self.is_gpu and buffer is not a:
            a.set(buffer)

"""GPUs and MPI: is the MPI library CUDA-aware, which GPU a rank uses, `inspect --env`.

CUDA-aware MPI takes device pointers in its calls, so a cupy array goes to `Allreduce` as it
is. Whether the library can is asked of the library itself: the `libmpi` that mpi4py loaded
is opened with ctypes and asked through

    MPIX_Query_cuda_support()                 Open MPI (mpi-ext.h), MPICH >= 4
    MPIX_GPU_query_support(CUDA, &supported)  MPICH >= 4

The answer is False, with the reason, when the library has neither (or cannot be found);
`make_engine(..., cuda_aware=True|False)` overrides it for an MPI that cannot say.

A rank uses GPU `local_rank % n_visible`, where `local_rank` is its rank among the ranks on
its node (MPI_COMM_TYPE_SHARED of the engine's communicator, or the `device_rank` its caller
gives: a serve replica's engine, on a communicator smaller than the job's, is given its rank
among the job's) and `n_visible` counts the GPUs that CUDA_VISIBLE_DEVICES leaves visible
(cupy numbers the visible ones from 0).
"""
from __future__ import annotations

import ctypes
import os
import socket

from mpi4py import MPI

MPIX_GPU_SUPPORT_CUDA = 0      # the gpu_type argument of MPICH's MPIX_GPU_query_support


def try_import_cupy():
    """The cupy module, or None when it is not installed or CUDA is broken."""
    try:
        import cupy

        return cupy
    except Exception:  # ImportError, or a broken CUDA install
        return None


def loaded_libmpi() -> list:
    """Paths of the libmpi shared objects this process has loaded (mpi4py's), from
    /proc/self/maps; [] where that file does not exist (not Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
            paths = {line.split()[-1] for line in f if "libmpi" in line}
    except OSError:
        return []
    return sorted(p for p in paths if p.startswith("/"))


def _libraries():
    """(name, ctypes handle) of the process's global symbols, then each loaded libmpi."""
    libs = [("the process", ctypes.CDLL(None))]
    for path in loaded_libmpi():
        try:
            libs.append((os.path.basename(path), ctypes.CDLL(path)))
        except OSError:
            continue
    return libs


def query_cuda_support() -> tuple:
    """(CUDA-aware?, why): the MPI library's own answer, or False and the reason it gave none."""
    MPI.Get_version()                    # mpi4py.MPI imported: its libmpi is loaded
    for name, lib in _libraries():
        query = getattr(lib, "MPIX_Query_cuda_support", None)
        if query is not None:
            query.restype, query.argtypes = ctypes.c_int, []
            value = int(query())
            return bool(value), f"MPIX_Query_cuda_support() = {value} in {name}"
        query = getattr(lib, "MPIX_GPU_query_support", None)
        if query is not None:
            query.restype = ctypes.c_int
            query.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_int)]
            value = ctypes.c_int(0)
            rc = query(MPIX_GPU_SUPPORT_CUDA, ctypes.byref(value))
            if rc == 0:
                return bool(value.value), (f"MPIX_GPU_query_support(CUDA) = {value.value} "
                                           f"in {name}")
    return False, ("the MPI library has neither MPIX_Query_cuda_support nor "
                   "MPIX_GPU_query_support (pass cuda_aware=True to override)")


def node_local_rank(comm) -> int:
    """This rank's rank among the ranks of `comm` on the same node."""
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        return node.Get_rank()
    finally:
        node.Free()


def own_device(comm, xp, index) -> bool:
    """Whether every rank of `comm` on this node uses a GPU no other rank there uses (NCCL
    refuses two ranks on one GPU). Compared by PCI bus id, so per-rank CUDA_VISIBLE_DEVICES
    (each rank sees one GPU, index 0) counts as distinct; the index where the array module
    has no bus id (the test suite's stand-in). Collective over `comm` (None: one rank)."""
    ident = str(getattr(xp.cuda.Device(index), "pci_bus_id", index))
    if comm is None:
        return True
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        ids = node.allgather(ident)
    finally:
        node.Free()
    return len(set(ids)) == len(ids)


def gpu_for_rank(local_rank: int, n_visible: int) -> int:
    """The (visible) GPU index a node-local rank uses: local_rank % n_visible."""
    return local_rank % n_visible


def physical_gpu(index: int) -> str:
    """The id CUDA_VISIBLE_DEVICES maps visible GPU `index` to ('index' when it is unset)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return str(index)
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    return ids[index] if index < len(ids) else f"{index} (not in CUDA_VISIBLE_DEVICES)"


def device_count(cupy) -> int:
    """The GPUs cupy sees (CUDA_VISIBLE_DEVICES applied); 0 without cupy or on a CUDA error
    (a broken install counts as no GPU)."""
    if cupy is None:
        return 0
    try:
        return cupy.cuda.runtime.getDeviceCount()
    except Exception:
        return 0


def visible_gpus(cupy) -> list:
    """Names of the GPUs cupy sees (CUDA_VISIBLE_DEVICES applied); [] without cupy/CUDA."""
    if cupy is None:
        return []
    try:
        n = cupy.cuda.runtime.getDeviceCount()
        return [_gpu_name(cupy, i) for i in range(n)]
    except Exception:
        return []


def _gpu_name(cupy, i) -> str:
    name = cupy.cuda.runtime.getDeviceProperties(i).get("name", b"?")
    return name.decode() if isinstance(name, bytes) else str(name)


def environment_report(comm, comm_path=None) -> str:
    """Collective over `comm`: the MPI library, its CUDA-awareness, cupy, the visible GPUs and
    which GPU each node-local rank uses (`python -m mpishard inspect --env`); `comm_path`:
    (the GPU communication path a Backend resolved, why), printed after the CUDA-aware line."""
    cupy = try_import_cupy()
    aware, why = query_cuda_support()
    gpus = visible_gpus(cupy)
    local = node_local_rank(comm)
    mine = (f"GPU {gpu_for_rank(local, len(gpus))} (physical "
            f"{physical_gpu(gpu_for_rank(local, len(gpus)))})" if gpus else "no GPU (numpy)")
    rows = comm.gather((comm.Get_rank(), socket.gethostname(), local, mine), root=0)
    if comm.Get_rank() != 0:
        return ""
    lib = " ".join(MPI.Get_library_version().strip().splitlines()[0].split())
    lines = [f"MPI library      {lib} (MPI standard {'.'.join(map(str, MPI.Get_version()))})",
             f"libmpi           {', '.join(loaded_libmpi()) or 'not found in /proc/self/maps'}",
             f"CUDA-aware       {'yes' if aware else 'no'}: {why}",
             *([f"GPU comm         {comm_path[0]}: {comm_path[1]}"] if comm_path else []),
             f"cupy             {cupy.__version__ if cupy is not None else 'not installed'}",
             f"CUDA_VISIBLE_DEVICES {os.environ.get('CUDA_VISIBLE_DEVICES', '(unset)')}",
             f"visible GPUs     {len(gpus)}" + "".join(f"\n  {i}: {n}" for i, n in
                                                        enumerate(gpus)),
             "rank  host                  local rank  device (device='gpu'/'auto')"]
    lines += [f"{r:>4}  {host:<20}  {lr:>10}  {dev}" for r, host, lr, dev in rows]
    return "\n".join(lines)

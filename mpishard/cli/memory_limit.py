"""`--max-memory`: the bytes one rank may use, as given or as this job is allowed.

    --max-memory 12G        # K, M, G, T: powers of 1024 (12G = 12 x 2^30 bytes); a B or iB
                            # after the letter is allowed (12GiB), a plain number is bytes

Left out, the default is the memory this job may use on its node, divided by the ranks the
job runs on that node, from the first source that sets it:

  1. the cgroup limit: v2 memory.max (not `max`), else v1 memory/memory.limit_in_bytes (not
     the "unlimited" 2^63 rounded to pages), each first of this process's own cgroup
     (/proc/self/cgroup) under /sys/fs/cgroup, then of the mount's root (a container's);
     a container's or a Slurm job's cgroup limits the whole node's share of the job;
  2. Slurm: SLURM_MEM_PER_NODE (MiB, per node), else SLURM_MEM_PER_CPU (MiB) x
     SLURM_CPUS_PER_TASK (1 when unset): already per rank, not divided again;
  3. the node's MemTotal (/proc/meminfo).

The ranks on the node: under MPI the size of the job's shared-memory group
(MPI_COMM_TYPE_SHARED); without a communicator the launcher's variables
(OMPI_COMM_WORLD_LOCAL_SIZE, MPI_LOCALNRANKS, SLURM_NTASKS_PER_NODE), else 1.

On a GPU (`--device gpu`, or `auto` where cupy sees one) what a rank's step holds lives in
the GPU's memory, not the node's, so the default is instead the free memory of the GPU the
rank computes on (cupy's memGetInfo, after its CUDA context is made; the GPU picked as the
engine picks it, by the rank's place among the job's ranks on the node: comm/gpu.py), over the
ranks of the node that compute on the same
GPU (compared by PCI bus id, so per-rank CUDA_VISIBLE_DEVICES counts as distinct GPUs).
"""
from __future__ import annotations

import os
import re

from mpi4py import MPI

from ..comm.gpu import device_count, gpu_for_rank, try_import_cupy

UNITS = {"": 1, "K": 2 ** 10, "M": 2 ** 20, "G": 2 ** 30, "T": 2 ** 40}
CGROUP = "/sys/fs/cgroup"
MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
UNLIMITED_V1 = 2 ** 60           # v1 reports "no limit" as 2^63 rounded down to a page
LOCAL_SIZE_VARIABLES = ("OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE")


def parse_bytes(text) -> int:
    """'12G' -> 12 x 2^30; ValueError naming the expected form for anything else."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text),
                        flags=re.IGNORECASE)
    if not match or float(match.group(1)) <= 0:
        raise ValueError(f"--max-memory {text!r}: expected a positive number of bytes with an "
                         f"optional K, M, G or T suffix, like 12G or 512M")
    return int(float(match.group(1)) * UNITS[match.group(2).upper()])


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def own_cgroups(proc_cgroup: str = PROC_CGROUP) -> tuple:
    """This process's (v2 cgroup path, v1 memory cgroup path) from /proc/self/cgroup's
    `0::/PATH` and `N:...memory...:/PATH` lines ('' where absent)."""
    v2 = v1 = ""
    for line in (_read(proc_cgroup) or "").splitlines():
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":
            v2 = path.strip().lstrip("/")
        elif "memory" in controllers.split(","):
            v1 = path.strip().lstrip("/")
    return v2, v1


def cgroup_limit(root: str = CGROUP, proc_cgroup: str = PROC_CGROUP):
    """(bytes, file) of the cgroup's memory limit, or None without one: v2 then v1, each of
    this process's own cgroup, then of the mount's root (as inside a container)."""
    v2, v1 = own_cgroups(proc_cgroup)
    v1_file = os.path.join("memory", v1, "memory.limit_in_bytes")
    names = ([os.path.join(v2, "memory.max")] if v2 else []) + ["memory.max"] + \
        ([v1_file] if v1 else []) + [os.path.join("memory", "memory.limit_in_bytes")]
    for name in names:
        path = os.path.join(root, name)
        text = (_read(path) or "").strip()
        if text.isdigit() and int(text) < UNLIMITED_V1:
            return int(text), path
    return None


def mem_total(meminfo: str = MEMINFO):
    """The node's MemTotal in bytes (/proc/meminfo's kB), or None."""
    for line in (_read(meminfo) or "").splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    return None


def job_memory(environ=None, root: str = CGROUP, meminfo: str = MEMINFO,
               proc_cgroup: str = PROC_CGROUP) -> tuple:
    """(bytes, where from, whether already per rank) of the module docstring's first source;
    (None, 'unknown', False) when none answers."""
    env = os.environ if environ is None else environ
    limit = cgroup_limit(root, proc_cgroup)
    if limit is not None:
        return limit[0], f"cgroup {limit[1]}", False
    if env.get("SLURM_MEM_PER_NODE", "").isdigit():
        return int(env["SLURM_MEM_PER_NODE"]) * 2 ** 20, "SLURM_MEM_PER_NODE", False
    if env.get("SLURM_MEM_PER_CPU", "").isdigit():
        cpus = int(env.get("SLURM_CPUS_PER_TASK", "1") or 1)
        return int(env["SLURM_MEM_PER_CPU"]) * 2 ** 20 * cpus, \
            f"SLURM_MEM_PER_CPU x {cpus} cpus per task", True
    total = mem_total(meminfo)
    return (total, "MemTotal of /proc/meminfo", False) if total else (None, "unknown", False)


def node_ranks(comm=None, environ=None) -> int:
    """Ranks of this job on this node: `comm`'s shared-memory group's size, else the
    launcher's variables, else 1."""
    if comm is not None:
        node = comm.Split_type(MPI.COMM_TYPE_SHARED)
        size = node.Get_size()
        node.Free()
        return size
    env = os.environ if environ is None else environ
    for name in LOCAL_SIZE_VARIABLES:
        if env.get(name, "").isdigit() and int(env[name]) > 0:
            return int(env[name])
    return 1


def default_max_memory(comm=None, environ=None, root: str = CGROUP,
                       meminfo: str = MEMINFO, ranks=None) -> tuple:
    """(bytes per rank, where from): job_memory over node_ranks (the module docstring);
    `ranks`: the ranks on the node where the caller knows them (then no collective)."""
    total, source, per_rank = job_memory(environ, root, meminfo)
    if total is None:
        raise ValueError("--max-memory: this job's memory is unknown (no cgroup limit, no "
                         "Slurm memory, no /proc/meminfo); give --max-memory BYTES")
    if per_rank:
        ranks = 1
    elif ranks is None:
        ranks = node_ranks(comm, environ)
    return total // ranks, (source if per_rank else f"{source} / {ranks} rank(s) on the node")


def local_gpu(device: str, cupy=None):
    """(cupy, GPUs it sees) where `device` puts this rank's arrays on a GPU ('gpu', or
    'auto' where cupy sees one: comm/backend.Backend's rule), else None. No MPI."""
    if device == "cpu":
        return None
    cupy = cupy if cupy is not None else try_import_cupy()
    count = device_count(cupy)
    return (cupy, count) if count > 0 else None


def gpu_max_memory(device: str, comm=None, cupy=None) -> tuple:
    """((bytes per rank, where from) of the GPU's free memory over the node's ranks sharing
    it, or None where this rank computes on the host; the ranks on the node). Collective over
    `comm` (comm None: one rank): every rank makes the same calls, GPU or not, and a query
    that fails on any rank raises the same ValueError on every rank."""
    found = local_gpu(device, cupy)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED) if comm is not None else None
    try:
        mine, error = None, None
        if found is not None:                    # the GPU the engine on `comm` picks
            module, count = found
            index = gpu_for_rank(node.Get_rank() if node is not None else 0, count)
            try:
                with module.cuda.Device(index) as dev:
                    free, _ = module.cuda.runtime.memGetInfo()
                    mine = (str(getattr(dev, "pci_bus_id", index)), int(free), index)
            except Exception as exc:             # a CUDA error: reported on every rank
                error = f"GPU {index}: {type(exc).__name__}: {exc}"
        pairs = node.allgather((mine and mine[0], error)) if node is not None else \
            [(mine and mine[0], error)]
    finally:
        if node is not None:
            node.Free()
    errors = [e for _, e in pairs if e]
    if errors:
        raise ValueError(f"--max-memory: the GPU's free memory could not be read ({errors[0]}"
                         f"); give --max-memory BYTES")
    if mine is None:
        return None, len(pairs)
    sharing = [ident for ident, _ in pairs].count(mine[0])
    return (mine[1] // sharing, f"free memory of GPU {mine[2]} (cupy memGetInfo) / "
                                f"{sharing} rank(s) on it"), len(pairs)


def max_memory(text, comm=None, device: str = "cpu") -> tuple:
    """(bytes per rank, where from) of --max-memory `text`, or its default when None: the
    GPU's (gpu_max_memory) where `device` puts the arrays on one, else the host's. With
    device 'cpu' the default is collective over `comm` as node_ranks is, otherwise as
    gpu_max_memory is (every rank the same calls, GPU or not)."""
    if text is not None:
        return parse_bytes(text), "--max-memory"
    if device == "cpu":
        return default_max_memory(comm)
    gpu, ranks = gpu_max_memory(device, comm)
    if gpu is not None:
        return gpu
    return default_max_memory(ranks=ranks) if comm is not None else default_max_memory()


def add_max_memory_argument(add, gpu: bool = True) -> None:
    """--max-memory through `add` (a parser's or a group's add_argument); gpu: the command
    runs on a GPU where it sees one (plan does not: its default is the host's)."""
    add("--max-memory", metavar="BYTES", help="memory one rank may use, with K, M, G or T "
        "(e.g. 12G); --layout auto picks among the layouts predicted to fit (default: the "
        "job's cgroup or Slurm memory, else the node's, over its ranks on the node"
        + ("; on a GPU its free memory over the ranks sharing it)" if gpu else
           "; plan runs on the host: give a GPU's memory here to plan for one)"))

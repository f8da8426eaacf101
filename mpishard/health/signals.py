"""Remove the MPI library's own files when a rank ends without MPI_Finalize.

MPICH (and UCX, Open MPI's sm) put intra-node buffers in files under /dev/shm, and MPICH's
launcher (hydra) writes the node's hwloc topology to /tmp/hydra_hwloc_xmlfile_*. A job that
finishes calls MPI_Finalize and they are removed; a job that ends in MPI_Abort (an uncaught
exception under `python -m mpi4py`, a collective timeout) or is stopped by `scancel`/Ctrl-C
(SIGTERM/SIGINT) leaves them behind: memory the node never gets back until someone deletes
the files. `remove_mpi_files` removes exactly those of this job:

- the /dev/shm files this process has mapped (/proc/self/maps), and only those whose name is
  one of MPI_SHM_PATTERNS (MPICH's, Open MPI's, UCX's): a user's
  `multiprocessing.shared_memory` segment or a data loader's, mapped by the same process, stays;
- the hydra topology file that this rank's launcher process (its parent, hydra_pmi_proxy)
  holds open; the ranks read it in MPI_Init and no longer need it.

Unlinking a mapped file is safe (ranks still running keep their mappings), and a sibling rank
on the node may have been first (FileNotFoundError, ignored). Everything here is plain `os`
calls, so it can run inside a signal handler. Without /proc nothing is found.

`install_cleanup_handlers` (the CLI's, once per process of an MPI command) replaces the
SIGTERM/SIGINT handlers with: remove_mpi_files, one stderr line written with one os.write to
fd 2 (health/lines.py: never run together with another rank's line; a handler that prints could
re-enter sys.stderr's buffer), and os._exit(128 + signum), the shell's code for "killed by
signal". No MPI_Finalize: it is a collective, peers may be stuck
or gone, and a handler must not block. Python runs the handler in the main thread between
bytecodes, so a rank blocked inside one MPI call runs it only when that call returns; the
launcher kills it meanwhile, and a segment shared by the node's ranks is unlinked by whichever
rank got there first. `import mpishard` installs nothing: library users keep their handlers.
"""
from __future__ import annotations

import atexit
import fnmatch
import os
import signal

from mpi4py import MPI

from .lines import write_line

__all__ = ["install_cleanup_handlers", "mapped_shm_paths", "mpi_shm_paths", "read_proc",
           "launcher_files", "remove_mpi_files", "MPI_SHM_PATTERNS", "SHM_DIR"]

SHM_DIR = "/dev/shm/"
DELETED = " (deleted)"
# The names the MPI libraries give their /dev/shm segments: MPICH, Open MPI's sm (5.x) and
# vader (4.x) transports, UCX's posix transport (MPICH ch4:ucx, Open MPI's pml ucx).
MPI_SHM_PATTERNS = ("mpich_shm_*", "sm_segment.*", "vader_segment.*", "ucx_shm_posix_*")
# hydra_pmi_proxy's topology file (mkstemp of /tmp/hydra_hwloc_xmlfile_XXXXXX).
LAUNCHER_PROCESS = "hydra_pmi_proxy"
LAUNCHER_FILE = "/tmp/hydra_hwloc_xmlfile_*"


def mapped_shm_paths(maps_text: str) -> list[str]:
    """The files under /dev/shm named in a /proc/<pid>/maps text, each once, in order of first
    mapping; ones the kernel marks `(deleted)` (already unlinked) are left out."""
    paths = {}
    for line in maps_text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) < 6:                      # anonymous mapping: no path
            continue
        path = fields[5]
        if path.startswith(SHM_DIR) and not path.endswith(DELETED):
            paths.setdefault(path, None)
    return list(paths)


def mpi_shm_paths(paths) -> list[str]:
    """The paths among `paths` whose file name is an MPI library's (MPI_SHM_PATTERNS)."""
    return [p for p in paths if any(fnmatch.fnmatchcase(os.path.basename(p), pattern)
                                    for pattern in MPI_SHM_PATTERNS)]


def read_proc(path: str) -> str:
    """A /proc file as text, '' where it cannot be read."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return ""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    except OSError:
        pass
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def read_own_maps() -> str:
    """/proc/self/maps as text, '' where there is no /proc."""
    return read_proc("/proc/self/maps")


def launcher_files(parent: int | None = None) -> list[str]:
    """The hydra topology files that the launcher process `parent` (default: this process's
    parent) holds open, [] when the parent is not hydra_pmi_proxy (Open MPI, srun, a shell)."""
    parent = os.getppid() if parent is None else parent
    if read_proc(f"/proc/{parent}/comm").strip() != LAUNCHER_PROCESS:
        return []
    found = []
    try:
        fds = os.listdir(f"/proc/{parent}/fd")
    except OSError:                               # another user's process, or gone
        return []
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{parent}/fd/{fd}")
        except OSError:
            continue
        if fnmatch.fnmatchcase(target, LAUNCHER_FILE) and target not in found:
            found.append(target)
    return found


def remove_mpi_files() -> int:
    """Unlink this job's MPI files that this process can see (the module docstring): the MPI
    segments it maps and its launcher's topology file. Returns how many it removed."""
    removed = 0
    for path in mpi_shm_paths(mapped_shm_paths(read_own_maps())) + launcher_files():
        try:
            os.unlink(path)
            removed += 1
        except OSError:                          # a sibling was first, or not ours to remove
            pass
    return removed


def remove_singleton_segment_at_exit(world) -> bool:
    """Open MPI 5 run without a launcher (a singleton: `python script.py`) leaves its
    shared-memory segment (sm_segment.*, 16 MiB) in /dev/shm at every exit, clean or not. For
    such a process only, register (once) an exit handler that removes the segment it maps; it
    runs before mpi4py finalizes MPI, and the mapping stays valid once the name is gone.
    Returns whether the handler is registered."""
    if (_SINGLETON_HANDLER or world.Get_size() != 1 or MPI.COMM_WORLD.Get_size() != 1
            or "Open MPI" not in MPI.Get_library_version()):
        return bool(_SINGLETON_HANDLER)
    atexit.register(lambda: [os.unlink(p) for p in mpi_shm_paths(mapped_shm_paths(
        read_own_maps())) if fnmatch.fnmatchcase(os.path.basename(p), "sm_segment.*")])
    _SINGLETON_HANDLER.append(True)
    return True


_SINGLETON_HANDLER: list = []     # the process's handler is registered (once)


def install_cleanup_handlers(rank: int | None = None) -> None:
    """Replace the SIGTERM and SIGINT handlers of this (main-thread) process with: remove this
    job's MPI files, say so in one stderr line naming `rank`, exit 128 + signum."""
    who = "" if rank is None else f" rank {rank}"

    def cleanup_and_exit(signum, frame):
        removed = remove_mpi_files()
        if removed:
            name = signal.Signals(signum).name
            write_line(f"mpishard:{who} received {name}; removed {removed} file(s) of the "
                       "MPI library; exiting", 2)
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, cleanup_and_exit)

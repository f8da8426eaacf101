"""Remove a node's MPI files once all its ranks are gone, however they ended (SIGKILL too).

health/signals.py removes them when a rank is told to stop (SIGTERM, SIGINT). A rank that is
SIGKILLed runs nothing: that is how MPICH's launcher ends a job whose mpiexec died, e.g. of
SIGPIPE when its output was piped into `head` that has exited (`mpiexec ... generate | head
-c 1`): each rank's process-manager proxy kills its ranks and the node's `mpich_shm_*`
segment and the proxy's topology file stay in /dev/shm and /tmp.

`start_reaper(world)` (collective, once per process of an MPI command run by `python -m
mpishard`, a singleton included): the ranks of each node gather their pids, their launcher
proxies' pids and the MPI files they use (signals.py's rules: mapped segments named like
MPI_SHM_PATTERNS, the hydra topology file of their proxy); the node's first rank starts a
small watcher process in a session of its own (outside the job's process group, which a
launcher may kill) whose stdin is a pipe from that rank. When the pipe ends (the rank ended,
any way) the watcher waits until none of those processes runs and unlinks the files still
there. A job that ended normally has removed them already: the watcher finds nothing.
"""
from __future__ import annotations

import os
import subprocess
import sys

from mpi4py import MPI

from .signals import launcher_files, mapped_shm_paths, mpi_shm_paths, read_own_maps

__all__ = ["start_reaper", "WATCHER"]

_STARTED: list = []        # the watcher, referenced: its stdin must stay open while we run

# Plain Python (-I -S: no site, no mpishard, no MPI): argv[1] the paths one a line, argv[2]
# the pids; waits at most GRACE s for the processes once its stdin has ended.
WATCHER = r"""
import os, sys, time
paths, pids, grace = sys.argv[1].splitlines(), [int(p) for p in sys.argv[2].split()], 60.0


def running(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


sys.stdin.buffer.read()
deadline = time.monotonic() + grace
while any(map(running, pids)):
    if time.monotonic() > deadline:
        sys.exit(0)
    time.sleep(0.05)
for path in paths:
    try:
        os.unlink(path)
    except OSError:
        pass
"""


def _mine() -> tuple:
    """This rank's processes (itself, and its parent when that is the launcher's proxy) and
    the MPI files it uses."""
    proxy = launcher_files()
    pids = [os.getpid(), *([os.getppid()] if proxy else [])]
    return pids, mpi_shm_paths(mapped_shm_paths(read_own_maps())) + proxy


def under_launch(pid: int | None = None) -> bool:
    """Whether a process above `pid` (default: this one) on this node is `mpishard launch`,
    which removes the MPI files of the jobs it runs itself (cli/job_files.py)."""
    pid = os.getppid() if pid is None else pid
    for _ in range(64):                          # a chain of parents, not a loop
        if pid <= 1:
            return False
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                args = f.read().decode(errors="replace").split("\0")
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            return False
        if "launch" in args and any(os.path.basename(a) == "mpishard"
                                    for a in args[:args.index("launch")]):
            return True
        pid = parent
    return False


def start_reaper(world) -> subprocess.Popen | None:
    """Collective over `world`: the node's first rank starts the watcher (module docstring)
    and returns it (its stdin held open until this process ends); None on the other ranks,
    when the node's ranks use no MPI file, or under `mpishard launch`
    (under_launch: one cleaner per job, the one that reports what it removed)."""
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        mine = node.gather(_mine(), root=0)
        first = node.Get_rank() == 0
    finally:
        node.Free()
    if not first or under_launch():
        return None
    pids = sorted({p for ps, _ in mine for p in ps})
    paths = sorted({p for _, ps in mine for p in ps})
    if not paths:
        return None
    watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHER, "\n".join(paths),
                                " ".join(map(str, pids))], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    _STARTED.append(watcher)
    return watcher

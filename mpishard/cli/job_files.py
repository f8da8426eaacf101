"""The MPI library's files of a job that `launch` runs, removed once the job has ended.

A rank that ends without MPI_Finalize (SIGKILLed, or killed by the launcher after another
rank died) leaves its shared-memory segment in /dev/shm (health/signals.py's MPI_SHM_PATTERNS:
MPICH's mpich_shm_*, Open MPI's sm_segment.* and vader_segment.*, UCX's), memory the node
never gets back; health/signals.py removes them from inside a rank that gets SIGTERM or SIGINT,
and nothing can from inside a SIGKILLed one. `JobFiles` watches the job from outside: while
it runs, every POLL seconds, it records the MPI segments mapped by the processes descended
from the launcher it started (hydra's proxy and the ranks of this node; each runs in a
session of its own, so the tree of parent pids is what names the job), and the hydra
topology file the proxy holds open. A file of another job is never mapped by one of these
processes, so it is never recorded. Once the job has ended, `remove` unlinks each recorded
file that still exists and that none of the processes that used it still uses (a rank that
outlived its launcher keeps its own). Ranks on other nodes, and srun's (children of
slurmstepd), are not seen: they are theirs to clean.
"""
from __future__ import annotations

import os
import threading

from ..health.signals import launcher_files, mapped_shm_paths, mpi_shm_paths, read_proc

POLL = 0.5                      # seconds between two looks at the job's processes


def descendants(root: int) -> list:
    """The pids of every live process below `root` in the tree of parent pids (/proc)."""
    children: dict = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in filter(str.isdigit, entries):
        fields = read_proc(f"/proc/{entry}/stat").rpartition(")")[2].split()  # after "pid (comm)"
        if len(fields) > 1:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), ()):
            found.append(child)
            todo.append(child)
    return found


def mpi_files_of(pid: int) -> list:
    """The MPI library's files process `pid` uses: the segments it maps, and the topology
    file it holds open when it is hydra's proxy."""
    return mpi_shm_paths(mapped_shm_paths(read_proc(f"/proc/{pid}/maps"))) + launcher_files(pid)


class JobFiles:
    """The MPI files of the job whose launcher is process `root` (module docstring):
    `start()` when it is started, `remove()` once it has ended."""

    def __init__(self, root: int, poll: float = POLL):
        self.root, self.poll = root, poll
        self.seen: dict = {}                      # path -> pids that used it
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name="mpishard-launch-files")

    def start(self) -> "JobFiles":
        self._thread.start()
        return self

    def _watch(self) -> None:
        while True:
            self.record()
            if self._done.wait(self.poll):
                return

    def record(self) -> None:
        """Note the MPI files each process of the job uses now."""
        for pid in [self.root, *descendants(self.root)]:
            for path in mpi_files_of(pid):
                self.seen.setdefault(path, set()).add(pid)

    def remove(self) -> list:
        """Stop watching; unlink the recorded files no process of the job uses any more.
        Returns the paths removed."""
        self._done.set()
        self._thread.join()
        removed = []
        for path, pids in sorted(self.seen.items()):
            if not os.path.exists(path) or any(path in mpi_files_of(p) for p in pids):
                continue
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:                       # gone meanwhile, or not ours to remove
                pass
        return removed


__all__ = ["JobFiles", "descendants", "mpi_files_of"]

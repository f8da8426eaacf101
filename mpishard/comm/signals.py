"""Unlink MPI's POSIX shared memory when a rank is told to stop (SIGTERM, SIGINT).

MPICH (and UCX, Open MPI's sm) put intra-node buffers in files under /dev/shm. A job that
finishes calls MPI_Finalize and they are removed; a job stopped by `scancel` or Ctrl-C gets
SIGTERM/SIGINT, dies on the spot, and leaves its segments behind: memory the node never gets
back until someone deletes the files (issue 15). So the CLI installs, once per process of an MPI
command, handlers that

- read /proc/self/maps for the files this process has mapped from /dev/shm (names vary:
  mpich_shm_*, ucx_shm_posix_*, sm_segment.*: whatever is mapped from there is MPI's or the
  transport's), skipping ones already marked `(deleted)`;
- unlink each: a sibling rank on the node may have been first (FileNotFoundError, ignored), and
  unlinking a mapped file is safe, ranks still running keep their mappings;
- write one line to stderr with a plain os.write to fd 2 (a handler that prints could re-enter
  sys.stderr's buffer while the interrupted code holds it);
- and exit with os._exit(128 + signum), the shell's code for "killed by signal". No
  MPI_Finalize: it is a collective, peers may be stuck or gone, and a handler must not block.

Python runs the handler in the main thread between bytecodes, so a rank blocked inside one MPI
call runs it only when that call returns; the launcher kills it meanwhile, and the segment it
shares with its siblings is unlinked by whichever rank got there first. Without /proc the
handlers only exit. `import mpishard` installs nothing: library users keep their own handlers.
"""
from __future__ import annotations

import os
import signal

__all__ = ["install_cleanup_handlers", "mapped_shm_paths", "SHM_DIR"]

SHM_DIR = "/dev/shm/"
DELETED = " (deleted)"


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


def read_own_maps() -> str:
    """/proc/self/maps as text, '' where there is no /proc."""
    try:
        fd = os.open("/proc/self/maps", os.O_RDONLY)
    except OSError:
        return ""
    chunks = []
    try:
        while chunk := os.read(fd, 1 << 16):
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def install_cleanup_handlers(rank: int | None = None) -> None:
    """Replace the SIGTERM and SIGINT handlers of this (main-thread) process with: unlink the
    /dev/shm files it has mapped, say so in one stderr line naming `rank`, exit 128 + signum."""
    who = "" if rank is None else f" rank {rank}"

    def cleanup_and_exit(signum, frame):
        unlinked = 0
        for path in mapped_shm_paths(read_own_maps()):
            try:
                os.unlink(path)
                unlinked += 1
            except OSError:                      # a sibling was first, or not ours to remove
                pass
        if unlinked:
            name = signal.Signals(signum).name
            os.write(2, f"mpishard:{who} received {name}; unlinked {unlinked} shared-memory "
                        f"segment(s); exiting\n".encode())
        os._exit(128 + signum)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, cleanup_and_exit)

"""Files the MPI library left behind during a test stage: the Makefile's check around each one.

    python tests/hpc/leftovers.py before STATE      # list MPI's files now, into STATE
    ... the stage ...
    python tests/hpc/leftovers.py after STATE       # exit 1 naming each file the stage left

MPI's files are the /dev/shm segments named like health/signals.py's MPI_SHM_PATTERNS (MPICH's
mpich_shm_*, Open MPI's sm_segment.* and vader_segment.*, UCX's) and MPICH hydra's
/tmp/hydra_hwloc_xmlfile_*. A file the stage left is one that did not exist before it, still
exists after it and that no running process maps or holds open (a job still running, here or
beside the stage, keeps its own). Jobs that end normally remove theirs in MPI_Finalize; an
aborted job removes them through health/signals.py; this check finds the ones that got away.
"""
import glob
import json
import os
import sys

# health/signals.py's MPI_SHM_PATTERNS (tests/hpc/test_faults.py checks they agree), copied: this
# script must not import mpishard, whose import initialises MPI, and an Open MPI singleton
# leaves a segment of its own behind
MPI_SHM_PATTERNS = ("mpich_shm_*", "sm_segment.*", "vader_segment.*", "ucx_shm_posix_*")

LAUNCHER_FILES = "/tmp/hydra_hwloc_xmlfile_*"


def mpi_files() -> set:
    found = {p for pattern in MPI_SHM_PATTERNS for p in glob.glob(os.path.join("/dev/shm",
                                                                                pattern))}
    return found | set(glob.glob(LAUNCHER_FILES))


def in_use() -> set:
    """Every path some process maps or holds open (those it may read)."""
    used = set()
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                used.update(line.split(maxsplit=5)[5].strip() for line in f
                            if len(line.split(maxsplit=5)) == 6)
            for fd in os.listdir(f"/proc/{pid}/fd"):
                used.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:                          # gone, or another user's
            continue
    return used


def left_since(before: set) -> list:
    new = mpi_files() - before
    return sorted(new - in_use()) if new else []


def main(argv) -> int:
    if len(argv) != 3 or argv[1] not in ("before", "after"):
        print(__doc__, file=sys.stderr)
        return 2
    state = argv[2]
    if argv[1] == "before":
        with open(state, "w") as f:
            json.dump(sorted(mpi_files()), f)
        return 0
    with open(state) as f:
        left = left_since(set(json.load(f)))
    os.unlink(state)
    if left:
        print(f"==> the stage left {len(left)} file(s) of the MPI library: " + " ".join(left))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

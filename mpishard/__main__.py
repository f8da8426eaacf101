"""`python -m mpishard ...` (under mpiexec: `python -m mpi4py -m mpishard ...`) and the
`mpishard` console script; the commands are in mpishard/cli/. A process running an MPI command
first installs the SIGTERM/SIGINT handlers of health/signals.py (scancel, Ctrl-C: remove the MPI
library's own files of this job, then exit) and health/reaper.py's watcher, which removes them
once the node's ranks are gone however they ended (the launcher SIGKILLs them when mpiexec dies
of SIGPIPE, `| head`); output piped into `head` ends quietly (cli.run_and_exit); every command
run without a launcher under Open MPI removes the shared-memory segment such a singleton leaves
at exit (health/signals.py).
In-process `mpishard.cli.main([...])` installs nothing."""
import sys

from .cli import MPI_COMMANDS, main, run_and_exit
from .cli.usage import world_comm, world_rank
from .health.reaper import start_reaper
from .health.signals import install_cleanup_handlers, remove_singleton_segment_at_exit


def run() -> None:
    remove_singleton_segment_at_exit(world_comm())
    if sys.argv[1:2] and sys.argv[1] in MPI_COMMANDS:
        install_cleanup_handlers(rank=world_rank())
        start_reaper(world_comm())
    run_and_exit(lambda: main(exiting=True))


if __name__ == "__main__":
    run()

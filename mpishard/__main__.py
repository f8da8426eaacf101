"""`python -m mpishard ...` (under mpiexec: `python -m mpi4py -m mpishard ...`); the commands
are in mpishard/cli/."""
from .cli import exit_cleanly, main

exit_cleanly(main())

"""`python -m mpishard ...` (under mpiexec: `python -m mpi4py -m mpishard ...`); see cli.py."""
from .cli import exit_cleanly, main

exit_cleanly(main())

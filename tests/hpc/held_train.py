"""`python -m mpi4py tests/hpc/held_train.py DIR HOLD train ...`: `python -m mpishard train ...`
that writes each rank's exit code to DIR/exit.<rank> (a rank killed by a signal writes none)
and, with HOLD a name in mpishard.cli.train (make_engine, resume; "-": none), waits on entry to
that function: it writes DIR/ready.<rank> and returns to the build once DIR/go exists. A test
signals the ranks while they are held: inside the engine build or the resume, deterministically.
"""
import os
import sys
import time

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import mpishard.cli.train as train  # noqa: E402
from mpishard.__main__ import run  # noqa: E402

where, hold = sys.argv[1], sys.argv[2]
del sys.argv[1:3]
rank = MPI.COMM_WORLD.Get_rank()


def held(original):
    def wait_then_run(*args, **kwargs):
        open(os.path.join(where, f"ready.{rank}"), "w").close()
        while not os.path.exists(os.path.join(where, "go")):
            time.sleep(0.01)
        return original(*args, **kwargs)
    return wait_then_run


if hold != "-":
    setattr(train, hold, held(getattr(train, hold)))
try:
    run()
except SystemExit as exc:
    with open(os.path.join(where, f"exit.{rank}"), "w") as f:
        f.write(str(exc.code))
    raise

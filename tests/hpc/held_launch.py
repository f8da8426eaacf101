"""`python tests/hpc/held_launch.py DIR HOLD LAUNCHER ...`: a `mpishard launch --launcher` that
runs LAUNCHER ... with the ranks' `-m mpishard` replaced by `held_train.py DIR HOLD` (see
held_train.py: DIR/exit.<rank>, and a hold such as `step:N` the test releases with DIR/go).
It execs the launcher, so launch's signals and its clean-up reach the launcher's own pid.
"""
import os
import sys

HELD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "held_train.py")

where, hold, *argv = sys.argv[1:]
at = next(i for i in range(len(argv) - 1) if argv[i:i + 2] == ["-m", "mpishard"])
argv[at:at + 2] = [HELD, where, hold]
os.execvp(argv[0], argv)

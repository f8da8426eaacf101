"""health/reaper.py: the watcher removes its files only once its processes are gone, and no
watcher is started under `mpishard launch` (which cleans up after its jobs itself). The 2-rank
job piped into `head` is tests/cli/test_command_line.py's."""
import os
import subprocess
import sys
import time

import pytest

from mpishard.health.reaper import WATCHER

pytestmark = pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")


def test_the_watcher_waits_for_every_process_then_unlinks(tmp_path):
    files = [tmp_path / "segment", tmp_path / "topology"]
    for f in files:
        f.write_text("x")
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    watcher = subprocess.Popen([sys.executable, "-I", "-S", "-c", WATCHER,
                                "\n".join(map(str, files)), str(rank.pid)],
                               stdin=subprocess.PIPE)
    try:
        watcher.stdin.close()                    # the rank that started it has ended ...
        time.sleep(0.5)
        assert watcher.poll() is None and all(f.exists() for f in files)   # ... not this one
        rank.kill()
        rank.wait()
        assert watcher.wait(timeout=30) == 0
        assert not any(f.exists() for f in files)
    finally:
        rank.kill()
        watcher.kill()


PROBE = ("import sys; sys.path.insert(0, sys.argv[1]); from mpishard.health.reaper import "
         "under_launch; print(under_launch())")


@pytest.mark.parametrize("parent, expected", [(["mpishard", "launch"], "True"),
                                              (["mpishard", "train"], "False"),
                                              (["launch"], "False")])
def test_under_launch_looks_at_the_ancestors(parent, expected):
    """The probe's grandparent's argv holds `mpishard launch` (as `python -m mpishard launch`
    or the console script's does), with a shell between them as mpiexec and its proxy are."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    inner = subprocess.list2cmdline([sys.executable, "-c", PROBE, root])
    # no MPI singleton in the probe: Open MPI's keeps its sm_segment in /dev/shm after exit
    quiet = dict(os.environ, MPI4PY_RC_INITIALIZE="0")
    out = subprocess.run([sys.executable, "-c", "import subprocess, sys; sys.exit(subprocess."
                          "run(['sh', '-c', sys.argv[1]]).returncode)", inner, *parent],
                         capture_output=True, text=True, timeout=60, env=quiet)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == expected

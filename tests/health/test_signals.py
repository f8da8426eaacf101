"""A cancelled job cleans up (issue 15): SIGTERM/SIGINT make every rank unlink the MPI library's
/dev/shm files it mapped, print one line and exit 128 + signum (mpishard/health/signals.py); a
user's own shared memory, mapped by the same ranks, stays (issue 31, defect 7)."""
import json
import os
import re
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from mpi4py import MPI

from conftest import ROOT, mpiexec_cmd
from mpishard.health.signals import mapped_shm_paths, mpi_shm_paths

MAPS = """\
55d0c0a00000-55d0c0a01000 r--p 00000000 08:01 1234  /usr/bin/python3.11
7f0000000000-7f0000200000 rw-s 00000000 00:1a 77    /dev/shm/mpich_shm_c9541517_0
7f0000200000-7f0000210000 rw-s 00000000 00:1a 78    /dev/shm/ucx_shm_posix_25309267 (deleted)
7f0000210000-7f0000220000 rw-p 00000000 00:00 0
7f0000220000-7f0000420000 rw-s 00200000 00:1a 77    /dev/shm/mpich_shm_c9541517_0
7f0000420000-7f0000430000 rw-s 00000000 00:1a 79    /dev/shm/sm segment.vm.0
7f0000430000-7f0000440000 r--p 00000000 08:01 99    /tmp/dev/shm/not_shm
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0     [stack]
"""


def test_mapped_shm_paths_reads_each_live_dev_shm_file_once():
    assert mapped_shm_paths(MAPS) == ["/dev/shm/mpich_shm_c9541517_0", "/dev/shm/sm segment.vm.0"]
    assert mapped_shm_paths("") == []


def test_only_the_mpi_librarys_segments_are_removable():
    paths = ["/dev/shm/mpich_shm_c9541517_0", "/dev/shm/psm_2f1a9c", "/dev/shm/sm_segment.vm.0.1",
             "/dev/shm/vader_segment.vm.1f.2", "/dev/shm/ucx_shm_posix_25309267",
             "/dev/shm/torch_4242_1", "/dev/shm/my_mpich_shm_copy"]
    assert mpi_shm_paths(paths) == ["/dev/shm/mpich_shm_c9541517_0", "/dev/shm/sm_segment.vm.0.1",
                                    "/dev/shm/vader_segment.vm.1f.2",
                                    "/dev/shm/ucx_shm_posix_25309267"]


def rank_pids(marker, launcher):
    """Processes other than the launcher whose command line carries `marker`: the ranks."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == launcher:
            continue
        try:
            if marker in (entry / "cmdline").read_bytes().decode(errors="replace"):
                pids.append(int(entry.name))
        except OSError:                          # gone meanwhile
            pass
    return pids


def shm_mapped_by(pids):
    found = set()
    for pid in pids:
        try:
            found.update(mapped_shm_paths(Path(f"/proc/{pid}/maps").read_text()))
        except OSError:
            pass
    return found


@pytest.mark.skipif(not (os.path.isdir("/proc/self") and os.path.isdir("/dev/shm")),
                    reason="needs /proc and /dev/shm")
def test_sigterm_to_the_launcher_unlinks_the_jobs_shared_memory(tmp_path):
    marker = str(tmp_path / f"sigterm-{uuid.uuid4().hex}.json")    # finds the ranks by argv
    log = tmp_path / "out.txt"
    cmd = [*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", "-m", "mpishard", "train",
           "--dataset", "digits", "--layout", "dp=2", "--steps", "1000000", "--log-every", "20",
           "--no-progress", "--metrics-json", marker]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    with open(log, "w") as out:
        job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        # training: rank 0 logged a step, so both ranks are past the handlers (a step is a
        # collective) and MPI has mapped its segments
        deadline = time.monotonic() + 60
        while "step 20/" not in log.read_text():
            assert job.poll() is None, f"job ended early:\n{log.read_text()}"
            assert time.monotonic() < deadline, f"no training step in 60 s:\n{log.read_text()}"
            time.sleep(0.1)
        ranks = rank_pids(marker, job.pid)
        mapped = shm_mapped_by(ranks)
        print(f"ranks {ranks}; /dev/shm files they map: {sorted(mapped)}")
        assert len(ranks) == 2 and mapped
        job.send_signal(15)                      # what scancel sends; hydra forwards it
        code = job.wait(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
    text = log.read_text()
    deadline = time.monotonic() + 10             # the proxies may reap their ranks a bit later
    while rank_pids(marker, job.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert rank_pids(marker, job.pid) == [], "ranks left running after SIGTERM"
    assert code != 0, text
    # What the ranks mapped, not a before/after listing of /dev/shm: CI runs other jobs on this
    # node at the same time, whose segments come and go (or leak) independently of this one.
    left = sorted(p for p in mapped if os.path.exists(p))
    assert left == [], f"shared memory left after SIGTERM: {left}\n{text}"
    # MPICH's hydra forwards the ranks' stderr after SIGTERM: the rank that unlinked the
    # (shared) segment says so, the others found it gone already and stay quiet. Open MPI's
    # prterun stops forwarding output once it is signalled (the line is written, a rank's own
    # stderr shows it, and PRRTE removes its sm_segment.* files itself too): nothing to read.
    if "MPICH" not in MPI.Get_library_version():
        return
    # The ranks' lines arrive in any order, but each whole (one write: health/lines.py): a
    # SIGTERM line never shares a line with rank 0's step line or another rank's.
    said = [line for line in text.splitlines() if "received SIGTERM" in line]
    assert 1 <= len(said) <= 2, text
    for line in said:
        assert re.fullmatch(r"mpishard: rank [01] received SIGTERM; removed \d+ file\(s\) of the "
                            r"MPI library; exiting", line), said


HOLDER = """
import json, os, sys, time
from multiprocessing import resource_tracker, shared_memory
from mpi4py import MPI
from mpishard.health.signals import install_cleanup_handlers

comm = MPI.COMM_WORLD
install_cleanup_handlers(rank=comm.Get_rank())
shm = shared_memory.SharedMemory(name=sys.argv[1])            # the user's segment, mapped here
resource_tracker.unregister(shm._name, "shared_memory")       # (3.11 tracks attached ones too)
shm.buf[comm.Get_rank()] = 1
comm.Barrier()                                                # MPI's segments mapped too
with open(f"{sys.argv[2]}.{comm.Get_rank()}", "w") as f:
    json.dump({"pid": os.getpid(), "maps": open("/proc/self/maps").read()}, f)
while True:
    time.sleep(0.05)
"""


@pytest.mark.skipif(not (os.path.isdir("/proc/self") and os.path.isdir("/dev/shm")),
                    reason="needs /proc and /dev/shm")
def test_sigterm_leaves_the_users_shared_memory_in_place(tmp_path):
    from multiprocessing import shared_memory

    name = f"mpishard-test-{uuid.uuid4().hex[:12]}"
    user = shared_memory.SharedMemory(name=name, create=True, size=4096)
    script, ready = tmp_path / "holder.py", tmp_path / "ready"
    script.write_text(HOLDER)
    cmd = [*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", str(script), name, str(ready)]
    job = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not all(Path(f"{ready}.{r}").exists() for r in range(2)):
            assert job.poll() is None, f"job ended early:\n{job.stdout.read()}"
            assert time.monotonic() < deadline, "the ranks did not start in 60 s"
            time.sleep(0.05)
        time.sleep(0.2)                                       # both files written completely
        ranks = [json.loads(Path(f"{ready}.{r}").read_text()) for r in range(2)]
        mapped = set().union(*(mapped_shm_paths(r["maps"]) for r in ranks))
        mpi = set(mpi_shm_paths(mapped))
        print(f"the ranks map {sorted(mapped)}; MPI's: {sorted(mpi)}")
        assert f"/dev/shm/{name}" in mapped and mpi
        for r in ranks:
            os.kill(r["pid"], 15)
        out, _ = job.communicate(timeout=30)
        print(out)
        assert job.returncode != 0
        assert os.path.exists(f"/dev/shm/{name}"), "the user's shared memory was unlinked"
        assert bytes(user.buf[:2]) == b"\x01\x01"
        assert sorted(p for p in mpi if os.path.exists(p)) == []
    finally:
        if job.poll() is None:
            job.kill()
            job.wait()
        user.close()
        user.unlink()


def test_a_singleton_that_builds_an_engine_leaves_no_mpi_file():
    """Run without a launcher (`python script.py`), Open MPI 5 leaves its 16 MiB sm_segment in
    /dev/shm at every exit; an engine's process removes its own (health/signals.py), on a clean
    exit and after an uncaught exception alike (MPICH leaves none either way)."""
    import leftovers
    for code in ("import mpishard as ms; ms.make_engine(ms.MLP([2, 2]))",
                 "import mpishard as ms; ms.make_engine(ms.MLP([2, 2])); raise ValueError('x')"):
        before = leftovers.mpi_files()
        subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=120)
        assert leftovers.left_since(before) == [], code

"""`launch` (cli/launch.py) around a job: its output copied whatever bytes it holds, and the
MPI library's files its dead ranks left removed (cli/job_files.py), never another job's.

Serial tests: a stand-in launcher (a Python script that ignores the command it is given)
and stand-in rank processes that map a file named like MPICH's segments.
"""
import os
import select
import shlex
import signal
import subprocess
import sys
import time
import uuid

from conftest import ROOT
from mpishard.cli.job_files import JobFiles, descendants

LINES = 20000                  # about 1.3 MB a stream: many times what a pipe holds

FAKE_LAUNCHER = r'''
import sys
done = sys.argv[1]
for name, stream in (("out", sys.stdout.buffer), ("err", sys.stderr.buffer)):
    stream.write(b"caf\xe9 \xff\xfe: not UTF-8 (" + name.encode() + b")\n")
    for i in range(%d):
        stream.write(b"%%s line %%06d of a job that prints a lot\n" %% (name.encode(), i))
    stream.write(b"no newline at the end \xff")
    stream.flush()
open(done, "w").close()
sys.exit(3)
''' % LINES


def launch_fake(tmp_path, **kw):
    script, done = tmp_path / "fake_launcher.py", tmp_path / "done"
    script.write_text(FAKE_LAUNCHER)
    launcher = shlex.join([sys.executable, str(script), str(done)])
    argv = [sys.executable, "-m", "mpishard", "launch", "-n", "2", "--max-restarts", "0",
            "--launcher", launcher, "--", "train", "--steps", "1"]
    return subprocess.Popen(argv, cwd=ROOT, **kw), done


def test_output_that_is_not_utf8_is_copied_to_the_end(tmp_path):
    """Bytes that are not UTF-8 are copied as they are: a reader that stopped at one would
    leave the pipe full, the job blocked in its next write and launch waiting forever."""
    proc, done = launch_fake(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 3, err[-2000:]
    assert done.exists()
    for name, text in (("out", out), ("err", err)):
        assert f"caf\xe9 \xff\xfe: not UTF-8 ({name})\n".encode("latin-1") in text
        lines = [s for s in text.splitlines() if s.startswith(name.encode() + b" line ")]
        assert lines == [b"%s line %06d of a job that prints a lot" % (name.encode(), i)
                         for i in range(LINES)]
        assert b"\nno newline at the end \xff\n" in text
    assert err.splitlines()[-1].startswith(b"mpishard launch: ") and \
        err.splitlines()[-1].endswith(b"job ended (exit code 3); no restart left of 0")


def test_the_job_output_is_drained_when_ours_is_closed(tmp_path):
    """`launch ... | head -1`: our stdout closed; the job still runs to its end."""
    proc, done = launch_fake(tmp_path, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    proc.stdout.close()
    try:
        proc.wait(timeout=60)
    finally:
        proc.kill()
    assert done.exists()


STREAM = r'''
import os, sys, time
seen, done = sys.argv[1], sys.argv[2]
sys.stdout.write("tokens as they come:")
sys.stdout.flush()
deadline = time.monotonic() + 20
while not os.path.exists(seen) and time.monotonic() < deadline:
    time.sleep(0.05)
sys.stdout.write(" and the end of the line\n")
sys.stdout.flush()
open(done, "w").close()
'''


def test_a_line_still_being_written_shows_before_the_job_ends(tmp_path):
    """A job that prints part of a line (tokens of `generate`, no newline yet) and waits:
    launch writes that part once its job is quiet, not when the line ends; the rest follows."""
    script, seen, done = tmp_path / "stream.py", tmp_path / "seen", tmp_path / "done"
    script.write_text(STREAM)
    launcher = shlex.join([sys.executable, str(script), str(seen), str(done)])
    argv = [sys.executable, "-m", "mpishard", "launch", "-n", "1", "--max-restarts", "0",
            "--launcher", launcher, "--", "train", "--steps", "1"]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    got, deadline = b"", time.monotonic() + 15
    try:
        while b"tokens as they come:" not in got and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 0.1)[0]:
                got += os.read(proc.stdout.fileno(), 4096)
        assert got == b"tokens as they come:" and not done.exists(), got
        seen.touch()
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-2000:]
    assert got + out == b"tokens as they come: and the end of the line\n"


RANK = r'''
import mmap, os, sys, time
for path in sys.argv[1:]:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 4096)
    mapped = mmap.mmap(fd, 4096)
os.write(1, b"mapped\n")
time.sleep(120)
'''


def segment(tag):
    return f"/dev/shm/mpich_shm_test_{tag}_{uuid.uuid4().hex[:8]}_0"


def test_only_the_dead_job_s_segments_are_removed():
    """A stand-in job (a shell, the launcher, starting two rank processes): one rank maps
    `dead` and is SIGKILLed, one maps `kept` and outlives the job; `other` (another job's, named
    like MPICH's too) is never mapped by the job. Only `dead` is removed."""
    dead, kept, other = segment("dead"), segment("kept"), segment("other")
    with open(other, "wb") as f:
        f.write(b"another job's segment")
    rank = [shlex.quote(sys.executable), "-c", shlex.quote(RANK)]
    job = subprocess.Popen(["sh", "-c", f"{' '.join(rank)} {kept} & {' '.join(rank)} {dead}; "
                                        "exit 9"], stdout=subprocess.PIPE, text=True)
    files, ranks = JobFiles(job.pid, poll=0.05).start(), []
    try:
        assert job.stdout.readline() == "mapped\n" and job.stdout.readline() == "mapped\n"
        files.record()
        ranks += descendants(job.pid)
        assert len(ranks) == 2
        survivor = next(p for p in ranks if kept in open(f"/proc/{p}/maps").read())
        os.kill(next(p for p in ranks if p != survivor), signal.SIGKILL)
        assert job.wait(timeout=30) == 9
        assert set(files.seen) == {dead, kept}
        assert files.remove() == [dead]
        assert not os.path.exists(dead) and os.path.exists(kept) and os.path.exists(other)
    finally:
        for pid in ranks:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        job.kill()
        for path in (dead, kept, other):
            if os.path.exists(path):
                os.unlink(path)

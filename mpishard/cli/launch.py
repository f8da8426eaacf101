"""`python -m mpishard launch -n N [--max-restarts K] [--launcher CMD] -- train ...`: restarts.

A thin supervisor around the site's launcher (this project's torchrun): it runs

    CMD -n N python -m mpi4py -m mpishard train ...         (CMD: mpiexec by default, or srun)

and when the job dies (a rank killed, a node lost, a collective timeout: any exit code but 0
and 75) relaunches it, at most K times, with `--resume auto` in place of any --resume it had,
so each restart continues from the newest complete checkpoint of --checkpoint-dir (restarts
need one); a job given `--resume PATH` whose --checkpoint-dir holds no checkpoint yet (it
died before its first save there) restarts with `--resume PATH` again, not from step 0. Each
restart is logged in one line with its cause and what it resumes from: the exit code, the
signal that ended the launcher or a rank, and the rank when the job's output named it (hydra's
"BAD TERMINATION": the pid and host of the rank that ended first and why; MPICH's "Abort ...
(rank r in comm", mpishard's "mpishard: error: ... (rank r)").

The job's output is copied as bytes, as it comes, whatever it holds (a rank printing bytes
that are not UTF-8 must not stop the copy: a pipe nobody reads fills and the job then blocks
on its next write); when our own output is gone (a closed pipe) the job's is still read and
dropped. After each job, the MPI library's files its dead ranks left in /dev/shm are removed
(job_files.py: only files the job's own processes mapped).

Exit code 75 (EX_TEMPFAIL, train/preemption.py) is a job that was asked to stop and saved a
checkpoint. Signals to the supervisor (from a batch script, say) end the supervision and go on
to the launcher, which runs in its own session: the first SIGTERM or SIGUSR1 as SIGUSR1, which
every launcher passes to every rank (hydra, Open MPI's prterun, srun; prterun answers a SIGTERM
by killing the job instead), so the ranks checkpoint and exit 75, and the supervisor exits 75
for the batch system to requeue; SIGINT, or any second signal, as it is (stop now). A job that
exits 75 without the supervisor having been signalled is not relaunched either: its ranks were
signalled directly (Slurm's `--signal=USR1@T` without `B:`, `scancel --signal=USR1` without
`--batch`), the scheduler wants the allocation back, and a relaunch in it would run into the
kill; the supervisor exits 75 for the batch script to requeue. A signal that comes while no
job runs (after one died, before its restart) starts none: the supervisor exits 75 at once
(its checkpoint is the newest one there is).

`launch -- serve ...` supervises a server the same way, without checkpoints: it needs no
--checkpoint-dir, a restart runs the same command again (no --resume), and the SIGUSR1 that a
first SIGTERM/SIGUSR1 becomes asks the server to drain: it finishes its running requests and
exits 0, and so does the supervisor.
"""
from __future__ import annotations

import collections
import os
import re
import select
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

from ..checkpoint import is_checkpoint
from .cluster_options import AUTO
from .job_files import JobFiles
from .train import parse_train_args
from .usage import PROG, UsageError

PREEMPTED = 75                            # train/preemption.py PREEMPTED_EXIT (no MPI import)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)
CHECKPOINT = (signal.SIGTERM, signal.SIGUSR1)      # reach the ranks as SIGUSR1: checkpoint, 75
# What a job's output says about a rank: (pattern, template); the first one found is the cause.
RANK_PATTERNS = (
    (re.compile(r"PID (\d+) RUNNING AT (\S+)\s*=\s*EXIT CODE: (\d+)(?:[\s\S]*EXIT STRING: "
                r"(.*))?"), "a rank (pid {0} on {1}) ended: exit code {2}, {3}"),  # hydra's
    (re.compile(r"mpishard: error: (.*) \(rank (\d+)\)"), "rank {1}: {0}"),
    (re.compile(r"Abort\(\d+\) on node \S+ \(rank (\d+) in comm"),
     "rank {0} aborted (MPICH: a peer it was communicating with was lost)"))


def add_launch_arguments(p):
    p.add_argument("-n", "--np", type=int, required=True, dest="np", metavar="N",
                   help="ranks (passed to the launcher as -n N)")
    p.add_argument("--max-restarts", type=int, default=3, metavar="K", help="relaunch a job "
                   "that died at most K times with --resume auto (with its --resume PATH while "
                   "--checkpoint-dir holds no checkpoint yet; serve: as it was) (3; 0: "
                   "never); train needs --checkpoint-dir")
    p.add_argument("--launcher", metavar="CMD", help="the site's launcher, e.g. \"srun "
                   "--mpi=pmi2\" or \"mpiexec -f hosts\" (default: the mpiexec beside this "
                   "Python, else on PATH); -n N is appended")
    p.add_argument("job", nargs="...", metavar="-- COMMAND", help="-- train ... (the "
                   "mpishard command and its flags)")
    return p


def job_command(args, resume=None) -> list:
    """The launcher's argv: CMD -n N python -m mpi4py -m mpishard COMMAND, with `--resume
    RESUME` replacing any --resume when `resume` is given (a restart: `restart_resume`)."""
    launcher = shlex.split(args.launcher) if args.launcher else [_default_mpiexec()]
    command = list(args.job)
    if resume is not None:
        command = without_resume(command) + ["--resume", resume]
    return [*launcher, "-n", str(args.np), sys.executable, "-m", "mpi4py", "-m", "mpishard",
            *command]


def restart_resume(job) -> tuple:
    """What a restart of `job` (train's argv) resumes from, and why, in words: (`auto`, ...)
    when its --checkpoint-dir holds a checkpoint (the newest one), or when it was given no
    --resume PATH (a fresh start); (PATH, ...) when it was and the directory holds none yet."""
    try:
        args = parse_train_args(job[1:]) if job[:1] == ["train"] else None
    except (UsageError, SystemExit):      # the job refused its flags too
        args = None
    if args is None or args.checkpoint_dir is None:
        return AUTO, "the newest checkpoint of its --checkpoint-dir, if any"
    if is_checkpoint(args.checkpoint_dir):
        return AUTO, f"the newest checkpoint in {args.checkpoint_dir}"
    if isinstance(args.resume, str) and args.resume != AUTO:
        return args.resume, f"{args.checkpoint_dir} holds no checkpoint yet"
    return AUTO, f"{args.checkpoint_dir} holds no checkpoint, so it starts fresh"


def without_resume(command) -> list:
    """`command` without --resume, --resume=X or --resume X (X not a flag)."""
    out, skip = [], False
    for i, token in enumerate(command):
        if skip:
            skip = False
        elif token == "--resume":
            skip = i + 1 < len(command) and not command[i + 1].startswith("-")
        elif not token.startswith("--resume="):
            out.append(token)
    return out


def _default_mpiexec() -> str:
    beside = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    found = shutil.which(beside) or shutil.which("mpiexec")
    if found is None:
        raise UsageError("no mpiexec beside this Python or on PATH: give --launcher CMD")
    return found


def cause(rc: int, lines) -> str:
    """Why a job ended, from its exit code and the last lines of its output."""
    text = "\n".join(lines)
    what = f"exit code {rc}"
    if rc < 0:
        what += f" (the launcher killed by {signal.Signals(-rc).name})"
    elif rc > 128 and rc - 128 in signal.valid_signals():
        what += f" (signal {signal.Signals(rc - 128).name})"
    for pattern, template in RANK_PATTERNS:
        found = pattern.search(text)
        if found:
            return f"{what}; {template.format(*(g or '?' for g in found.groups()))}"
    return what


def _pump(stream, sink, tail, chunk: int = 1 << 16, quiet: float = 0.2) -> None:
    """Copy the child's output (bytes) to `sink` (ours) until its end, keeping the last lines
    in `tail` (decoded, a bad byte replaced). Whole lines go in one write, so the supervisor's
    own lines never land inside one. A line without an end yet is written once no more output
    came for `quiet` seconds (a token stream from `generate` shows as it comes) or once it
    holds `chunk` bytes; the rest of it follows. The output's end is ended with a newline."""
    fd, held, shown = stream.fileno(), b"", b""    # shown: the current line's part written
    while True:
        if held and not select.select([fd], [], [], quiet)[0]:
            _copy(sink, held)
            shown, held = (shown + held)[-chunk:], b""
            continue
        data = os.read(fd, chunk)
        if not data:
            break
        held += data
        cut = max(held.rfind(b"\n"), held.rfind(b"\r")) + 1
        if not cut and len(held) < chunk:
            continue                     # the rest of the line may come at once
        if not cut:
            _copy(sink, held)
            shown, held = (shown + held)[-chunk:], b""
            continue
        _copy(sink, held[:cut])
        tail.extend((shown + held[:cut]).decode(errors="replace").splitlines())
        shown, held = b"", held[cut:]
    if held or shown:                    # ended, so our own lines start on a line of their own
        _copy(sink, held + b"\n")
        tail.append((shown + held).decode(errors="replace"))
    stream.close()


def _copy(sink, data: bytes) -> None:
    """Write bytes to `sink` (a text stream: through its binary buffer when it has one); when
    that fails (our output closed), drop them: the job's pipe is drained all the same."""
    try:
        if hasattr(sink, "buffer"):
            sink.buffer.write(data)
        else:
            sink.write(data.decode(errors="replace"))
        sink.flush()
    except (OSError, ValueError):
        pass


def run_once(argv, state) -> tuple:
    """Run the job once, forwarding signals; returns (exit code, its last output lines)."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                start_new_session=True)
    except OSError as exc:                  # a --launcher that is not there: one line, exit 2
        raise UsageError(f"launch: cannot run {argv[0]!r}: {exc.strerror}") from None
    state["proc"] = proc
    files = JobFiles(proc.pid).start()
    tail = collections.deque(maxlen=200)
    pumps = [threading.Thread(target=_pump, args=(s, out, tail), daemon=True)
             for s, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr))]
    for t in pumps:
        t.start()
    if state["signalled"] and not state["sent"]:   # it came while the job was being started
        _pass_on(proc, state["signalled"], first=True)
        state["sent"] = True
    rc = proc.wait()
    for t in pumps:
        t.join()
    removed = files.remove()
    if removed:
        _say(f"removed {len(removed)} file(s) the ended job's MPI library left: "
             f"{' '.join(removed)}")
    return rc, list(tail)


def run_launch(args) -> int:
    if not args.job or args.job[0] != "--" and args.job[0].startswith("-"):
        raise UsageError("launch: give the command after --: launch -n N -- train ...")
    args.job = args.job[1:] if args.job[0] == "--" else args.job
    if args.np < 1 or args.max_restarts < 0:
        raise UsageError(f"launch: -n must be >= 1 and --max-restarts >= 0, got -n {args.np} "
                         f"--max-restarts {args.max_restarts}")
    if args.max_restarts and args.job[:1] == ["train"] and not {
            "--checkpoint-dir", "--config"} & {t.split("=")[0] for t in args.job}:
        raise UsageError("launch --max-restarts needs train --checkpoint-dir DIR (a restart "
                         "resumes from it); give one, or --max-restarts 0")
    state = {"proc": None, "signalled": None, "sent": False}

    def forward(signum, frame):        # the first SIGTERM/SIGUSR1 goes on as SIGUSR1 (module doc)
        first, state["signalled"] = state["signalled"] is None, state["signalled"] or signum
        if state["proc"] is not None and state["proc"].poll() is None:
            _pass_on(state["proc"], signum, first)
            state["sent"] = True
    previous = {signum: signal.signal(signum, forward) for signum in FORWARDED}
    try:
        return _supervise(args, state)
    finally:                           # an in-process caller gets its handlers back
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _supervise(args, state) -> int:
    """Run the job and relaunch it (module docstring); returns the exit code."""
    restarts, resume = 0, None
    while True:
        if state["signalled"]:         # it came between two runs: start none, requeue
            _say(f"stopped on {signal.Signals(state['signalled']).name} before a restart: "
                 f"exit code {PREEMPTED}")
            return PREEMPTED
        argv = job_command(args, resume=resume)
        _say(f"starting: {shlex.join(argv)}")
        rc, tail = run_once(argv, state)
        if rc == 0 or state["signalled"]:
            if state["signalled"]:
                _say(f"stopped on {signal.Signals(state['signalled']).name}: exit code {rc}")
            return rc if rc >= 0 else 128 - rc
        if rc == PREEMPTED:            # the ranks were signalled directly: requeue, not here
            _say("job stopped on a signal to its ranks and saved a checkpoint: exit code 75, "
                 "not restarted (requeue the job)")
            return PREEMPTED
        why = cause(rc, tail)
        if restarts >= args.max_restarts:
            _say(f"job ended ({why}); no restart left of {args.max_restarts}")
            return rc if rc >= 0 else 128 - rc
        restarts += 1
        if args.job[:1] != ["train"]:   # a server (serve) or a batch job: run it again as is
            _say(f"job ended ({why}); restart {restarts} of {args.max_restarts}")
            continue
        resume, source = restart_resume(args.job)
        _say(f"job ended ({why}); restart {restarts} of {args.max_restarts} with --resume "
             f"{resume}: {source}")


def _pass_on(proc, signum, first) -> None:
    proc.send_signal(signal.SIGUSR1 if first and signum in CHECKPOINT else signum)


def _say(text) -> None:
    print(f"{PROG} launch: {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


__all__ = ["add_launch_arguments", "cause", "job_command", "restart_resume", "run_launch",
           "without_resume"]

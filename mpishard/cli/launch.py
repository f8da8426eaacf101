"""`python -m mpishard launch -n N [--max-restarts K] [--launcher CMD] -- train ...`: restarts.

A thin supervisor around the site's launcher (this project's torchrun): it runs

    CMD -n N python -m mpi4py -m mpishard train ...         (CMD: mpiexec by default, or srun)

and when the job dies (a rank killed, a node lost, a collective timeout: any exit code but 0
and 75) relaunches it, at most K times, with `--resume auto` in place of any --resume it had,
so each restart continues from the newest complete checkpoint of --checkpoint-dir (restarts
need one). Each restart is logged with its cause: the exit code, the signal that ended the
launcher or a rank, and the rank when the job's output named it (hydra's "BAD TERMINATION":
the pid and host of the rank that ended first and why; MPICH's "Abort ... (rank r in comm",
mpishard's "mpishard: error: ... (rank r)").

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
"""
from __future__ import annotations

import collections
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time

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
                   "that died at most K times with --resume auto (3; 0: never); needs "
                   "train --checkpoint-dir")
    p.add_argument("--launcher", metavar="CMD", help="the site's launcher, e.g. \"srun "
                   "--mpi=pmi2\" or \"mpiexec -f hosts\" (default: the mpiexec beside this "
                   "Python, else on PATH); -n N is appended")
    p.add_argument("job", nargs="...", metavar="-- COMMAND", help="-- train ... (the "
                   "mpishard command and its flags)")
    return p


def job_command(args, restart: bool) -> list:
    """The launcher's argv: CMD -n N python -m mpi4py -m mpishard COMMAND, with --resume auto
    replacing any --resume on a restart."""
    launcher = shlex.split(args.launcher) if args.launcher else [_default_mpiexec()]
    command = list(args.job)
    if restart:
        command = without_resume(command) + ["--resume", "auto"]
    return [*launcher, "-n", str(args.np), sys.executable, "-m", "mpi4py", "-m", "mpishard",
            *command]


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


def _pump(stream, sink, tail) -> None:
    """Copy the child's lines to `sink` (ours), keeping the last ones in `tail`."""
    for line in iter(stream.readline, ""):
        sink.write(line)
        sink.flush()
        tail.append(line.rstrip("\n"))
    stream.close()


def run_once(argv, state) -> tuple:
    """Run the job once, forwarding signals; returns (exit code, its last output lines)."""
    try:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)
    except OSError as exc:                  # a --launcher that is not there: one line, exit 2
        raise UsageError(f"launch: cannot run {argv[0]!r}: {exc.strerror}") from None
    state["proc"] = proc
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
    return rc, list(tail)


def run_launch(args) -> int:
    if not args.job or args.job[0] != "--" and args.job[0].startswith("-"):
        raise UsageError("launch: give the command after --: launch -n N -- train ...")
    args.job = args.job[1:] if args.job[0] == "--" else args.job
    if args.np < 1 or args.max_restarts < 0:
        raise UsageError(f"launch: -n must be >= 1 and --max-restarts >= 0, got -n {args.np} "
                         f"--max-restarts {args.max_restarts}")
    if args.max_restarts and not {"--checkpoint-dir", "--config"} & {
            t.split("=")[0] for t in args.job}:
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
    restarts = 0
    while True:
        if state["signalled"]:         # it came between two runs: start none, requeue
            _say(f"stopped on {signal.Signals(state['signalled']).name} before a restart: "
                 f"exit code {PREEMPTED}")
            return PREEMPTED
        argv = job_command(args, restart=restarts > 0)
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
        _say(f"job ended ({why}); restart {restarts} of {args.max_restarts} with --resume auto")


def _pass_on(proc, signum, first) -> None:
    proc.send_signal(signal.SIGUSR1 if first and signum in CHECKPOINT else signum)


def _say(text) -> None:
    print(f"{PROG} launch: {time.strftime('%H:%M:%S')} {text}", file=sys.stderr, flush=True)


__all__ = ["add_launch_arguments", "cause", "job_command", "run_launch", "without_resume"]

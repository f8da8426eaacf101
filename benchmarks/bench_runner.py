"""The benchmark run's launcher (benchmarks/run_all.py): each part's subprocess with the
benchmark environment, its JSON or the cause of its failure, and the run's metadata (commit,
machine, MPI, the BLAS a child ran on).

Every child runs numpy's BLAS on the kernel the CPU supports (kernels.true_kernel_env: the
OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE variables removed) with OMP_NUM_THREADS =
OPENBLAS_NUM_THREADS = MKL_NUM_THREADS = BLAS_THREADS (default 1), and benchmarks/ and the
repository on PYTHONPATH.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import kernels
import numpy

HERE = Path(__file__).resolve().parent


def _cause(output: str, tail: list) -> str:
    """The Python exception lines a crashed part printed (its cause, whatever the launcher
    printed after it: Open MPI's abort banner fills the tail), else the output's last lines."""
    found = re.findall(r"^(?:mpishard: error: )?[A-Za-z_.]*(?:Error|Exception|Timeout)\b.*$",
                       output, re.MULTILINE)
    return " | ".join(dict.fromkeys(found[-3:])) if found else " | ".join(tail[-4:])


class Runner:
    """Launches the parts and collects their JSON."""

    def __init__(self, args):
        self.args = args
        self.mpiexec = shlex.split(args.mpiexec)
        self.env = kernels.true_kernel_env(os.environ)
        threads = os.environ.get("BLAS_THREADS", "1")
        for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            self.env[var] = os.environ.get(var, threads)
        self.env["PYTHONPATH"] = os.pathsep.join(
            [str(HERE), str(HERE.parent)] + [p for p in [os.environ.get("PYTHONPATH")] if p])
        self.mode = "tiny" if args.tiny else "quick" if args.quick else "full"
        self.size_flag = {"tiny": ["--tiny"], "quick": ["--quick"], "full": []}[self.mode]
        self.log = []

    def run(self, cmd, timeout):
        """Run `cmd` with a --json file appended; returns its JSON, or {'error': ...}."""
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out.json"
            cmd = [str(c) for c in cmd] + ["--json", str(out)]
            t0 = time.perf_counter()
            print("==> " + " ".join(shlex.quote(c) for c in cmd), flush=True)
            try:
                proc = subprocess.run(cmd, env=self.env, cwd=HERE.parent, timeout=timeout,
                                      capture_output=True, text=True)
            except subprocess.TimeoutExpired:
                return {"error": f"timed out after {timeout} s: {' '.join(cmd)}"}
            wall = time.perf_counter() - t0
            self.log.append({"cmd": " ".join(cmd), "rc": proc.returncode, "wall_s": wall})
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            if self.args.verbose or proc.returncode:
                print("\n".join(tail), flush=True)
            if proc.returncode or not out.exists():
                return {"error": f"exit {proc.returncode}: " + _cause(proc.stdout + proc.stderr,
                                                                      tail)}
            res = json.loads(out.read_text())
            res.setdefault("wall_s", wall)
            return res

    def mpi(self, n, script, *extra, timeout):
        return self.run(self.mpiexec + ["-n", str(n), sys.executable, "-m", "mpi4py",
                                        HERE / script, *extra, *self.size_flag], timeout)

    def serial(self, script, *extra, timeout, flags=True):
        return self.run([sys.executable, HERE / script, *extra,
                         *(self.size_flag if flags else [])], timeout)



def meta(args, r: Runner, wall) -> dict:
    """results.json's meta: the commit, date, machine, versions, the command and every child
    run. MPI's version is read last, in the parent only now (mpi4py starts MPI on import)."""
    try:
        from mpi4py import MPI

        mpi = MPI.Get_library_version().splitlines()[0].strip()
    except Exception as exc:      # noqa: BLE001 - informational only
        mpi = f"unknown ({exc})"
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    argv = sys.argv[1:] if args.argv is None else args.argv
    cmd = " ".join(["python benchmarks/run_all.py"] + [shlex.quote(a) for a in argv])
    return {"commit": git_commit(),
            "date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"),
            "machine": f"{os.cpu_count()} cores, {platform.processor() or platform.machine()}",
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
            "python": platform.python_version(), "numpy": numpy.__version__, "mpi": mpi,
            "torch": torch_version, "mode": r.mode, "parts": args.parts,
            "threads_per_rank": int(r.env["OMP_NUM_THREADS"]),
            "blas": r.run([sys.executable, HERE / "kernels.py"], timeout=300).get("blas"),
            "kernel_vars_removed": {
                k: os.environ[k] for k in kernels.KERNEL_VARS if k in os.environ},
            "mpiexec": args.mpiexec, "command": cmd, "wall_s": wall, "runs": r.log}


def git_commit() -> str:
    """HEAD's hash, '-dirty' when tracked files differ from it; 'unknown' outside git."""
    def git(*argv):
        return subprocess.run(["git", *argv], cwd=HERE.parent, capture_output=True,
                              text=True, timeout=30, check=True).stdout.strip()
    try:
        head = git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


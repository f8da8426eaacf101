"""`make test-hosts`: one MPI job over two "hosts" made of network namespaces, over TCP.

    python tests/hpc/two_hosts.py [--keep-going]        (the venv's python; root)

1. Creates two network namespaces (`mpishard<pid>a`, `mpishard<pid>b`) joined by a veth pair
   with the addresses 10.213.<k>.1 and 10.213.<k>.2, which exist only inside those two
   namespaces: they hold nothing but that link and their own loopback, so nothing outside them
   is ever contacted. Each "host" also gets its own UTS namespace and hostname (mshost-a,
   mshost-b), so MPI_Get_processor_name tells them apart.
2. Launches jobs with the venv's MPICH `mpiexec` (hydra) from host a, `-hosts <a>,<b>`: hydra
   starts its proxy on host b through `-launcher ssh -launcher-exec` a generated wrapper that
   runs `ip netns exec <ns> unshare --uts` instead of ssh (the same hook a site uses for a
   custom remote shell). Inside a host, ranks use MPICH's shared memory; between hosts, UCX
   is held to TCP (UCX_TLS=tcp,self: the two namespaces share one kernel, and UCX would
   otherwise reach across them through shared memory, which real hosts cannot).
3. Measures the all-reduce bandwidth between the hosts (2 ranks, one per host,
   tests/hpc/allreduce_bw.py) next to the same 2 ranks on one host, and checks that the bytes
   really crossed the veth link (its receive counter).
4. Trains a small GPT under dp=2,tp=2 (4 ranks, 2 per host: tp inside a host, dp across) in
   float64 and checks that its loss and gradient-norm histories and validation loss equal the
   single-host run of the same command (rtol 1e-12).
5. Deletes the namespaces (which removes the veth pair) and checks no process of the jobs is
   left, also when interrupted (finally + SIGTERM/SIGINT handlers).

Exit 0: passed; 77: skipped (not root, or no `ip`/`unshare`; the reason on one line);
anything else: failed. Output lines start with `==> test-hosts:`.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PY = Path(sys.executable)
MPIEXEC = Path(os.environ.get("MPIEXEC") or PY.parent / "mpiexec").absolute()
JOB_TIMEOUT = 300
GPT = ["-m", "mpishard", "train", "--model", "gpt",
       "--gpt", "d_model=32,n_heads=2,n_layers=2,seq_len=16", "--text", "synthetic:0",
       "--corpus-bytes", "60000", "--layout", "dp=2,tp=2", "--dtype", "float64",
       "--optimizer", "adamw", "--lr", "0.003", "--batch", "16", "--steps", "20",
       "--log-every", "10", "--no-progress", "--device", "cpu"]
# Between the namespace hosts UCX may only use TCP; ranks on one host still use MPICH's shm.
JOB_ENV = {"UCX_TLS": "tcp,self", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}

WRAPPER = """#!/bin/sh
# hydra's ssh launcher runs: <this> [ssh options] HOST COMMAND...; run COMMAND in HOST's
# network and UTS namespaces instead of over ssh.
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
case "$host" in
%(cases)s
  *) echo "netns launcher: unknown host $host" >&2; exit 1 ;;
esac
exec ip netns exec "$ns" unshare --uts sh -c "hostname $name; exec $*"
"""


def say(msg):
    print(f"==> test-hosts: {msg}", flush=True)


def skip(why):
    say(f"SKIPPED: {why}")
    sys.exit(77)


def sh(*cmd, check=True):
    return subprocess.run([str(c) for c in cmd], check=check, capture_output=True, text=True)


class Hosts:
    """Two namespace hosts joined by a veth pair; a context manager that always tears down."""

    def __init__(self):
        pid = os.getpid()
        k = 1 + pid % 250
        self.ns = [f"mpishard{pid}a", f"mpishard{pid}b"]
        self.veth = [f"msv{pid % 100000}a", f"msv{pid % 100000}b"]
        self.addr = [f"10.213.{k}.1", f"10.213.{k}.2"]
        self.name = ["mshost-a", "mshost-b"]
        self.tmp = Path(tempfile.mkdtemp(prefix="mpishard-hosts."))
        self.wrapper = self.tmp / "netns-launcher.sh"

    def __enter__(self):
        try:
            for ns in self.ns:
                sh("ip", "netns", "add", ns)
            sh("ip", "link", "add", self.veth[0], "type", "veth", "peer", "name", self.veth[1])
            for ns, dev, addr in zip(self.ns, self.veth, self.addr):
                sh("ip", "link", "set", dev, "netns", ns)
                sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev)
                sh("ip", "-n", ns, "link", "set", dev, "up")
                sh("ip", "-n", ns, "link", "set", "lo", "up")
        except subprocess.CalledProcessError as e:
            self.__exit__()
            skip(f"cannot create network namespaces here: {' '.join(e.cmd)}: "
                 f"{e.stderr.strip()}")
        cases = "\n".join(f'  {a}) ns={ns}; name={n} ;;'
                          for a, ns, n in zip(self.addr, self.ns, self.name))
        self.wrapper.write_text(WRAPPER % {"cases": cases})
        self.wrapper.chmod(0o755)
        return self

    def __exit__(self, *exc):
        for ns in self.ns:
            # the namespace's processes first (a job left by a failure), then the namespace
            pids = sh("ip", "netns", "pids", ns, check=False).stdout.split()
            for p in pids:
                try:
                    os.kill(int(p), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            sh("ip", "netns", "del", ns, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

    def rx_bytes(self, i):
        """Bytes host i's end of the link has received."""
        out = sh("ip", "netns", "exec", self.ns[i], "cat",
                 f"/sys/class/net/{self.veth[i]}/statistics/rx_bytes").stdout
        return int(out)

    def mpiexec(self, n, ppn, args, env):
        """mpiexec on host a with ranks spread `ppn` per host over both hosts."""
        cmd = ["ip", "netns", "exec", self.ns[0], "unshare", "--uts", "sh", "-c",
               f'hostname {self.name[0]} && exec "$@"', "sh",
               str(MPIEXEC), "-launcher", "ssh", "-launcher-exec", str(self.wrapper),
               "-hosts", ",".join(self.addr), "-n", str(n), "-ppn", str(ppn)]
        for k, v in env.items():
            cmd += ["-genv", k, v]
        return cmd + [str(PY), "-m", "mpi4py", *args]


def one_host(n, args, env):
    cmd = [str(MPIEXEC), "-n", str(n)]
    for k, v in env.items():
        cmd += ["-genv", k, v]
    return cmd + [str(PY), "-m", "mpi4py", *args]


def run(cmd, what):
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=JOB_TIMEOUT, cwd=ROOT)
    secs = time.perf_counter() - t0
    if r.returncode != 0:
        tail = (r.stdout + r.stderr)[-3000:]
        raise AssertionError(f"{what} failed (exit {r.returncode}):\n{tail}")
    return r, secs


def last_json(text):
    return json.loads([ln for ln in text.splitlines() if ln.startswith("{")][-1])


def rel_diff(a, b):
    return max(abs(x - y) / max(abs(y), 1e-300) for x, y in zip(a, b, strict=True))


def stage():
    if os.geteuid() != 0:
        skip("network namespaces need root; not root")
    for tool in ("ip", "unshare"):
        if shutil.which(tool) is None:
            skip(f"`{tool}` not found (iproute2 / util-linux)")
    if not MPIEXEC.exists():
        say(f"FAILED: {MPIEXEC} not found (make venv)")
        return 1
    bw = str(ROOT / "tests" / "hpc" / "allreduce_bw.py")
    with Hosts() as hosts:
        say(f"hosts {hosts.name[0]} ({hosts.ns[0]}, {hosts.addr[0]}) and "
            f"{hosts.name[1]} ({hosts.ns[1]}, {hosts.addr[1]}) over a veth pair")
        # -- bandwidth: one rank per host, then both ranks on one host ----------------------
        rx0 = hosts.rx_bytes(1)
        r, _ = run(hosts.mpiexec(2, 1, [bw, "16"], JOB_ENV), "all-reduce across hosts")
        crossed = hosts.rx_bytes(1) - rx0
        two = last_json(r.stdout)
        assert two["hosts"] == hosts.name, f"ranks ran on {two['hosts']}, not one per host"
        # 9 all-reduces of 16 MiB each way at least (ring/recursive doubling move >= n bytes)
        assert crossed >= 9 * 16 * 2**20, f"only {crossed} bytes crossed the veth link"
        r, _ = run(one_host(2, [bw, "16"], {}), "all-reduce on one host")
        one = last_json(r.stdout)
        say(f"all-reduce 16 MiB float32, 2 ranks: across the two hosts (TCP) raw "
            f"{two['raw_gbps']:.2f} GB/s, engine {two['engine_gbps']:.2f} GB/s; on one host "
            f"(shared memory) raw {one['raw_gbps']:.2f} GB/s, engine {one['engine_gbps']:.2f} "
            f"GB/s; {crossed / 2**20:.0f} MiB crossed the link")
        # -- training: dp=2,tp=2 with tp inside each host, dp across -------------------------
        metrics = [hosts.tmp / "two.json", hosts.tmp / "one.json"]
        rx0 = hosts.rx_bytes(1)
        _, t_two = run(hosts.mpiexec(4, 2, [*GPT, "--metrics-json", metrics[0]], JOB_ENV),
                       "dp=2,tp=2 training across hosts")
        crossed = hosts.rx_bytes(1) - rx0
        _, t_one = run(one_host(4, [*GPT, "--metrics-json", metrics[1]], {}),
                       "dp=2,tp=2 training on one host")
        got, want = (json.loads(m.read_text()) for m in metrics)
        diffs = {k: rel_diff(got[k], want[k])
                 for k in ("loss_history", "grad_norm_history")}
        diffs["val_loss"] = rel_diff([got["val_loss"]], [want["val_loss"]])
        worst = max(diffs.values())
        assert worst <= 1e-12, f"two-host run differs from one host: {diffs}"
        assert got["world_size"] == 4 and got["layout"] == "dp=2,tp=2"
        say(f"GPT dp=2,tp=2 float64, {len(got['loss_history'])} steps: two hosts == one host "
            f"(max relative difference {worst:.1e} over losses, gradient norms and val loss "
            f"{got['val_loss']:.6f}); {t_two:.1f} s across hosts vs {t_one:.1f} s on one; "
            f"{crossed / 2**20:.1f} MiB crossed the link")
        ns = list(hosts.ns)
    left = [n for n in sh("ip", "netns", "list").stdout.split() if n in ns]
    assert not left, f"namespaces left: {left}"
    say("passed (namespaces removed)")
    return 0


def main():
    def on_signal(signum, _frame):
        raise SystemExit(128 + signum)          # unwinds through Hosts.__exit__
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        return stage()
    except (AssertionError, subprocess.TimeoutExpired) as e:
        say(f"FAILED: {e}")
        return 1


if __name__ == "__main__":
    sys.exit(main())

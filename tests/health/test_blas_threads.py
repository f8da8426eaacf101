"""health/threads.py: ranks sharing a node's cores share out the BLAS threads.

The share rule alone (serial), the user's choice respected (THREAD_VARS, None, an int), a
real pool limited in a fresh interpreter whose BLAS started several threads, and under MPI:
the ranks of a node never run more BLAS threads than their CPUs, and the engine applies it.
"""
import json
import os

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from conftest import MALLINFO_PROBE, run_python
from mpishard.health.threads import THREAD_VARS, BlasThreads, cpu_set, pin_blas_threads, \
    threads_for

CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in THREAD_VARS}


@pytest.mark.parametrize("mine, others, expected", [
    ({0, 1, 2, 3}, [{0, 1, 2, 3}] * 4, (1, 4)),           # 4 unbound ranks, 4 cores
    ({0, 1, 2, 3}, [{0, 1, 2, 3}] * 3, (1, 3)),           # 4 // 3
    (set(range(16)), [set(range(16))] * 2, (8, 2)),       # 2 ranks, 16 cores
    ({0, 1}, [{0, 1}, {2, 3}, {4, 5}], (2, 1)),           # bound to disjoint cores: keep all
    ({0}, [{0}] * 8, (1, 8)),                             # oversubscribed: never 0
    ({0, 1, 2, 3}, [{0, 1, 2, 3}, {2, 3}, {8, 9}], (2, 2)),  # partly overlapping
])
def test_share_of_a_cpu_set(mine, others, expected):
    assert threads_for(frozenset(mine), [frozenset(o) for o in others]) == expected


@pytest.mark.parametrize("var", THREAD_VARS)
def test_a_thread_variable_set_by_the_user_is_respected(var):
    got = pin_blas_threads(MPI.COMM_SELF, "auto", environ={var: "3"})
    assert got.threads is None and f"{var}=3" in got.why


def test_none_leaves_the_pool_alone():
    assert pin_blas_threads(MPI.COMM_SELF, None, environ={}) == \
        BlasThreads(None, None, "blas_threads=None: left as it was")


@pytest.mark.parametrize("bad", [0, -1, 1.5, "two", True])
def test_a_bad_request_raises_before_any_communication(bad):
    with pytest.raises(ValueError, match="blas_threads must be 'auto', None or a positive int"):
        pin_blas_threads(MPI.COMM_NULL, bad, environ={})   # COMM_NULL: any MPI call would fail


PROBE = """
import json, sys
import numpy as np
from mpi4py import MPI
from threadpoolctl import threadpool_info
from mpishard.health.threads import pin_blas_threads
before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
got = pin_blas_threads(MPI.COMM_SELF, json.loads(sys.argv[1]))
after = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
print(json.dumps({"before": before, "after": after, "threads": got.threads, "why": got.why}))
"""


def probe(request) -> dict:
    out = run_python(["-c", PROBE, json.dumps(request)], env=CLEAN_ENV,
                         capture_output=True, text=True, timeout=120, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_int_limits_a_real_pool_in_a_fresh_interpreter():
    res = probe(1)
    if max(res["before"], default=1) < 2:
        pytest.skip(f"the BLAS started {res['before']} thread(s): nothing to limit")
    assert res["after"] == [1] * len(res["before"]) and res["threads"] == 1


def test_auto_alone_on_its_node_keeps_its_cpus():
    res = probe("auto")
    cpus = len(cpu_set())
    assert "1 rank(s) on this node" in res["why"]
    assert res["after"] == [min(cpus, b) for b in res["before"]]


@pytest.mark.mpi(min_size=1)
def test_the_ranks_of_a_node_never_run_more_threads_than_their_cpus():
    world = MPI.COMM_WORLD
    got = pin_blas_threads(world, "auto", environ={})
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        rows = node.allgather((sorted(cpu_set()), got.threads, got.before))
    finally:
        node.Free()
    for cpus, threads, before in rows:
        assert threads is not None and 1 <= threads <= before    # never raised
        sharing = [t for c, t, _ in rows if set(c) & set(cpus)]
        assert threads <= max(1, len(cpus) // len(sharing))
        same = [t for c, t, _ in rows if c == cpus]
        if len(same) <= len(cpus):          # not oversubscribed: no more threads than CPUs
            assert sum(same) <= len(cpus)


@pytest.mark.mpi(min_size=1)
def test_the_engine_pins_when_built_and_leaves_a_user_choice_alone():
    n = MPI.COMM_WORLD.Get_size()
    engine = ms.make_engine(ms.MLP([4, 8, 2]), f"dp={n}", blas_threads=None)
    assert engine.blas_threads.threads is None
    engine = ms.make_engine(ms.MLP([4, 8, 2]), f"dp={n}", dtype=np.float32)
    # the suite runs with OMP_NUM_THREADS=1 (Makefile, conftest.run_mpi): left to the BLAS
    if any(os.environ.get(v) for v in THREAD_VARS):
        assert engine.blas_threads.threads is None
    with pytest.raises(ValueError, match="blas_threads"):
        ms.make_engine(ms.MLP([4, 8, 2]), f"dp={n}", blas_threads=0)


@pytest.mark.parametrize("path, numpys", [
    ("/venv/lib/python3.11/site-packages/numpy.libs/libscipy_openblas64_-32a4b2a6.so", True),
    ("/venv/lib/python3.11/site-packages/numpy/.dylibs/libopenblas.0.dylib", True),
    ("/usr/lib/x86_64-linux-gnu/openblas-pthread/libblas.so.3", True),     # a distro numpy
    ("/opt/conda/lib/libmkl_rt.so.2", True),                              # a conda numpy
    ("/venv/lib/python3.11/site-packages/torch/lib/libgomp-a34b3233.so.1", False),
    ("/usr/lib/python3/dist-packages/torch/lib/libmkl_core.so", False),
])
def test_only_numpys_blas_is_ever_limited(path, numpys):
    from mpishard.health.threads import is_numpys_blas
    assert is_numpys_blas(path, "/venv/lib/python3.11/site-packages/numpy") == numpys


# Defect 5 of issue 31: make_engine changes no process-wide state silently. A fresh interpreter
# bound to one CPU after numpy started its BLAS (so that "auto" has something to limit) builds
# an engine and reports its
# BLAS pools, what was logged, and whether a 16 MiB array still gets a mapping of its own
# (glibc's default; a raised mmap threshold, mallopt, would put it on the heap).
ENGINE_PROBE = """
import ctypes, json, logging, os, sys
import numpy as np          # its BLAS starts a thread per CPU; then this rank gets one CPU
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from mpi4py import MPI
from threadpoolctl import threadpool_info
import mpishard as ms

""" + MALLINFO_PROBE + """logging.getLogger("mpishard").addHandler(handler)
blas = lambda: [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
before = blas()
kwargs = json.loads(sys.argv[1])
engine = ms.make_engine(ms.MLP([4, 8, 2]), "single", comm=MPI.COMM_SELF, **kwargs)
mapped = libc.mallinfo2().hblkhd
big = np.empty(2 << 20)
print(json.dumps({"before": before, "after": blas(), "logs": records,
                  "mapped": libc.mallinfo2().hblkhd - mapped >= big.nbytes}))
"""


def engine_probe(kwargs) -> dict:
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity here")
    out = run_python(["-c", ENGINE_PROBE, json.dumps(kwargs)],
                         env=CLEAN_ENV, capture_output=True, text=True, timeout=120)
    if "mallinfo2" in out.stderr:
        pytest.skip("malloc is not glibc >= 2.33 (no mallinfo2)")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_an_engine_with_defaults_logs_its_thread_change_and_leaves_malloc_alone():
    res = engine_probe({})
    assert res["mapped"], "make_engine changed glibc's mmap threshold (mallopt)"
    if max(res["before"], default=1) < 2:
        pytest.skip(f"the BLAS started {res['before']} thread(s): nothing to limit")
    assert res["after"] == [1] * len(res["before"])          # one CPU: one thread
    assert len(res["logs"]) == 1, res["logs"]
    assert f"{max(res['before'])} -> 1" in res["logs"][0]
    assert "blas_threads=None" in res["logs"][0]             # how to turn it off


def test_an_engine_with_the_opt_out_changes_nothing():
    res = engine_probe({"blas_threads": None})
    assert res["mapped"] and res["after"] == res["before"] and res["logs"] == []


TORCH_PROBE = """
import json, os
import numpy as np
import torch               # brings its own OpenMP runtime (libgomp) and thread pool
from threadpoolctl import threadpool_info
os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
from mpi4py import MPI
import mpishard as ms
pools = lambda: {p["filepath"]: p["num_threads"] for p in threadpool_info()}
before, torch_before = pools(), torch.get_num_threads()
ms.make_engine(ms.MLP([4, 4]), comm=MPI.COMM_SELF)
print(json.dumps({"before": before, "after": pools(), "torch": [torch_before,
                  torch.get_num_threads()], "numpy": np.__file__}))
"""


def test_the_default_never_touches_torchs_threads():
    """The engine splits numpy's BLAS threads only: torch's OpenMP pool (and any BLAS inside
    torch's package) keeps its threads. The old default limited every loaded pool."""
    pytest.importorskip("torch")
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity here")
    out = run_python(["-c", TORCH_PROBE], env=CLEAN_ENV,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["torch"][1] == res["torch"][0], f"torch's threads {res['torch']}"
    numpy_dir = os.path.dirname(res["numpy"])
    for path, threads in res["before"].items():
        if not path.startswith(numpy_dir):             # not numpy's own: left as it was
            assert res["after"][path] == threads, (path, threads, res["after"][path])

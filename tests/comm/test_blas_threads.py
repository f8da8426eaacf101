"""comm/threads.py: ranks sharing a node's cores share out the BLAS threads.

The share rule alone (serial), the user's choice respected (THREAD_VARS, None, an int), a
real pool limited in a fresh interpreter whose BLAS started several threads, and under MPI:
the ranks of a node never run more BLAS threads than their CPUs, and the engine applies it.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

import mpishard as ms
from mpishard.comm.threads import THREAD_VARS, BlasThreads, cpu_set, pin_blas_threads, \
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
from mpishard.comm.threads import pin_blas_threads
before = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
got = pin_blas_threads(MPI.COMM_SELF, json.loads(sys.argv[1]))
after = [p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"]
print(json.dumps({"before": before, "after": after, "threads": got.threads, "why": got.why}))
"""


def probe(request) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(request)], env=CLEAN_ENV,
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

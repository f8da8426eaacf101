"""health/heap.py: glibc heap tuning is an opt-in (make_engine(host_heap="keep")), off by default.

The process-wide effect is read in a fresh interpreter: whether a 16 MiB array gets a mapping
of its own (glibc's default) or comes from the heap (mmap threshold raised), by mallinfo2's
bytes in mmapped blocks. The default engine leaves malloc alone (test_blas_threads.py).
"""
import json
import os

import pytest

import mpishard as ms
from conftest import MALLINFO_PROBE, run_python
from mpishard.health import heap

PROBE = """
import ctypes, json, logging, sys
import numpy as np
from mpi4py import MPI
import mpishard as ms

""" + MALLINFO_PROBE + """log = logging.getLogger("mpishard")
log.addHandler(handler)
log.setLevel(logging.INFO)
engines = [ms.make_engine(ms.MLP([4, 4]), comm=MPI.COMM_SELF, host_heap=json.loads(sys.argv[1]))
           for _ in range(2)]
mapped = libc.mallinfo2().hblkhd
big = np.empty(2 << 20)
print(json.dumps({"kept": engines[0].host_heap.kept, "logs": [r for r in records if "heap" in r],
                  "mapped": libc.mallinfo2().hblkhd - mapped >= big.nbytes}))
"""


def probe(requested) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in heap.HEAP_VARS}
    out = run_python(["-c", PROBE, json.dumps(requested)], env=env,
                         capture_output=True, text=True, timeout=120)
    if "mallinfo2" in out.stderr:
        pytest.skip("malloc is not glibc >= 2.33 (no mallinfo2)")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_keep_puts_arrays_under_32mib_on_the_heap_and_logs_it_once():
    res = probe("keep")
    assert res["kept"] and not res["mapped"]
    assert len(res["logs"]) == 1 and "host_heap='keep'" in res["logs"][0], res["logs"]


def test_the_default_leaves_malloc_alone():
    res = probe(None)
    assert not res["kept"] and res["mapped"] and res["logs"] == []


def test_the_users_environment_wins_and_a_bad_value_raises():
    chosen = heap.keep_host_heap("keep", environ={"MALLOC_TRIM_THRESHOLD_": "131072"})
    assert not chosen.kept and "MALLOC_TRIM_THRESHOLD_=131072" in chosen.why
    with pytest.raises(ValueError, match="host_heap must be 'keep' or None"):
        ms.make_engine(ms.MLP([2, 2]), host_heap="always")

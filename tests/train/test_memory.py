"""Peak memory per phase (train/memory.py) and in the metrics of a run.

    pytest -q tests/train/test_memory.py
    mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_memory.py
"""
import json
import mmap
import os
import tempfile

import numpy as np
import pytest

from mpishard.train import memory
from mpishard.train.memory import PhasePeaks, peaks_text

from conftest import world

MiB = 2**20
linux_marks = pytest.mark.skipif(not os.path.exists(memory.CLEAR_REFS),
                                 reason="no /proc/self/clear_refs to reset the high-water mark")


def touch(mib: int) -> None:
    """Make `mib` MiB of fresh pages resident, then give them back: an anonymous mapping of
    its own, not malloc's (which may hand out heap memory already resident, depending on the
    state earlier tests leave it in: the eval phase's 40 MiB then read as 0)."""
    with mmap.mmap(-1, mib * MiB) as m:
        a = np.frombuffer(m, dtype=np.uint8)
        a[:] = 1
        del a


@linux_marks
def test_each_phase_gets_its_own_peak():
    """200 MiB touched in 'train', 40 MiB in an 'eval' between two train spans: each phase's
    peak above the baseline is its own allocation, not the largest so far."""
    peaks = PhasePeaks()
    peaks.switch("train")
    touch(200)
    with peaks.phase("eval"):
        touch(40)
    touch(10)
    peaks.switch(None)
    got = {k: v / MiB for k, v in peaks.peaks.items()}
    print(got)
    assert 190 <= got["train"] <= 260 and 35 <= got["eval"] <= 90, got
    assert peaks.current is None


def test_without_a_resettable_mark_the_peaks_are_unknown(monkeypatch):
    monkeypatch.setattr(memory, "reset_high_water_mark", lambda: False)
    peaks = PhasePeaks()
    peaks.switch("train")
    peaks.switch(None)
    assert peaks.peaks == {"train": None}
    gathered = {"peak_rss_bytes_max": {"train": None}, "rss_baseline_bytes": [1]}
    assert peaks_text(gathered) == ("peak memory above start-up, largest of 1 rank(s): "
                                    "train unknown")


@pytest.mark.mpi(min_size=1)
def test_the_metrics_hold_every_ranks_peak_per_phase():
    """fit's metrics (and --metrics-json) carry peak_rss_bytes {train, eval: one value per
    rank}, peak_rss_bytes_max (their largest) and rss_baseline_bytes, the same on every rank."""
    from test_trainer import make_trainer

    comm, n = world(), world().Get_size()
    tmp = comm.bcast(tempfile.mkdtemp(prefix="mpishard-test-") if comm.Get_rank() == 0 else None)
    path = os.path.join(tmp, "metrics.json")
    m = make_trainer(f"dp={n}", comm, steps=4, eval_every=2).fit(metrics_path=path)
    everyone = comm.allgather(m["peak_rss_bytes"])
    assert all(e == everyone[0] for e in everyone)
    assert set(m["peak_rss_bytes"]) == {"train", "eval"} and len(m["rss_baseline_bytes"]) == n
    for phase, values in m["peak_rss_bytes"].items():
        assert len(values) == n
        if os.path.exists(memory.CLEAR_REFS):
            assert all(isinstance(v, int) and v >= 0 for v in values)
            assert m["peak_rss_bytes_max"][phase] == max(values)
    comm.Barrier()
    if comm.Get_rank() == 0:
        on_disk = json.load(open(path))
        assert on_disk["peak_rss_bytes"] == m["peak_rss_bytes"]
        assert on_disk["peak_rss_bytes_max"] == m["peak_rss_bytes_max"]
        os.unlink(path)
        os.rmdir(tmp)
    comm.Barrier()

"""The uncaught-exception report (mpishard/comm/uncaught.py): its text, and that make_engine
installs it only when asked (the jobs that raise are in tests/hpc/test_abort.py)."""
import sys

from mpi4py import MPI

import mpishard as ms
from mpishard.comm import uncaught


def test_rank_ranges_fold_runs():
    assert uncaught.rank_ranges([2]) == "rank 2"
    assert uncaught.rank_ranges([3, 0, 1, 2]) == "ranks 0-3"
    assert uncaught.rank_ranges([0, 1, 3]) == "ranks 0-1,3"
    assert uncaught.rank_ranges([0, 2, 4, 5, 6]) == "ranks 0,2,4-6"


def test_report_prints_each_cause_once_with_its_ranks():
    tb = "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
    failures = [(3, "ValueError", "bad", tb + "ValueError: bad\n"),
                (2, "RuntimeError", "other", tb + "RuntimeError: other\n"),
                (0, "ValueError", "bad", tb + "ValueError: bad\n")]
    text = uncaught.format_report(failures)
    print(text)
    assert text.count("Traceback") == 2
    assert text.splitlines()[-2:] == ["mpishard: error: ValueError: bad (ranks 0,3)",
                                      "mpishard: error: RuntimeError: other (rank 2)"]
    assert "ValueError on ranks 0,3; the traceback of rank 0:" in text


def test_make_engine_installs_the_report_unless_told_not_to():
    was = uncaught.installed()
    uncaught.uninstall()
    before = sys.excepthook
    try:
        ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF, report_errors=False)
        assert sys.excepthook is before and not uncaught.installed()
        ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
        assert sys.excepthook is uncaught.report
        uncaught.uninstall()
        assert sys.excepthook is before
    finally:
        uncaught.uninstall()
        if was:
            uncaught.install()


def test_after_finalize_python_s_hook_reports(monkeypatch, capsys):
    """Once MPI is finalized the report cannot ask the other ranks: the previous hook prints."""
    calls = []
    monkeypatch.setattr(uncaught, "_previous", lambda *exc: calls.append(exc))
    monkeypatch.setattr(uncaught.MPI, "Is_finalized", lambda: True)
    error = ValueError("late")
    uncaught.report(ValueError, error, None)
    assert calls == [(ValueError, error, None)] and capsys.readouterr().err == ""

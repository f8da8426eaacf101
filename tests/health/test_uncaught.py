"""The uncaught-exception report (mpishard/health/uncaught.py): its text, and that make_engine
installs it only when asked (the jobs that raise are in tests/hpc/test_abort.py)."""
import sys

import pytest

from mpi4py import MPI

import mpishard as ms
from mpishard.health import uncaught


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


def test_closing_the_engines_puts_the_previous_hook_back():
    """An error raised after the engines are closed is the program's own, reported by the hook
    that was there before: the last engine's close puts it back, an earlier one's does not."""
    was = uncaught.installed()
    uncaught.uninstall()

    def mine(*exc):
        pass

    before, sys.excepthook = sys.excepthook, mine
    try:
        first = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
        second = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
        plain = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF, report_errors=False)
        plain.close()
        first.close()
        assert sys.excepthook is uncaught.report
        second.close()
        assert sys.excepthook is mine and not uncaught.installed()
        second.close()                       # twice: nothing more to give back
        assert sys.excepthook is mine
    finally:
        uncaught.uninstall()
        sys.excepthook = before
        if was:
            uncaught.install()


def test_a_make_engine_that_raises_keeps_the_report_for_that_error_only():
    """The engine's constructor refuses the layout after the report was installed: no engine
    holds it. If that error goes uncaught the report handles it (one report, the job's files
    removed: tests/integration/test_examples.py's tp=3 example); any other error goes to the
    hook that was there, and a later engine's close puts that hook back (the count is not left
    one too high)."""
    was = uncaught.installed()
    uncaught.uninstall()
    calls = []

    def mine(*exc):
        calls.append(exc)

    before, sys.excepthook = sys.excepthook, mine
    try:
        with pytest.raises(ValueError, match=r"layout 'tp=3' needs tp=3 = 3 ranks, but the "
                                             r"world size is 1") as refused:
            ms.make_engine(ms.MLP([2, 2]), "tp=3", comm=MPI.COMM_SELF)
        assert uncaught._caused_by(refused.value, uncaught._pending)
        other = KeyError("unrelated")
        sys.excepthook(KeyError, other, None)                 # a later, unrelated error
        assert calls == [(KeyError, other, None)]
        engine = ms.make_engine(ms.MLP([2, 2]), comm=MPI.COMM_SELF)
        assert sys.excepthook is uncaught.report and uncaught._pending is None
        engine.close()
        assert sys.excepthook is mine and not uncaught.installed()
    finally:
        uncaught.uninstall()
        sys.excepthook = before
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

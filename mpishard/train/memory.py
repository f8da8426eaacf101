"""Peak resident memory of each phase of a run (training, evaluation, ...) above a baseline.

    peaks = PhasePeaks()              # the baseline: this process's resident set now
    peaks.switch("train")             # ... steps ...
    with peaks.phase("eval"):         # an evaluation between steps: its own phase
        ...
    peaks.switch(None)                # peaks.peaks == {"train": bytes, "eval": bytes}

Linux keeps a process's high-water mark of resident memory (VmHWM in /proc/self/status) and
resets it to the current resident set when "5" is written to /proc/self/clear_refs. Each switch
reads the mark into the phase that ends (the largest over the times it ran, less the baseline,
at least 0) and resets it for the next. Where the mark cannot be reset (not Linux, a kernel or
a sandbox without clear_refs) a phase's peak cannot be told from an earlier one: peaks are None
there. `gather_peaks` brings every rank's to every rank (a few numbers per rank, bounded waits).
"""
from __future__ import annotations

from contextlib import contextmanager

from ..comm.objects import gather_json, scatter_json

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


def status_bytes(field: str, path=STATUS):
    """A `kB` field of /proc/self/status (VmRSS, VmHWM) in bytes, or None where unreadable."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, IndexError, ValueError):
        pass
    return None


def reset_high_water_mark(path=CLEAR_REFS) -> bool:
    """Reset VmHWM to the current resident set; False where that is not possible."""
    try:
        with open(path, "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PhasePeaks:
    """Each phase's peak resident bytes above the resident set at construction (module
    docstring); `peaks[name]` is None where the mark cannot be reset."""

    def __init__(self):
        self.baseline = status_bytes("VmRSS")
        self.peaks: dict = {}
        self.current = None
        self.works = self.baseline is not None and reset_high_water_mark()

    def switch(self, name) -> None:
        """End the current phase (its peak read), start `name` (None: no phase)."""
        if self.current is not None:
            mark = status_bytes("VmHWM") if self.works else None
            peak = None if mark is None else max(0, mark - self.baseline)
            old = self.peaks.get(self.current)
            self.peaks[self.current] = peak if old is None or peak is None else max(old, peak)
        self.current = name
        if name is not None and self.works:
            self.works = reset_high_water_mark()

    @contextmanager
    def phase(self, name: str):
        """`name` for the block, then back to the phase it interrupted."""
        outer = self.current
        self.switch(name)
        try:
            yield
        finally:
            self.switch(outer)


def gather_peaks(comm, peaks: PhasePeaks) -> dict:
    """Collective over the engine Comm `comm`: {"peak_rss_bytes": {phase: [bytes or None per
    rank]}, "peak_rss_bytes_max": {phase: the largest}, "rss_baseline_bytes": [per rank]}, the
    same on every rank."""
    mine = {"baseline": peaks.baseline, "peaks": peaks.peaks}
    everyone = gather_json(comm, mine, "peak memory")
    everyone = scatter_json(comm, None if everyone is None else [everyone] * len(everyone),
                            "peak memory")
    names = sorted({name for r in everyone for name in r["peaks"]})
    per_rank = {n: [r["peaks"].get(n) for r in everyone] for n in names}
    return {"peak_rss_bytes": per_rank,
            "peak_rss_bytes_max": {n: max((v for v in vs if v is not None), default=None)
                                   for n, vs in per_rank.items()},
            "rss_baseline_bytes": [r["baseline"] for r in everyone]}


def peaks_text(gathered: dict) -> str:
    """One line: each phase's largest peak over the ranks, in MiB."""
    parts = [f"{n} {'unknown' if v is None else f'{v / 2**20:.1f} MiB'}"
             for n, v in gathered["peak_rss_bytes_max"].items()]
    ranks = len(gathered["rss_baseline_bytes"])
    return (f"peak memory above start-up, largest of {ranks} rank(s): "
            f"{', '.join(parts) or 'no phase ran'}")


__all__ = ["PhasePeaks", "gather_peaks", "peaks_text", "reset_high_water_mark", "status_bytes"]

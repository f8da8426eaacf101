"""The trainer's in-memory histories, bounded: a recent window plus running counts.

A run's full curve lives on disk (`--metrics-jsonl`, metrics.py); what stays in memory must not
grow with the steps (a 40,000-step soak, `make soak`, holds its resident memory within 2%).
Each history is a `History`: the last `HISTORY_WINDOW` values (a deque, oldest dropped first)
and `total`, how many values were ever appended. A run of at most HISTORY_WINDOW steps keeps
every value, so its `loss_history` etc. in the end-of-run metrics are exact and complete; a
longer run's hold its last HISTORY_WINDOW steps, and `history_first_step` (metrics) names the
step of the window's first loss (step numbers count from 1).

`TrainState` is what a resume needs besides parameters and optimizer state: the step (the data
position is DistributedBatcher.position(step)), samples seen, and the histories; `to_dict`
gives plain lists and ints (JSON, a checkpoint's `extra`), and `from_dict` reads them back,
including a checkpoint written before the window (plain lists: `total` is their length).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, fields

HISTORY_WINDOW = 1024
HISTORIES = ("loss_history", "grad_norm_history", "lr_history", "eval_history")


class History(deque):
    """The last `maxlen` values appended, and `total`: how many were appended in all."""

    def __init__(self, values=(), maxlen: int = HISTORY_WINDOW, total: int | None = None):
        values = list(values)
        super().__init__(values, maxlen)
        self.total = len(values) if total is None else int(total)

    def append(self, value) -> None:
        super().append(value)
        self.total += 1

    def __getitem__(self, i):              # a slice (a list's) as well as an index
        if isinstance(i, slice):
            return list(self)[i]
        return super().__getitem__(i)

    def __eq__(self, other):
        return list(self) == list(other) if isinstance(other, (list, deque)) else NotImplemented

    def __reduce__(self):
        return (type(self), (list(self), self.maxlen, self.total))


@dataclass
class TrainState:
    """Step, samples seen, and the bounded histories (History) of loss, grad norm, lr and
    evaluations."""

    step: int = 0
    samples: int = 0
    loss_history: History = field(default_factory=History)
    grad_norm_history: History = field(default_factory=History)
    lr_history: History = field(default_factory=History)
    eval_history: History = field(default_factory=History)
    history_totals: dict = field(default_factory=dict)

    def __post_init__(self):
        totals = self.history_totals or {}
        for name in HISTORIES:
            values = getattr(self, name)
            if not isinstance(values, History):
                setattr(self, name, History(values, total=totals.get(name)))
        self.history_totals = {}              # read from the histories themselves (to_dict)

    def to_dict(self) -> dict:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in HISTORIES:
            d[name] = [dict(v) if isinstance(v, dict) else v for v in d[name]]
        d["history_totals"] = {name: getattr(self, name).total for name in HISTORIES}
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "TrainState":
        return cls(**{k: d[k] for k in cls.__dataclass_fields__ if k in d})

    def first_step(self) -> int:
        """The step of the loss window's first value (1 when nothing was dropped)."""
        h = self.loss_history
        return self.step - len(h) + 1 if h else self.step + 1


__all__ = ["HISTORIES", "HISTORY_WINDOW", "History", "TrainState"]

"""The one number check behind every user-facing option (optimizer settings, data-set sizes,
trainer counts, schedule sizes, CLI flags).

Errors name the option and the value, so every rank raises the same message before any
communication. No MPI here: this is the bottom of the package.
"""
from __future__ import annotations

import math
from numbers import Integral, Real


def check_number(name, value, *, low=None, high=None, low_open=False, integer=False,
                 error=ValueError):
    """`value` as a float (or int with integer=True), or `error` / TypeError naming `name`.

    low, high: bounds; `low` is included unless low_open=True, `high` is excluded. A bool is
    never a number here. TypeError for a non-number (or a non-integer when integer=True).
    """
    if isinstance(value, bool) or not isinstance(value, Integral if integer else Real):
        raise TypeError(f"{name} must be {'an integer' if integer else 'a number'}, "
                        f"got {value!r}")
    if integer:
        value = int(value)
    elif not math.isfinite(value):
        raise error(f"{name} must be a finite number, got {float(value):g}")
    if (low is not None and (value < low or (low_open and value == low))) or \
            (high is not None and value >= high):
        raise error(f"{name} must be {_bounds(low, high, low_open, integer)}, got {value!r}"
                    if integer else
                    f"{name} must be {_bounds(low, high, low_open, integer)}, "
                    f"got {float(value):g}")
    return value if integer else float(value)


def _bounds(low, high, low_open, integer) -> str:
    if integer and low == 1 and high is None and not low_open:
        return "a positive integer"
    text = "an integer " if integer else ""
    if low is not None:
        text += f"{'>' if low_open else '>='} {low:g}"
    if high is not None:
        text += (" and " if low is not None else "") + f"< {high:g}"
    return text

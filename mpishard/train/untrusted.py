"""Checks of what a file we read says about other files: the names it gives and the sizes.

A checkpoint's index.json names its chunk files, a token directory's tokens.json its .bin
files, a Hugging Face model.safetensors.index.json its shards. Those files are input like any
other: a name in them is accepted only as a plain file name inside their own directory, so
`../elsewhere/secret.npy`, an absolute path or a name with a separator is never read as a
weight or as training tokens. Every reader joins such a name to its directory through
`file_in`, and reads the numbers that size an allocation (`whole_number(s)`) and the dtypes
(`numeric_dtype`) through these checks before any allocation.

The rule is about the name, checked as text: what the directory itself holds is its owner's.
A symlink placed in the directory is read wherever it leads, for every reader alike: that is
how a Hugging Face hub cache stores a model (each file of `snapshots/<rev>/` a link to
`../../blobs/<sha256>`), and whoever can place a link there can place the file itself.

It lives in train/, the lowest layer of the three readers (train < checkpoint < hf).
"""
from __future__ import annotations

import os

import numpy as np


def file_in(directory, name, what: str, error=ValueError) -> str:
    """The path of plain file name `name` inside `directory`, or `error` naming `what` (the
    field the name came from, e.g. "index.json: chunk 'w' file") and the directory.

    Refused: a non-string, an empty name, '.', '..', a name with a path separator or a NUL
    (an absolute path has one). The check is lexical: the joined path's parent is the
    directory, and a symlink of that name in the directory is followed wherever it leads (the
    module's docstring says why). The file need not exist: whether it must is the reader's rule.
    """
    directory = os.fspath(directory)
    reason = _why_not_plain(name)
    if reason is None:
        path = os.path.join(directory, name)
        if os.path.normpath(os.path.dirname(path)) != os.path.normpath(directory):
            reason = "it is not directly inside the directory"
    if reason is not None:
        raise error(f"{what} {name!r} is not a plain file name inside {directory} ({reason})")
    return path


def _why_not_plain(name):
    if not isinstance(name, str):
        return f"{type(name).__name__}, not a string"
    if name in ("", ".", ".."):
        return "empty" if not name else "a directory"
    if "\0" in name:
        return "it has a NUL"
    seps = {"/", os.sep} | ({os.altsep} if os.altsep else set())
    if any(s in name for s in seps) or os.path.isabs(name):
        return "it has a path separator"
    return None


def whole_numbers(values, what: str, error=ValueError, low: int = 0) -> tuple:
    """`values` (a list of JSON numbers) as a tuple of ints >= low, or `error` naming `what`:
    2.0, true or "2" is not one (each would index or size differently)."""
    if not isinstance(values, list) or any(type(v) is not int or v < low for v in values):
        raise error(f"{what} must be a list of integers >= {low}, got {values!r}")
    return tuple(values)


def whole_number(value, what: str, error=ValueError, low: int = 0) -> int:
    """`value` as an int >= low (not a bool, a float or a string), or `error` naming `what`."""
    if type(value) is not int or value < low:
        raise error(f"{what} must be an integer >= {low}, got {value!r}")
    return value


def numeric_dtype(value, what: str, error=ValueError) -> np.dtype:
    """np.dtype(value) when it is a number type (bool, int, unsigned, float, complex), else
    `error` naming `what`: no object, string, void or structured dtype from a header."""
    try:
        dtype = np.dtype(value)
    except (TypeError, ValueError, SyntaxError):
        raise error(f"{what} {value!r} is not a dtype") from None
    if dtype.kind not in "biufc" or dtype.fields is not None:
        raise error(f"{what} {value!r} is not a number type")
    return dtype


__all__ = ["file_in", "numeric_dtype", "whole_number", "whole_numbers"]

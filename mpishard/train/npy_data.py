"""`--dataset npy:DIR`: a data set of .npy files, memory-mapped, read a batch at a time.

    DIR/x.npy        (N, d_in)  inputs, any real dtype (the engine casts each batch)
    DIR/y.npy        (N,) integer class labels (CrossEntropy), or (N,) / (N, d_out) floats (MSE)
    DIR/x_test.npy, DIR/y_test.npy   optional, both or neither; without them the last 10% of
                     the rows (at least one) are the test split (a slice of the map, no copy)

Every file is opened with `np.load(mmap_mode="r")` (only its header is read) and wrapped in
`MappedRows`: each rank's DistributedBatcher copies out just the rows of its batches (`x[idx]`)
with one pread per row into a fresh array, so nothing of the file is mapped and only the
copies are resident (a long-lived map keeps every page it read resident, and a read fault also
maps the cached pages around it, so a rank's resident memory would grow to the file's size
within an epoch). Fortran-order files and strided slices go through a short-lived map. No
rank ever holds the whole file. Labels are range-checked in chunks of CHUNK_ROWS; the test
targets (one value or label per row) are read whole, the test inputs a chunk at a time by the
evaluation.
"""
from __future__ import annotations

import os

import numpy as np

from .data import Dataset

NPY_PREFIX = "npy:"
CHUNK_ROWS = 1 << 16
HOLDOUT_FRACTION = 0.1


def is_npy_name(name) -> bool:
    return isinstance(name, str) and name.startswith(NPY_PREFIX)


def npy_directory(name: str) -> str:
    """DIR of 'npy:DIR' (ValueError when empty or not a directory)."""
    directory = name[len(NPY_PREFIX):]
    if not directory:
        raise ValueError(f"--dataset {name!r}: give a directory, npy:DIR")
    if not os.path.isdir(directory):
        raise ValueError(f"--dataset {name}: {directory} is not a directory")
    return directory


class MappedRows:
    """Rows start..stop of a .npy file, read on demand: `rows[idx]` reads the rows asked for
    into a new ndarray; a slice of rows is another MappedRows."""

    def __init__(self, path, dtype, offset, file_shape, order, start=0, stop=None,
                 columns=False):
        self.path, self.dtype, self.offset = path, dtype, offset
        self.file_shape, self.order = tuple(file_shape), order
        self.start = start
        self.stop = self.file_shape[0] if stop is None else stop
        self.columns = columns           # a 1-D file seen as (rows, 1)

    @classmethod
    def open(cls, path, header: np.memmap) -> "MappedRows":
        """From the np.load(mmap_mode='r') map of `path` (its header: dtype, offset, order)."""
        order = "F" if header.ndim > 1 and not header.flags.c_contiguous else "C"
        return cls(path, header.dtype, header.offset, header.shape, order)

    @property
    def shape(self) -> tuple:
        rest = (1,) if self.columns else self.file_shape[1:]
        return (self.stop - self.start, *rest)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.stop - self.start

    def _like(self, start, stop, columns):
        return MappedRows(self.path, self.dtype, self.offset, self.file_shape, self.order,
                          start, stop, columns)

    def as_columns(self) -> "MappedRows":
        """A 1-D file as (rows, 1); 2-D files are returned unchanged."""
        return self if len(self.file_shape) > 1 else self._like(self.start, self.stop, True)

    def __getitem__(self, key):
        if isinstance(key, slice) and key.step in (None, 1):
            lo, hi, _ = key.indices(len(self))
            return self._like(self.start + lo, self.start + max(lo, hi), self.columns)
        if self.order == "C" and not isinstance(key, (slice, tuple)):
            out = self._read(np.asarray(key))
        else:                           # Fortran order, strided slices: a short-lived map
            mapped = np.memmap(self.path, self.dtype, "r", self.offset, self.file_shape,
                               self.order)
            out = np.array(mapped[self.start:self.stop][key])
            del mapped                                        # unmapped here
        return out.reshape(*out.shape, 1) if self.columns else out

    def _read(self, idx):
        """Rows `idx` (an int or an integer array, negatives from the end) read with pread:
        nothing of the file is mapped, so only the copy is resident."""
        n = len(self)
        if idx.dtype.kind not in "iu" or ((idx < -n) | (idx >= n)).any():
            raise IndexError(f"row index out of range for {n} rows, or not an integer")
        rows = np.where(idx < 0, idx + n, idx) + self.start
        row_shape = self.file_shape[1:]
        width = self.dtype.itemsize * int(np.prod(row_shape, dtype=np.int64))
        out = np.empty((rows.size, *row_shape), self.dtype)
        raw = out.reshape(rows.size, -1).view(np.uint8)
        with open(self.path, "rb", buffering=0) as f:
            for j, r in enumerate(rows.ravel().tolist()):
                if os.preadv(f.fileno(), [raw[j]], self.offset + r * width) != width:
                    raise ValueError(f"{self.path}: short read at row {r} (file truncated?)")
        return out.reshape(*rows.shape, *row_shape)

    def __array__(self, dtype=None, copy=None):
        out = self[np.arange(len(self))]
        return out if dtype is None else out.astype(dtype)


def _open(directory: str, file: str):
    path = os.path.join(directory, file)
    try:
        header = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        raise ValueError(f"dataset npy:{directory}: {file} not found") from None
    except (ValueError, OSError, EOFError) as exc:
        raise ValueError(f"dataset npy:{directory}: {file} is not a readable .npy array "
                         f"({exc})") from None
    if not isinstance(header, np.memmap) or header.ndim == 0:
        raise ValueError(f"dataset npy:{directory}: {file} must be an array of rows, got "
                         f"{type(header).__name__} of shape {np.shape(header)}")
    return MappedRows.open(path, header)


def _check_pair(directory, x, y, xname, yname):
    """Shapes and dtypes of one (inputs, targets) pair (ValueError naming the file)."""
    where = f"dataset npy:{directory}"
    if x.ndim != 2 or x.shape[0] < 1 or x.shape[1] < 1:
        raise ValueError(f"{where}: {xname} must be 2-D (rows, features) with at least one "
                         f"of each, got shape {x.shape}")
    if x.dtype.kind not in "fiu":
        raise ValueError(f"{where}: {xname} must hold real numbers, got dtype {x.dtype}")
    if y.ndim not in (1, 2) or y.shape[0] != x.shape[0]:
        raise ValueError(f"{where}: {yname} must have one row per row of {xname} "
                         f"({x.shape[0]}), got shape {y.shape}")
    if y.dtype.kind not in "fiu":
        raise ValueError(f"{where}: {yname} must hold numbers, got dtype {y.dtype}")
    if y.dtype.kind in "iu" and y.ndim != 1:
        raise ValueError(f"{where}: integer {yname} must be 1-D class labels, got shape "
                         f"{y.shape}")


def _check_labels(directory, y, yname, n_classes):
    for start in range(0, len(y), CHUNK_ROWS):
        chunk = np.asarray(y[start:start + CHUNK_ROWS])
        low, high = int(chunk.min()), int(chunk.max())
        if low < 0 or high >= n_classes:
            raise ValueError(f"dataset npy:{directory}: {yname} holds label "
                             f"{low if low < 0 else high}, outside [0, {n_classes}) for a "
                             f"model with {n_classes} outputs")


def npy_task(name: str) -> str:
    """'classification' (integer labels) or 'regression' (float targets); reads headers only."""
    directory = npy_directory(name)
    y = _open(directory, "y.npy")
    return "classification" if y.dtype.kind in "iu" else "regression"


def load_npy_dataset(name: str, d_in: int, d_out: int) -> Dataset:
    """The memory-mapped Dataset of 'npy:DIR' for a model d_in -> d_out (ValueError with the
    file and the numbers on any mismatch; the same on every rank, before any communication)."""
    directory = npy_directory(name)
    x, y = _open(directory, "x.npy"), _open(directory, "y.npy")
    _check_pair(directory, x, y, "x.npy", "y.npy")
    has_test = [os.path.exists(os.path.join(directory, f)) for f in ("x_test.npy", "y_test.npy")]
    if has_test[0] != has_test[1]:
        raise ValueError(f"dataset npy:{directory}: give both x_test.npy and y_test.npy, or "
                         f"neither")
    if has_test[0]:
        x_test, y_test = _open(directory, "x_test.npy"), _open(directory, "y_test.npy")
        _check_pair(directory, x_test, y_test, "x_test.npy", "y_test.npy")
    else:
        if len(x) < 2:
            raise ValueError(f"dataset npy:{directory}: x.npy has {len(x)} row; need 2 to "
                             f"hold out a test split (or give x_test.npy, y_test.npy)")
        cut = len(x) - max(1, int(len(x) * HOLDOUT_FRACTION))
        x, x_test, y, y_test = x[:cut], x[cut:], y[:cut], y[cut:]
    pairs = (("x.npy", "y.npy", x, y), ("x_test.npy", "y_test.npy", x_test, y_test))
    task = "classification" if y.dtype.kind in "iu" else "regression"
    for xname, yname, xs, ys in pairs:
        if xs.shape[1] != d_in:
            raise ValueError(f"dataset npy:{directory}: {xname} has {xs.shape[1]} features "
                             f"but the model's input dim is {d_in}")
        if (ys.dtype.kind in "iu") != (task == "classification"):
            raise ValueError(f"dataset npy:{directory}: y.npy and y_test.npy must both be "
                             f"integer labels or both floats")
        if task == "classification":
            _check_labels(directory, ys, yname, d_out)
        elif (1 if ys.ndim == 1 else ys.shape[1]) != d_out:
            raise ValueError(f"dataset npy:{directory}: {yname} has shape {ys.shape} but the "
                             f"model has {d_out} output(s)")
    if task == "regression":
        y, y_test = y.as_columns(), y_test.as_columns()
    return Dataset(name, x, y, x_test, np.asarray(y_test), task,
                   d_out if task == "classification" else 0)


__all__ = ["MappedRows", "NPY_PREFIX", "is_npy_name", "load_npy_dataset", "npy_task"]

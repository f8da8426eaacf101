"""Debug mode's signature check: the group compares what each rank is about to call.

The engine in debug mode gives `check_signature` to its Comm, which calls it at the start of
each collective (comm/collectives.py), before any check that depends on this rank's array
(dtype, axis range, divisibility), so such a mistake on one rank is reported on every rank, not
raised on that rank alone while the others wait in the collective.
"""
from __future__ import annotations

import os

import numpy as np
from mpi4py import MPI

from ..comm.collectives import OPS
from ..comm.p2p import DTYPES

KINDS = ["all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier",
         "all_to_all_v"]
_DIMS = 10


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group called a collective with different op, dtype or shape."""


def signature(kind, a, op="", axis=0, skip_axis=False) -> np.ndarray:
    """(kind, op, dtype, axis, shape...) as int64 words; `a=None`: no array (broadcast)."""
    shape = list(a.shape) if a is not None else []
    if -len(shape) <= axis < len(shape):
        axis %= len(shape)
    if skip_axis and 0 <= axis < len(shape):
        shape[axis] = -1  # all_gather may concatenate uneven lengths along `axis`
    sig = np.full(4 + _DIMS, -2, dtype=np.int64)
    sig[0] = KINDS.index(kind)
    sig[1] = list(OPS).index(op) if op in OPS else -1
    if a is not None:   # unsupported dtypes as -1 - ord(char): named, raised after the check
        sig[2] = DTYPES.index(a.dtype) if a.dtype in DTYPES else -1 - ord(a.dtype.char)
    sig[3] = axis
    sig[4:4 + min(_DIMS, len(shape))] = shape[:_DIMS]
    sig[4 + len(shape):] = -3
    return sig


def describe(sig) -> str:
    """One rank's signature in words."""
    dims = [int(d) for d in sig[4:] if d != -3]
    dtype = (DTYPES[sig[2]] if sig[2] >= 0 else "-" if sig[2] == -2
             else f"unsupported {np.dtype(chr(-1 - sig[2]))}")
    kind = KINDS[sig[0]]
    return (f"{kind}(op={list(OPS)[sig[1]] if sig[1] >= 0 else '-'}, dtype={dtype}, "
            f"shape={tuple(dims)}, {'root' if kind == 'broadcast' else 'axis'}={sig[3]})")


def signature_check(debug):
    """What a Comm checks before each collective: `check_signature` in debug mode (`debug`
    true; None: the environment's MPISHARD_DEBUG is set and not 0), else None (no check)."""
    if debug is None:
        debug = os.environ.get("MPISHARD_DEBUG", "0") not in ("", "0")
    return check_signature if debug else None


def check_signature(comm, kind, a, op="", axis=0, skip_axis=False, wait=None) -> None:
    """Collective over the mpi4py `comm`: every rank compares (kind, op, dtype, shape, axis)
    and raises CollectiveMismatchError on every rank if they differ. `wait`: how to wait for
    the Iallgather (the watchdog's bounded wait; default MPI Wait)."""
    sig = signature(kind, a, op, axis, skip_axis)
    allsig = np.empty((comm.Get_size(), sig.size), dtype=np.int64)
    (wait or MPI.Request.Wait)(comm.Iallgather(sig, allsig))
    if (allsig != allsig[0]).any():
        ranks = "; ".join(f"group rank {r}: {describe(s)}" for r, s in enumerate(allsig))
        raise CollectiveMismatchError(f"collective mismatch in {kind}: {ranks}")

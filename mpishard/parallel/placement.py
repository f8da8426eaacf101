"""How one parameter is laid out on the mesh (in the spirit of DTensor's Shard/Replicate).

A `Placement` is an ordered tuple of `Shard(axis, dim, pad)` steps, applied one after the other
to the full array: "split dimension `dim` into mesh.size(axis) blocks and keep block
coords[axis]". Every axis not named is replicated. `stage` is the pipeline stage (pp
coordinate) that owns the parameter.

    Megatron column W0 under dp=2,tp=2:   (Shard('tp', 1),)            replicated on dp
    Megatron row W1:                      (Shard('tp', 0),)
    FSDP W under fsdp=4:                  (Shard('fsdp', 0, pad=True),)
    row W under fsdp=2,tp=2:              (Shard('tp', 0), Shard('fsdp', 0, pad=True))

A padded step rounds the length up to a multiple of the axis size with zeros, so no size is
refused; padding never leaves this module (`gather_array` trims it).

One mechanism serves `load_checkpoint` (shard_array), `gather_params` / `gather_grads`
(gather_array), checkpoint save and reshard-on-load (`local_slices`), gradient averaging (which
data axes are replicated), norm clipping (which axes are sharded) and memory reports
(local_shape).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Shard:
    axis: str
    dim: int
    pad: bool = False


@dataclass(frozen=True)
class Placement:
    shards: tuple = ()
    stage: int = 0                    # pp coordinate holding this parameter
    # {axis: coord}: only ranks at these mesh coordinates hold the parameter (a MoE expert
    # lives on one ep rank). Such an axis counts as sharded, not replicated; gather_params
    # broadcasts from the owner.
    owner: dict = field(default_factory=dict, hash=False)

    def sharded_axes(self) -> tuple:
        return tuple(s.axis for s in self.shards) + tuple(self.owner)

    def is_replicated_on(self, axis: str) -> bool:
        return axis not in self.sharded_axes()

    def held_at(self, coords: dict) -> bool:
        """Whether the rank at mesh coordinates `coords` holds a block of this parameter."""
        return all(coords.get(a, 0) == c for a, c in self.owner.items())

    def __str__(self) -> str:
        parts = [f"Shard({s.axis}, dim={s.dim}{', pad' if s.pad else ''})" for s in self.shards]
        parts += [f"Owner({a}={c})" for a, c in self.owner.items()]
        return "[" + ", ".join(parts or ["Replicate"]) + f"] stage {self.stage}"


def _step(length: int, n: int, pad: bool, what: str = "") -> int:
    """Block length for splitting `length` into n blocks."""
    if pad:
        return -(-length // n)
    if length % n:
        raise ValueError(f"{what}length {length} is not divisible by {n}")
    return length // n


def local_shape(full_shape, placement: Placement, sizes: dict) -> tuple:
    shape = list(full_shape)
    for s in placement.shards:
        shape[s.dim] = _step(shape[s.dim], sizes.get(s.axis, 1), s.pad)
    return tuple(shape)


def local_slices(full_shape, placement: Placement, sizes: dict, coords: dict):
    """The region of the full array this rank holds: list of (start, stop) per dim, and the
    number of padding rows (per dim) at the end of the local block."""
    start = [0] * len(full_shape)
    stop = list(full_shape)
    block = list(full_shape)
    for s in placement.shards:
        n = sizes.get(s.axis, 1)
        b = _step(block[s.dim], n, s.pad)
        lo = start[s.dim] + coords.get(s.axis, 0) * b
        start[s.dim] = min(lo, stop[s.dim])
        stop[s.dim] = min(lo + b, stop[s.dim])
        block[s.dim] = b
    return list(zip(start, stop)), block


def shard_array(full, placement: Placement, sizes: dict, coords: dict, xp=np, dtype=None):
    """This rank's block of `full` (a numpy array or a lazily loaded array), as an xp array,
    zero-padded where a padded step runs past the end."""
    ranges, block = local_slices(np.shape(full), placement, sizes, coords)
    piece = np.asarray(full[tuple(slice(a, b) for a, b in ranges)])
    out = xp.zeros(tuple(block), dtype=dtype or piece.dtype)
    out[tuple(slice(0, b - a) for a, b in ranges)] = xp.asarray(piece, dtype=out.dtype)
    return out


def gather_array(comm, local, placement: Placement, full_shape):
    """Collective over the placement's axes (`comm`: a Comm of the mesh): the full array on
    every rank of them."""
    # lengths along each sharded dim before each step, to trim padding on the way back
    lengths = []
    shape = list(full_shape)
    for s in placement.shards:
        lengths.append(shape[s.dim])
        shape[s.dim] = _step(shape[s.dim], comm.mesh.size(s.axis), s.pad)
    a = local
    for s, length in zip(reversed(placement.shards), reversed(lengths)):
        if comm.mesh.size(s.axis) > 1:
            a = comm.all_gather(a, axis=s.dim, group=s.axis)
        if a.shape[s.dim] != length:
            a = a[(slice(None),) * s.dim + (slice(0, length),)]
    return a


@dataclass
class ParamInfo:
    """A parameter's full shape and its placement."""

    name: str
    full_shape: tuple
    placement: Placement = field(default_factory=Placement)

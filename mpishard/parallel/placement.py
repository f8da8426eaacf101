"""How one parameter is laid out on the mesh (in the spirit of DTensor's Shard/Replicate).

A `Placement` is an ordered tuple of `Shard(axis, dim, pad)` steps, applied one after the other
to the full array: "split dimension `dim` into mesh.size(axis) blocks and keep block
coords[axis]". Every axis not named is replicated. `stage` is the pipeline stage (pp
coordinate) that owns the parameter; `tied_stages` names other stages holding a copy of the
same blocks (a tied embedding under pp: parallel/tied.py keeps the copies equal).

    Megatron column W0 under dp=2,tp=2:   (Shard('tp', 1),)            replicated on dp
    Megatron row W1:                      (Shard('tp', 0),)
    FSDP W under fsdp=4:                  (Shard('fsdp', 0, pad=True),)
    row W under fsdp=2,tp=2:              (Shard('tp', 0), Shard('fsdp', 0, pad=True))

A padded step rounds the length up to a multiple of the axis size with zeros, so no size is
refused; padding never leaves this module (`gather_array` trims it).

A blocked step `Shard(axis, dim, blocks=k)` views the dimension as k equal blocks, splits each
over the axis and keeps the concatenation of this rank's slice of every block: a GPT's qkv
(D, 3D) under tp=t is Shard('tp', 1, blocks=3), so rank r holds the q, k and v columns of its
heads, [q_r | k_r | v_r], three column ranges of the full array (`local_pieces`).

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
    blocks: int = 1                  # >1: split each of `blocks` equal blocks of the dim

    def __post_init__(self):
        if self.blocks < 1 or (self.blocks > 1 and self.pad):
            raise ValueError(f"Shard({self.axis}, {self.dim}): blocks={self.blocks} must be "
                             f">= 1 and a blocked split cannot be padded")


@dataclass(frozen=True)
class Placement:
    shards: tuple = ()
    stage: int = 0                    # pp coordinate holding this parameter
    # {axis: coord}: only ranks at these mesh coordinates hold the parameter (a MoE expert
    # lives on one ep rank). Such an axis counts as sharded, not replicated; gather_params
    # broadcasts from the owner.
    owner: dict = field(default_factory=dict, hash=False)
    # other pp stages holding a copy of the same blocks (a tied embedding: on the first stage
    # for the embedding, on the last for the head; parallel/tied.py sums their gradients)
    tied_stages: tuple = ()

    @property
    def stages(self) -> tuple:
        """The pp stages holding this parameter: `stage`, then any tied copies."""
        return (self.stage,) + self.tied_stages

    def sharded_axes(self) -> tuple:
        return tuple(s.axis for s in self.shards) + tuple(self.owner)

    def is_replicated_on(self, axis: str) -> bool:
        return axis not in self.sharded_axes()

    def held_at(self, coords: dict) -> bool:
        """Whether the rank at mesh coordinates `coords` holds a block of this parameter."""
        return all(coords.get(a, 0) == c for a, c in self.owner.items())

    def __str__(self) -> str:
        parts = [f"Shard({s.axis}, dim={s.dim}{', pad' if s.pad else ''}"
                 f"{f', blocks={s.blocks}' if s.blocks > 1 else ''})" for s in self.shards]
        parts += [f"Owner({a}={c})" for a, c in self.owner.items()]
        stages = "stages " + "+".join(map(str, self.stages)) if self.tied_stages else \
            f"stage {self.stage}"
        return "[" + ", ".join(parts or ["Replicate"]) + f"] {stages}"


def _step(length: int, n: int, pad: bool, what: str = "") -> int:
    """Block length for splitting `length` into n blocks."""
    if pad:
        return -(-length // n)
    if length % n:
        raise ValueError(f"{what}length {length} is not divisible by {n}")
    return length // n


def _length(length: int, s: Shard, n: int) -> int:
    """Local length along s.dim after step `s` over n ranks."""
    return _step(length, n * s.blocks, s.pad) * s.blocks


def local_shape(full_shape, placement: Placement, sizes: dict) -> tuple:
    shape = list(full_shape)
    for s in placement.shards:
        shape[s.dim] = _length(shape[s.dim], s, sizes.get(s.axis, 1))
    return tuple(shape)


def _dim_segments(full_len: int, steps, sizes: dict, coords: dict):
    """Where a rank's local block of one dim comes from: ([(global start, global stop, local
    start), ...], local length incl. padding) after the `steps` that split this dim."""
    segments, length = [(0, full_len, 0)], full_len
    for s in steps:
        n, c = sizes.get(s.axis, 1), coords.get(s.axis, 0)
        piece = _step(length, n * s.blocks, s.pad)            # one block's slice
        block = length // s.blocks                            # blocks > 1: no padding
        kept = [(j * block + c * piece, j * block + (c + 1) * piece, j * piece)
                for j in range(s.blocks)]                     # old local range -> new offset
        segments = [(gs + max(ls, lo) - ls, gs + min(ls + ge - gs, hi) - ls,
                     off + max(ls, lo) - lo)
                    for lo, hi, off in kept for gs, ge, ls in segments
                    if max(ls, lo) < min(ls + ge - gs, hi)]
        length = piece * s.blocks
    return segments, length


def local_pieces(full_shape, placement: Placement, sizes: dict, coords: dict) -> list:
    """The rectangles of the full array this rank holds: [(global ranges, local starts)], a
    list of (start, stop) per dim and where that rectangle starts in the local block. One
    rectangle unless a blocked step splits a dim (qkv under tp: three)."""
    per_dim = [_dim_segments(n, [s for s in placement.shards if s.dim == d], sizes, coords)[0]
               for d, n in enumerate(full_shape)]
    pieces = [([], [])]
    for segs in per_dim:
        pieces = [(r + [(gs, ge)], o + [ls]) for r, o in pieces for gs, ge, ls in segs]
    return pieces


def local_slices(full_shape, placement: Placement, sizes: dict, coords: dict):
    """The region of the full array this rank holds: list of (start, stop) per dim, and the
    number of padding rows (per dim) at the end of the local block. ValueError for a blocked
    placement, whose block is several rectangles (see local_pieces)."""
    if any(s.blocks > 1 and sizes.get(s.axis, 1) > 1 for s in placement.shards):
        raise ValueError(f"placement {placement} holds several rectangles of the full "
                         f"array, not one region (use local_pieces)")
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
    shape = local_shape(np.shape(full), placement, sizes)
    kind = getattr(full, "dtype", None)
    out = xp.zeros(shape, dtype=dtype or (kind if kind is not None else np.asarray(full).dtype))
    for ranges, starts in local_pieces(np.shape(full), placement, sizes, coords):
        piece = np.asarray(full[tuple(slice(a, b) for a, b in ranges)])
        out[tuple(slice(o, o + b - a) for o, (a, b) in zip(starts, ranges))] = \
            xp.asarray(piece, dtype=out.dtype)
    return out


def gather_array(comm, local, placement: Placement, full_shape):
    """Collective over the placement's axes (`comm`: a Comm of the mesh): the full array on
    every rank of them."""
    # lengths along each sharded dim before each step, to trim padding on the way back
    lengths = []
    shape = list(full_shape)
    for s in placement.shards:
        lengths.append(shape[s.dim])
        shape[s.dim] = _length(shape[s.dim], s, comm.mesh.size(s.axis))
    a = local
    for s, length in zip(reversed(placement.shards), reversed(lengths)):
        n = comm.mesh.size(s.axis)
        if n > 1:
            a = comm.all_gather(a, axis=s.dim, group=s.axis)
        if n > 1 and s.blocks > 1:           # [r0: b0 b1 b2 | r1: b0 b1 b2] -> block-major
            a = unblock(a, s.dim, n, s.blocks)
        if a.shape[s.dim] != length:
            a = a[(slice(None),) * s.dim + (slice(0, length),)]
    return a


def unblock(a, dim: int, n: int, blocks: int):
    """Reorder dim `dim` of `a` from rank-major (n ranks x `blocks` slices) to block-major."""
    moved = a.swapaxes(0, dim)
    m = moved.shape[0] // (n * blocks)
    out = moved.reshape((n, blocks, m) + moved.shape[1:]).swapaxes(0, 1)
    return out.reshape(moved.shape).swapaxes(0, dim)


@dataclass
class ParamInfo:
    """A parameter's full shape and its placement."""

    name: str
    full_shape: tuple
    placement: Placement = field(default_factory=Placement)

"""Layouts and the device mesh.

A layout string names mesh axes and their sizes, plus strategy options, joined by commas:

    "single"                          one device, the reference
    "dp=4"                            data parallel over 4 ranks
    "dp=2,tp=2"                       2 data-parallel replicas of a 2-way tensor-parallel model
    "pp=4,microbatches=8,schedule=1f1b"
    "fsdp=4,zero=2"

Axes: dp, fsdp, ep, pp, cp, tp. The product of the axis sizes must equal the world size.

Rank order (documented contract): ranks are numbered row-major over the axes in the order
(dp, fsdp, ep, pp, cp, tp), so tp is innermost (tensor-parallel peers are neighbours, i.e. on
the same node), then cp (context parallelism's ring exchanges keys and values in every
attention layer, the next most traffic, so its peers come next), then pp, then the data axes
outermost, as Megatron does. For "dp=2,tp=2":

    rank 0 = (dp 0, tp 0)   rank 1 = (dp 0, tp 1)   rank 2 = (dp 1, tp 0)   rank 3 = (dp 1, tp 1)

`DeviceMesh` builds one communicator per axis with `Split` (color = the coordinates on all the
other axes, key = the coordinate on this axis), and on demand one for a tuple of axes (the
combined data-parallel group, for example); the whole world's group is one of these too, never
the caller's communicator itself. `close()` frees them (engine.close()).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from math import isfinite, prod

from .retired import free_retired, keep_forever, retire

class CommUnusable(RuntimeError):
    """The engine's communication was closed, or timed out before: build a new engine."""


AXES = ("dp", "fsdp", "ep", "pp", "cp", "tp")
"""Mesh axes, outermost first (the rank order)."""

DATA_AXES = ("dp", "fsdp", "ep")
"""Axes over which the batch is split (ep splits tokens like dp does)."""

AVERAGE_AXES = DATA_AXES + ("cp",)
"""Axes over which the loss and the gradients of the parameters replicated on them are
averaged: the data axes (each rank holds other rows) and cp (each rank holds other tokens of
the same rows, as many as its peers, so the mean of the ranks' token means is the global
token mean). cp does not split rows: it is not a data axis."""

# option name -> (type, allowed values or None, the axes it configures: one of them must be
# in the layout; () for an option of any layout)
OPTIONS = {
    "microbatches": (int, None, ("pp",)),
    "schedule": (str, ("gpipe", "1f1b", "interleaved", "zb1p"), ("pp",)),
    "virtual_stages": (int, None, ("pp",)),
    "stages": (str, None, ("pp",)),         # explicit layer split, e.g. "2+1+1"
    "zero": (int, (1, 2, 3), ("fsdp",)),
    "bucket_mb": (float, None, DATA_AXES),  # gradient bucket size for dp/fsdp all-reduce
    "overlap": (int, (0, 1), DATA_AXES),    # overlap gradient communication with backward
    "prefetch": (int, (0, 1), ("fsdp",)),   # fsdp: issue the next layer's all_gather early
    "sequence_parallel": (int, (0, 1), ("tp",)),   # tp: LayerNorm/residual split along T
    "cp_kind": (str, ("ring", "ulysses"), ("cp",)),   # context parallel: ring or all_to_all
    "recompute": (str, ("0", "1", "attn"), ()),   # GPT: recompute blocks (nn/recompute.py)
}


@dataclass(frozen=True)
class Layout:
    """A parsed layout: axis sizes (every axis, 1 when absent) and strategy options."""

    sizes: dict = field(default_factory=dict)
    options: dict = field(default_factory=dict)
    text: str = "single"

    @property
    def world_size(self) -> int:
        return prod(self.sizes.values())

    def size(self, axis: str) -> int:
        return self.sizes.get(axis, 1)

    @property
    def active_axes(self) -> tuple:
        """Axes with size > 1, outermost first."""
        return tuple(a for a in AXES if self.sizes.get(a, 1) > 1)

    @property
    def data_parallel_size(self) -> int:
        return prod(self.size(a) for a in DATA_AXES)

    def option(self, name, default=None):
        return self.options.get(name, default)

    def __str__(self) -> str:
        return self.text


def parse_layout(text) -> Layout:
    """Parse a layout string ("dp=2,tp=2,zero=3"); raise ValueError naming the problem."""
    if isinstance(text, Layout):
        return text
    if not isinstance(text, str):
        raise TypeError(f"layout must be a string like 'dp=2,tp=2', got {type(text).__name__}")
    s = text.strip()
    sizes = {a: 1 for a in AXES}
    options: dict = {}
    if s in ("", "single"):
        return Layout(sizes, options, "single")
    seen = set()
    for part in s.split(","):
        part = part.strip()
        if part == "single":
            continue
        if "=" not in part:
            raise ValueError(f"layout {text!r}: expected 'name=value', got {part!r}")
        key, value = (p.strip() for p in part.split("=", 1))
        if key in seen:
            raise ValueError(f"layout {text!r}: {key!r} given twice")
        seen.add(key)
        if key in AXES:
            try:
                n = int(value)
            except ValueError:
                raise ValueError(f"layout {text!r}: size of axis {key!r} must be an integer, "
                                 f"got {value!r}") from None
            if n < 1:
                raise ValueError(f"layout {text!r}: size of axis {key!r} must be >= 1, got {n}")
            sizes[key] = n
        elif key in OPTIONS:
            typ, allowed, _ = OPTIONS[key]
            try:
                v = typ(value)
            except ValueError:
                raise ValueError(f"layout {text!r}: option {key!r} must be {typ.__name__}, "
                                 f"got {value!r}") from None
            if typ is float and not isfinite(v):
                raise ValueError(f"layout {text!r}: option {key!r} must be a finite number, "
                                 f"got {value!r}")
            if allowed is not None and v not in allowed:
                raise ValueError(f"layout {text!r}: option {key}={value!r} not one of "
                                 f"{list(allowed)}")
            options[key] = v
        else:
            raise ValueError(f"layout {text!r}: unknown axis or option {key!r}; axes are "
                             f"{list(AXES)}, options are {sorted(OPTIONS)}")
    for key in options:                     # an option without its axis is a mistake, not a no-op
        axes = OPTIONS[key][2]
        if axes and not any(a in seen for a in axes):
            raise ValueError(f"layout {text!r}: option {key!r} applies to the "
                             f"{' or '.join(axes)} axis, which the layout does not have")
    if options.get("prefetch") and options.get("zero", 3) != 3:
        raise ValueError(f"layout {text!r}: prefetch=1 needs zero=3, got zero="
                         f"{options['zero']}: ZeRO-1/2 keep parameters replicated on fsdp, so "
                         "no layer all-gathers a weight that could be prefetched")
    return Layout(sizes, options, s)


def coordinates(layout: Layout, rank: int) -> dict:
    """Mesh coordinates of `rank` (row-major over AXES, tp innermost). No MPI needed."""
    coords = {}
    for axis in reversed(AXES):
        n = layout.size(axis)
        coords[axis] = rank % n
        rank //= n
    return {a: coords[a] for a in AXES}


def rank_of(layout: Layout, coords: dict) -> int:
    """Inverse of `coordinates`."""
    r = 0
    for axis in AXES:
        r = r * layout.size(axis) + coords.get(axis, 0)
    return r


def group_ranks(layout: Layout, rank: int, axes) -> list:
    """World ranks in `rank`'s group over `axes` (a name or a tuple), in group-rank order."""
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    base = coordinates(layout, rank)
    members = [dict(base)]
    for axis in [a for a in AXES if a in axes]:
        members = [dict(m, **{axis: i}) for m in members for i in range(layout.size(axis))]
    return sorted(rank_of(layout, m) for m in members)


def check_world_size(layout: Layout, world_size: int) -> None:
    if layout.world_size != world_size:
        terms = "*".join(f"{a}={layout.size(a)}" for a in AXES if layout.size(a) > 1) or "single"
        raise ValueError(f"layout {layout.text!r} needs {terms} = {layout.world_size} ranks, "
                         f"but the world size is {world_size}")


class DeviceMesh:
    """One communicator per mesh axis (and per tuple of axes, on demand)."""

    def __init__(self, comm, layout):
        self.layout = parse_layout(layout)
        check_world_size(self.layout, comm.Get_size())
        self.world = comm
        self.rank = comm.Get_rank()
        self.coords = coordinates(self.layout, self.rank)
        self._comms: dict = {}
        self.closed = False

    def close(self) -> None:
        """Free the communicators this mesh split off (not `world`, the caller's); later
        calls to `comm` raise. Idempotent; local (MPI_Comm_free does not communicate)."""
        comms, self._comms, self.closed = self._comms, {}, True
        for comm in comms.values():
            comm.Free()

    def keep(self) -> None:
        """Like close(), but the communicators are never freed (retired.keep_forever): after
        a timeout or a close on this rank alone, a message may still arrive on them."""
        comms, self._comms, self.closed = self._comms, {}, True
        keep_forever(comms.values())

    def __del__(self, retire=retire):
        """A mesh collected without `close()`: its communicators are handed over to be freed
        at the next Split (comm/retired.py: a finalizer must never call MPI). `retire` is
        bound as a default: at interpreter exit the module's globals may already be None."""
        comms, self._comms = getattr(self, "_comms", {}), {}
        retire(comms.values())

    def size(self, axes) -> int:
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        return prod(self.layout.size(a) for a in set(axes))   # a repeated axis counts once

    def coord(self, axes) -> int:
        """This rank's index inside its group over `axes` (row-major, outermost first)."""
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        i = 0
        for a in AXES:
            if a in axes:
                i = i * self.layout.size(a) + self.coords[a]
        return i

    def comm(self, axes=None):
        """The communicator of this rank's group over `axes` (None: the whole world, in the
        same rank order as `world`, split off it so that no call is left on the caller's)."""
        if self.closed:
            raise CommUnusable("this engine was closed (engine.close()): build a new engine")
        key = self.layout.active_axes if axes is None else (
            (axes,) if isinstance(axes, str) else tuple(axes))
        for a in key:
            if a not in AXES:
                raise ValueError(f"unknown mesh axis {a!r}; axes are {list(AXES)}")
        # axes of size 1 change neither the members nor their order: one communicator per
        # set of axes of size > 1, so all of them can be made up front (health/watchdog.py)
        key = tuple(a for a in AXES if a in key and self.layout.size(a) > 1)
        if key not in self._comms:
            # color: my coordinates on every other axis; key: my index within the group.
            color = 0
            for a in AXES:
                if a not in key:
                    color = color * self.layout.size(a) + self.coords[a]
            free_retired()                          # ids of collected meshes, first
            self._comms[key] = self.world.Split(color, self.coord(key))
        return self._comms[key]

    def group_ranks(self, axes) -> list:
        return group_ranks(self.layout, self.rank, axes)

    def describe(self) -> str:
        lines = [f"layout {self.layout.text!r}: {self.layout.world_size} ranks, order "
                 + " > ".join(AXES) + " (tp innermost)"]
        for a in self.layout.active_axes:
            groups = sorted({tuple(group_ranks(self.layout, r, a))
                             for r in range(self.layout.world_size)})
            lines.append(f"  {a}={self.layout.size(a)} groups: "
                         + " ".join("[" + ",".join(map(str, g)) + "]" for g in groups))
        return "\n".join(lines)

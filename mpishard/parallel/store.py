"""ParamStore: this rank's blocks of the parameters and gradients, and where they sit.

Built by compose from the plan (name -> ParamInfo: full shape and Placement) and the gradient
placements (the same, except under ZeRO-1/2 where gradients and optimizer state carry an
extra fsdp split). Every collaborator that needs parameters (layers through their access
policy, gradient sync, optimizers, checkpoints) is handed this store, not the engine.

    params[name]   the block this rank holds, shape local_shape(full, placement)
    grads[name]    its gradient block, shape local_shape(full, grad_placement)
"""
from __future__ import annotations

from . import placement as pl
from .precision import shard_held, widen


class ParamStore:
    """Local parameter and gradient blocks of one rank, keyed by full parameter names."""

    def __init__(self, plan: dict, grad_placements: dict, layout, coords: dict, xp, dtype,
                 grad_dtype=None):
        self.plan = plan
        self.layout = layout
        self.coords = coords
        # dtype: the parameters' (mixed precision: param_dtype); grad_dtype: the gradients'
        # (the compute dtype; default dtype)
        self.xp, self.dtype = xp, dtype
        self.grad_dtype = dtype if grad_dtype is None else grad_dtype
        self.placements = {n: info.placement for n, info in plan.items()}
        self.full_shapes = {n: info.full_shape for n, info in plan.items()}
        self.grad_placements = grad_placements
        stage = coords.get("pp", 0)
        self.local_names = [n for n, info in plan.items() if stage in info.placement.stages
                            and info.placement.held_at(coords)]
        self.params: dict = {}
        self.grads: dict = {}

    def load(self, params: dict) -> None:
        """Keep this rank's block of every local parameter of the full dict `params`
        (arrays or lazily loaded arrays) and allocate zeroed gradient blocks."""
        sizes = self.layout.sizes
        for name in self.local_names:
            # as precision.held says (bfloat16 on a device: uint16 words)
            self.params[name] = shard_held(params[name], self.placements[name], sizes,
                                           self.coords, self.xp, self.dtype, self.grad_dtype)
            self.grads[name] = self.xp.zeros(
                pl.local_shape(self.full_shapes[name], self.grad_placements[name], sizes),
                dtype=self.grad_dtype)

    def zero_grads(self) -> None:
        for g in self.grads.values():
            g[...] = 0

    def replication(self, name) -> int:
        """Number of ranks holding an identical copy of this rank's gradient (and optimizer)
        block of `name`: the product of the mesh axes it is replicated on, pp excluded (a
        parameter lives on one stage), times its stages (tied copies: parallel/tied.py). Norms
        divide each rank's local sum of squares by it, so a replicated block is counted once
        and a sharded one summed over its shards."""
        placement = self.grad_placements[name]
        r = len(placement.stages)
        for axis, size in self.layout.sizes.items():
            if axis != "pp" and placement.is_replicated_on(axis):
                r *= size
        return r

    def block_region(self, name, which: str = "param"):
        """Where this rank's block of `name` sits in the full array: a list of (start, stop)
        per dim (padding excluded). which='param': the stored parameter block;
        which='optimizer': the block the optimizer updates (ZeRO-1/2: the owned fsdp slice)."""
        placement = self.grad_placements[name] if which == "optimizer" else \
            self.placements[name]
        ranges, _ = pl.local_slices(self.full_shapes[name], placement, self.layout.sizes,
                                    self.coords)
        return ranges

    def block_pieces(self, name, which: str = "param") -> list:
        """Like block_region, for any placement: [(region, local index)], each rectangle
        (start, stop) per dim of the full array this rank holds and the slices of the local
        block holding it. One piece, at the block's start, unless a blocked split (a GPT's
        qkv under tp: three); none when the block is all padding."""
        placement = self.grad_placements[name] if which == "optimizer" else \
            self.placements[name]
        return [(ranges, tuple(slice(o, o + b - a) for o, (a, b) in zip(starts, ranges)))
                for ranges, starts in pl.local_pieces(self.full_shapes[name], placement,
                                                      self.layout.sizes, self.coords)]

    # -- full views and memory -----------------------------------------------------------------
    def gather_full(self, comm, local: dict, placements: dict) -> dict:
        """Collective over the whole mesh (comm: the engine's Comm): the full-shape array of
        every parameter on every rank, from the local blocks `local` laid out as `placements`
        (the parameters, or the gradients with the gradient placements)."""
        out = {}
        stage, pp = self.coords.get("pp", 0), self.layout.size("pp")
        # 16-bit parameters (mixed precision) are gathered cast to the gradients' dtype: exact,
        # and a dtype every MPI call moves
        if self.dtype != self.grad_dtype:
            local = {n: widen(a, self.grad_dtype, self.xp) for n, a in local.items()}
        for name, info in self.plan.items():
            full = None
            if info.placement.stage == stage:
                if info.placement.held_at(self.coords):
                    full = pl.gather_array(comm, local[name], placements[name],
                                           info.full_shape)
                for axis, coord in info.placement.owner.items():   # e.g. an expert's ep rank
                    full = comm.broadcast(full, root=coord, group=axis)
            if pp > 1:
                full = comm.broadcast(full, root=info.placement.stage, group="pp")
            if full is local.get(name):        # unsharded: hand out a copy, never the live array
                full = full.copy()
            out[name] = full
        return out

    def memory_report(self, access, optimizer=None, activations=None) -> dict:
        """Bytes held: params, grads (with the access policy's extra gradient buffers),
        optimizer state, the access policy's gathered peak, the activation tapes' peak
        (`activations`: an nn.activations.TapeMeter), and their total."""
        extra_grads = getattr(access, "grad_buffers", {})
        state = getattr(optimizer, "state", {}) if optimizer is not None else {}
        report = {
            "params": held_bytes(self.params.values()),
            "grads": held_bytes(list(self.grads.values()) + list(extra_grads.values())),
            "optimizer": held_bytes(v for entry in state.values() for v in entry.values()
                                    if hasattr(v, "nbytes") and getattr(v, "ndim", 0) > 0),
            "gathered_peak": int(getattr(access, "peak_gathered_bytes", 0)),
            "activations_peak": int(getattr(activations, "peak", 0)),
        }
        report["total"] = sum(report.values())
        return report


def held_bytes(arrays) -> int:
    """Bytes of the buffers behind `arrays` (a view counts as the buffer it lives in, once)."""
    buffers = {}
    for a in arrays:
        while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
            a = a.base
        buffers[id(a)] = int(a.nbytes)
    return sum(buffers.values())

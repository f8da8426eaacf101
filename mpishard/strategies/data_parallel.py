"""Data parallelism: replicated weights, split batch, gradients averaged over the data axes.

Each rank computes dL_r/dW on its rows (L_r = mean over its rows); the average over the R
data-parallel ranks, `all_reduce(op='avg')`, is the gradient of the mean loss over the global
batch when local batches are equal:

    dL/dW = (1/R) sum_r dL_r/dW           all_reduce(avg) over ('dp', ...)

Adjoint: the forward broadcast of W to every replica (done once, by load_checkpoint).

Gradients are packed into flat buckets (`bucket_mb`, DDP's 25 MB default) so many small
tensors cost one all-reduce instead of one each. A parameter is averaged over every data axis
(dp, fsdp, ep) on which it is replicated; axes on which it is sharded (fsdp) are handled by
that strategy's reduce-scatter.
"""
from __future__ import annotations

from ..mesh import DATA_AXES

DEFAULT_BUCKET_MB = 25.0


def replicated_data_axes(engine, name) -> tuple:
    """The data axes over which gradient `name` must be averaged."""
    placement = engine.placements[name]
    return tuple(a for a in DATA_AXES
                 if engine.mesh.size(a) > 1 and placement.is_replicated_on(a)
                 and a not in engine.grad_sync_exempt.get(name, ()))


class GradientSync:
    """Bucketed all_reduce(avg) of gradients over the data axes on which they are replicated."""

    def __init__(self, engine, bucket_mb: float = DEFAULT_BUCKET_MB):
        self.engine = engine
        self.bucket_bytes = max(1, int(bucket_mb * 2 ** 20))
        # groups: axes tuple -> list of buckets, each a list of parameter names (backward order)
        self.buckets: dict = {}
        names = list(reversed(list(engine.params)))   # last layers' gradients are ready first
        for name in names:
            axes = replicated_data_axes(engine, name)
            if not axes:
                continue
            bl = self.buckets.setdefault(axes, [[]])
            size = sum(engine.grads[n].nbytes for n in bl[-1])
            if bl[-1] and size + engine.grads[name].nbytes > self.bucket_bytes:
                bl.append([])
            bl[-1].append(name)

    def sync(self, grads: dict) -> None:
        """Average `grads` in place over their data axes (collective on every rank)."""
        xp = self.engine.xp
        for axes, buckets in self.buckets.items():
            for bucket in buckets:
                if len(bucket) == 1:
                    g = grads[bucket[0]]
                    g[...] = self.engine.all_reduce(g, op="avg", group=axes)
                    continue
                flat = xp.concatenate([grads[n].ravel() for n in bucket])   # pack
                flat = self.engine.all_reduce(flat, op="avg", group=axes)
                offset = 0
                for n in bucket:                                              # unpack
                    g = grads[n]
                    g[...] = flat[offset:offset + g.size].reshape(g.shape)
                    offset += g.size

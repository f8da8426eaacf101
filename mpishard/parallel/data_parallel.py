"""Data parallelism: replicated weights, split batch, gradients averaged over the data axes.

Each rank computes dL_r/dW on its rows (L_r = mean over its rows); the average over the R
data-parallel ranks, `all_reduce(op='avg')`, is the gradient of the mean loss over the global
batch when local batches are equal:

    dL/dW = (1/R) sum_r dL_r/dW           all_reduce(avg) over ('dp', ...)

Adjoint: the forward broadcast of W to every replica (done once, by load_checkpoint).

A parameter is averaged over every data axis (dp, fsdp, ep) on which it is replicated, and over
cp (comm.mesh.AVERAGE_AXES: context-parallel ranks hold other tokens of the same rows); axes on
which it is sharded (fsdp) are handled by that strategy's reduce-scatter.

Three optimisations, each switchable, each giving the same numbers as without it:

1. Buckets (layout option `bucket_mb`, DDP's 25 MB default; `bucket_mb=0` means one all-reduce
   per tensor). Gradients are grouped, last layer first (the backward's order), into flat
   buckets of at most `bucket_mb` MiB, so many small tensors cost one all-reduce.
2. Gradients as bucket views. Each bucket owns one flat buffer and the engine's gradient
   arrays are views into it (what DDP calls `gradient_as_bucket_view`), so a bucket is reduced
   in place (MPI_IN_PLACE) with no pack/unpack copies and no allocation per step. If something
   replaced a gradient array since, the bucket falls back to pack -> all-reduce -> unpack.
3. Overlap (layout option `overlap=1`). The access policy calls `on_grad_ready(name)` once a
   gradient is final; when the last gradient of a bucket is ready its non-blocking all-reduce
   (`all_reduce_async`, MPI Iallreduce) starts while the backward of earlier layers still
   runs, and `sync()` waits for them. Only a backward that syncs communicates: the engine
   calls `begin(overlap=sync)` first, so gradient accumulation with `sync=False` starts
   nothing. Overlap needs each gradient to be final after one `add_grad`, which holds for the
   sequential runner with local parameters (pp=1, no fsdp, MLP); compose passes that as
   `overlap_possible`, and elsewhere buckets are reduced in `sync()` as with overlap=0
   (`overlap_active` says which).

Bucket order, and so the order of the collectives, is the same on every rank of a group.
"""
from __future__ import annotations

from ..comm.mesh import AVERAGE_AXES

DEFAULT_BUCKET_MB = 25.0


def replicated_data_axes(grad_placement, sizes: dict, exempt=()) -> tuple:
    """The averaging axes (data axes and cp) over which a gradient laid out as
    `grad_placement` is averaged: those it is replicated on (under ZeRO-1/2 a gradient is
    sharded on fsdp even though its parameter is not), except the `exempt` ones another
    strategy averages itself."""
    return tuple(a for a in AVERAGE_AXES
                 if sizes.get(a, 1) > 1 and grad_placement.is_replicated_on(a)
                 and a not in exempt)


def plan_buckets(names, nbytes: dict, axes_of: dict, bucket_bytes: int) -> list:
    """Group `names` (in backward order) into buckets: [(axes, [names])], at most
    `bucket_bytes` each (a larger tensor gets a bucket of its own; bucket_bytes <= 0: one
    tensor per bucket). No MPI: the same plan on every rank."""
    buckets: list = []
    open_bucket: dict = {}            # axes -> [index into buckets, bytes so far] being filled
    for name in names:
        axes = axes_of[name]
        if not axes:
            continue
        filling = open_bucket.get(axes)
        if filling is not None and bucket_bytes > 0 and \
                filling[1] + nbytes[name] <= bucket_bytes:
            buckets[filling[0]][1].append(name)
            filling[1] += nbytes[name]
            continue
        open_bucket[axes] = [len(buckets), nbytes[name]]
        buckets.append((axes, [name]))
    return buckets


class Bucket:
    """Gradients reduced together: one flat buffer, the gradients views into it."""

    def __init__(self, comm, grads: dict, axes, names, views: bool):
        self.comm, self.axes, self.names = comm, axes, list(names)
        xp = comm.xp
        self.flat = None
        if len(self.names) > 1 and views:
            total = sum(grads[n].size for n in self.names)
            dtype = grads[self.names[0]].dtype
            self.flat = xp.empty(total, dtype=dtype)
            offset = 0
            for n in self.names:                     # the store's gradients become views
                g = grads[n]
                view = self.flat[offset:offset + g.size].reshape(g.shape)
                view[...] = g
                grads[n] = view
                offset += g.size
        self.views = {n: grads[n] for n in self.names} if self.flat is not None else {}
        self.ready: set = set()
        self.future = None
        self.packed = None

    def buffer(self, grads):
        """The contiguous array to reduce in place: the flat buffer, the single gradient, or
        (fallback) a packed copy to unpack after."""
        if len(self.names) == 1:
            g = grads[self.names[0]]
            if g.flags.c_contiguous:
                return g
        if self.flat is not None and all(grads[n] is self.views[n] for n in self.names):
            return self.flat
        xp = self.comm.xp
        self.packed = xp.concatenate([grads[n].ravel() for n in self.names])    # pack
        return self.packed

    def unpack(self, grads, buf) -> None:
        if buf is not self.packed:
            return
        offset = 0
        for n in self.names:                                                    # unpack
            g = grads[n]
            g[...] = buf[offset:offset + g.size].reshape(g.shape)
            offset += g.size
        self.packed = None

    def start(self, grads) -> None:
        """Launch the non-blocking all-reduce(sum) in place (the average is taken on wait)."""
        buf = self.buffer(grads)
        self.future = self.comm.all_reduce_async(buf, op="sum", group=self.axes, out=buf)

    def finish(self, grads) -> None:
        """Wait for a started bucket, or all-reduce it now; leave the average in `grads`."""
        n = self.comm.size(self.axes)
        if self.future is not None:
            buf = self.future.result()
            self.future = None
            if n > 1:
                buf /= n                                           # sum -> avg
        else:
            buf = self.buffer(grads)
            self.comm.all_reduce(buf, op="avg", group=self.axes, out=buf)
        self.unpack(grads, buf)


class GradientSync:
    """Bucketed all_reduce(avg) of gradients over the data axes on which they are replicated.

    store: the parameter store (`params`, `grads`, `grad_placements`); comm: the engine's
    Comm (buckets reduce over tuples of data axes); exempt: name -> data axes another strategy
    averages itself (fsdp's reduce-scatter); overlap_possible: compose's verdict on whether a
    gradient is final after one add_grad (see the module docstring). Buckets are built by
    `on_load()`, once the store allocated its gradients; with `views=True` multi-tensor
    buckets re-home the store's gradient arrays into flat buffers. `overlap=None` reads the
    layout option `overlap` (default 0).
    """

    def __init__(self, store, comm, exempt=None, overlap_possible=False,
                 bucket_mb: float = DEFAULT_BUCKET_MB, overlap=None, views: bool = True):
        if bucket_mb is None:
            bucket_mb = DEFAULT_BUCKET_MB
        if bucket_mb < 0:
            raise ValueError(f"bucket_mb must be >= 0 (0: one all-reduce per tensor), "
                             f"got {bucket_mb}")
        self.store, self.comm = store, comm
        self.exempt = exempt or {}
        self.bucket_bytes = int(bucket_mb * 2 ** 20)
        if overlap is None:
            overlap = store.layout.option("overlap", 0)
        self.overlap = bool(overlap)
        self.overlap_active = self.overlap and bool(overlap_possible)
        self.views = views
        self.buckets, self.bucket_of = [], {}
        self._armed = False
        if store.grads:
            self.on_load()

    def on_load(self) -> None:
        """Plan the buckets over the store's gradients (after they are allocated)."""
        grads, sizes = self.store.grads, self.store.layout.sizes
        names = list(reversed(list(self.store.params)))  # last layers' gradients ready first
        axes_of = {n: replicated_data_axes(self.store.grad_placements[n], sizes,
                                           self.exempt.get(n, ())) for n in names}
        plan = plan_buckets(names, {n: grads[n].nbytes for n in names}, axes_of,
                            self.bucket_bytes)
        self.buckets = [Bucket(self.comm, grads, axes, bnames, self.views)
                        for axes, bnames in plan]
        self.bucket_of = {n: b for b in self.buckets for n in b.names}
        self._armed = False

    # -- the backward's hooks ------------------------------------------------------------------
    def begin(self, overlap: bool = True) -> None:
        """A backward starts. overlap=False (a sync=False accumulation step) starts nothing."""
        for b in self.buckets:          # a previous pass that never synced: finish it cleanly
            if b.future is not None:
                b.future.result()
                b.future = None
            b.ready.clear()
            b.packed = None
        self._armed = self.overlap_active and bool(overlap)

    def on_grad_ready(self, name) -> None:
        """Gradient `name` is final: start its bucket's all-reduce if it was the last one."""
        if not self._armed:
            return
        b = self.bucket_of.get(name)
        if b is None:
            return
        if name in b.ready:
            raise RuntimeError(f"gradient {name!r} reported ready twice in one backward; "
                               "overlap needs one add_grad per gradient")
        b.ready.add(name)
        if len(b.ready) == len(b.names):
            b.start(self.store.grads)
        for other in self.buckets:      # let MPI progress the ones in flight
            if other.future is not None:
                other.future.done()

    # -- the synchronisation -------------------------------------------------------------------
    def sync(self, grads: dict) -> None:
        """Average `grads` in place over their data axes (collective on every rank)."""
        self._armed = False
        for b in self.buckets:
            b.finish(grads)
            b.ready.clear()

    def describe(self) -> str:
        lines = [f"{len(self.buckets)} bucket(s), cap {self.bucket_bytes / 2 ** 20:g} MiB, "
                 f"overlap {'on' if self.overlap_active else 'off'}"]
        for b in self.buckets:
            nbytes = sum(self.store.grads[n].nbytes for n in b.names)
            lines.append(f"  {'+'.join(b.axes)}: {nbytes / 2 ** 20:.2f} MiB {b.names}")
        return "\n".join(lines)


# -- cost model (no MPI): bytes this rank sends per train_step, and memory ---------------------
def memory(view, n_state) -> dict:
    """Nothing beyond the base: every replica holds whole blocks."""
    return {}


def step_comm(view) -> dict:
    """GradientSync's all_reduce(avg) over dp and cp of this rank's gradient blocks (ZeRO-1/2:
    the owned slices; buckets change the calls, not the bytes), then global_mean's
    all_reduce(avg) of the loss over every averaging axis."""
    sent = 0.0
    axes = tuple(a for a in ("dp", "cp") if view.size(a) > 1)
    if axes:
        grads = sum(view.nbytes(shape) for shape in view.grad_blocks.values())
        sent += view.all_reduce_bytes(axes, grads)
    if view.size(AVERAGE_AXES) > 1:
        sent += view.all_reduce_bytes(AVERAGE_AXES, view.LOSS_BYTES)
    return {"train_step": {"all_reduce": sent}}

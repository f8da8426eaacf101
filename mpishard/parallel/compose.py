"""The composition: one engine for every layout, built from the strategy pieces.

An engine is a pipeline of stages of layers (`pp=1` is a pipeline of one stage):

1. `plan_params(model, layout)` decides, with no MPI, each parameter's `Placement`: the pp
   stage that owns it, its tp split (tensor_parallel.tp_shards) and its fsdp split (padded,
   dim 0). `inspect` and checkpoints use the same plan.
2. `MeshEngine` keeps only its shards, builds the layers of its stage(s) (CopyToTP / column /
   row layers under tp, plain Linear otherwise), with a parameter-access policy (local, or
   FSDP's gather-before-use), and a runner: sequential for pp=1, the pipeline executor for
   pp>1.
3. Gradients are averaged over the data axes on which a parameter is replicated
   (data_parallel.GradientSync); sharded data axes reduce-scatter inside the FSDP access.

`make_engine(model, "dp=2,tp=2")` is all a user calls.
"""
from __future__ import annotations

import numpy as np

from . import placement as pl
from ..engine import ShardedEngine
from ..nn.layers import Activation, Layer, Linear, LocalAccess
from ..nn.losses import get_loss
from ..comm.mesh import DATA_AXES, parse_layout
from .data_parallel import DEFAULT_BUCKET_MB, GradientSync
from .tensor_parallel import (ColumnParallelLinear, CopyToTP, RowParallelLinear, check_tp,
                              tp_role, tp_shards)


# -- planning (no MPI) -------------------------------------------------------------------------
def layer_stages(model, layout) -> list:
    """Virtual-stage index of each layer (pp * virtual_stages of them; rank stage k % pp)."""
    layout = parse_layout(layout)
    pp = layout.size("pp")
    if pp == 1:
        return [0] * model.n_layers
    from .pipeline import assign_stages

    return assign_stages(model, layout)


def uses_moe(model, layout) -> bool:
    """Expert-parallel composition: an ms.MoE model, or a layout with an ep axis (which
    expert_parallel refuses for anything but a MoE)."""
    return getattr(model, "kind", "mlp") == "moe" or layout.size("ep") > 1


def plan_params(model, layout) -> dict:
    """name -> ParamInfo(full_shape, Placement) for every parameter of `model` under `layout`.

    Raises ValueError (identically on every rank, before any communication) when the layout
    does not fit the model.
    """
    layout = parse_layout(layout)
    if uses_moe(model, layout):
        from .expert_parallel import plan_moe_params

        return plan_moe_params(model, layout)
    tp, pp, fsdp = layout.size("tp"), layout.size("pp"), layout.size("fsdp")
    layers = model.layers()
    if tp > 1:
        check_tp(layers, tp)
    vstages = layer_stages(model, layout)
    plan = {}
    for spec in layers:
        role = tp_role(spec.index, len(layers)) if tp > 1 else "replicated"
        for pname, shape in spec.param_shapes.items():
            kind = pname.rsplit("/", 1)[1]
            shards = tp_shards(role, kind) if tp > 1 else ()
            if fsdp > 1 and layout.option("zero", 3) == 3:
                # ZeRO-3 shards the parameter itself; ZeRO-1/2 keep it replicated on fsdp and
                # shard only gradients/optimizer state (fsdp.py sets grad_placements)
                shards = shards + (pl.Shard("fsdp", 0, pad=True),)
            plan[pname] = pl.ParamInfo(pname, tuple(shape),
                                       pl.Placement(shards, stage=vstages[spec.index] % pp))
    return plan


# -- runners -----------------------------------------------------------------------------------
class SequentialRunner:
    """pp=1: run the layers in order; the backward in reverse order."""

    def __init__(self, engine):
        self.engine = engine
        self.layers = engine.chunks[0]

    def forward(self, x, mb=0, record=True):
        for layer in self.layers:
            x = layer.forward(x, mb, record)
        return x

    def backward(self, dy, mb=0):
        for layer in reversed(self.layers):
            dy = layer.backward(dy, mb)
        return dy

    def train_step(self, x, t, loss, grad_scale):
        y = self.forward(x)
        value, dy = loss(y, t)
        if grad_scale != 1.0:
            dy = dy * grad_scale
        self.backward(dy)
        return value, t.shape[0]


# -- the engine --------------------------------------------------------------------------------
class MeshEngine(ShardedEngine):
    """Any layout: data, fsdp, tensor, pipeline (and expert) parallel pieces composed.

    Parameters
    ----------
    model : ms.MLP (or ms.MoE)
    layout : str  e.g. "dp=2,tp=2", "fsdp=4,zero=2", "pp=4,microbatches=8,schedule=1f1b"
    comm : mpi4py communicator (default COMM_WORLD)
    dtype : np.float64 or np.float32 (parameters, activations and gradients)
    device : "cpu", "gpu" or "auto" (cupy when a GPU is visible)
    """

    def __init__(self, model, layout="single", comm=None, dtype=np.float64, device="cpu",
                 debug=None):
        dtype = np.dtype(dtype)
        if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"dtype must be float32 or float64, got {dtype}")
        super().__init__(layout, comm, dtype, device, debug)
        if not hasattr(model, "param_shapes"):
            raise TypeError(f"model must be an ms.MLP or ms.MoE spec, got {type(model).__name__}")
        self.model = model
        self.plan = plan_params(model, self.layout)     # raises ValueError if it doesn't fit
        self.stage = self.mesh.coords["pp"]
        self.placements = {n: info.placement for n, info in self.plan.items()}
        self.full_shapes = {n: info.full_shape for n, info in self.plan.items()}
        self.local_names = [n for n, info in self.plan.items() if info.placement.stage ==
                            self.stage and info.placement.held_at(self.mesh.coords)]
        self.params: dict = {}
        self.grads: dict = {}
        self.grad_sync_exempt: dict = {}   # name -> data axes handled elsewhere (ep, fsdp)
        # how each gradient (and optimizer-state) block is laid out; = placements except
        # under ZeRO-1/2, where fsdp.FSDPAccess adds the fsdp split to replicated parameters
        self.grad_placements: dict = dict(self.placements)
        self.access = self._make_access()
        self.chunks = self._build_chunks()
        self.loaded = False
        self.stats: dict = {}
        self.runner = self._make_runner()
        self.grad_sync = None

    # -- construction hooks (each strategy plugs in here) --------------------------------------
    def _make_access(self):
        if self.layout.size("fsdp") > 1:
            from .fsdp import FSDPAccess

            return FSDPAccess(self)
        return LocalAccess(self)

    def _build_chunks(self) -> list:
        """The layers of this rank: one list per virtual stage it holds (pp=1: one list)."""
        if uses_moe(self.model, self.layout):
            from .expert_parallel import build_moe_chunks

            return build_moe_chunks(self)
        pp = self.layout.size("pp")
        vstages = layer_stages(self.model, self.layout)
        n_chunks = max(vstages) // pp + 1 if pp > 1 else 1
        chunks = [[] for _ in range(n_chunks)]
        layers = self.model.layers()
        tp = self.layout.size("tp")
        for spec in layers:
            k = vstages[spec.index]
            if k % pp != self.stage:
                continue
            chunks[k // pp].extend(self._linear_layers(spec, len(layers), tp))
        return chunks

    def _linear_layers(self, spec, n_layers, tp) -> list:
        w = f"{spec.prefix}/weights"
        b = f"{spec.prefix}/bias" if spec.bias else None
        need_dx = spec.index > 0       # the model input needs no gradient
        out: list[Layer] = []
        role = tp_role(spec.index, n_layers) if tp > 1 else "replicated"
        if role == "column":
            if need_dx:
                out.append(CopyToTP(self))                   # f: identity fwd / all-reduce bwd
            out.append(ColumnParallelLinear(self.access, w, b, need_dx))
        elif role == "row":
            out.append(RowParallelLinear(self, self.access, w, b, need_dx))
        else:
            out.append(Linear(self.access, w, b, need_dx))
        if spec.activation != "identity":
            out.append(Activation(spec.activation))
        return out

    def _make_runner(self):
        if self.layout.size("pp") > 1:
            from .pipeline import PipelineRunner

            return PipelineRunner(self)
        return SequentialRunner(self)

    @property
    def layers(self) -> list:
        return [layer for chunk in self.chunks for layer in chunk]

    # -- checkpoint in -------------------------------------------------------------------------
    def load_checkpoint(self, params: dict) -> None:
        """Every rank passes the full dict (arrays or lazily loaded arrays); each keeps only
        its shards. Raises the same ValueError on every rank for a missing/misshaped key."""
        self.model.check_params(params)
        sizes = self.layout.sizes
        for name in self.local_names:
            self.params[name] = pl.shard_array(params[name], self.placements[name], sizes,
                                               self.mesh.coords, self.xp, self.dtype)
            # gradient blocks follow grad_placements (ZeRO-1/2: only the owned fsdp slice)
            self.grads[name] = self.xp.zeros(
                pl.local_shape(self.full_shapes[name], self.grad_placements[name], sizes),
                dtype=self.dtype)
        for layer in self.layers:
            layer.clear()
        self.access.on_load()                  # FSDP ZeRO-1/2: padded parameter buffers
        self.loaded = True
        self.grad_sync = GradientSync(self, self.layout.option("bucket_mb", DEFAULT_BUCKET_MB))

    def _require_loaded(self):
        if not self.loaded:
            raise RuntimeError("call engine.load_checkpoint(params) before running the model")

    # -- data ----------------------------------------------------------------------------------
    @property
    def data_parallel_size(self) -> int:
        return self.mesh.size(DATA_AXES)

    @property
    def data_parallel_rank(self) -> int:
        return self.mesh.coord(DATA_AXES)

    def shard_batch(self, arr):
        """The rows of a global batch this rank is fed: block data_parallel_rank of
        data_parallel_size along axis 0 (tp and pp peers get the same rows)."""
        n, i = self.data_parallel_size, self.data_parallel_rank
        rows = np.shape(arr)[0]
        if rows % n:
            raise ValueError(f"batch of {rows} rows does not divide by the {n} data-parallel "
                             f"ranks of layout {self.layout.text!r}")
        block = arr[i * (rows // n):(i + 1) * (rows // n)]
        return self._to_device(block)

    def _to_device(self, a):
        a = self.backend.asarray(a)
        if a.dtype.kind == "f" and a.dtype != self.dtype:
            a = a.astype(self.dtype)
        return a

    def gather_batch(self, y_local):
        """Concatenate per-rank outputs (rows) over the data axes: the global batch's output.
        Under pp the output lives on the last stage and is broadcast to the others."""
        if self.layout.size("pp") > 1:
            y_local = self.broadcast(y_local, root=self.layout.size("pp") - 1, group="pp")
        if self.data_parallel_size == 1:
            return y_local
        return self.all_gather(y_local, axis=0, group=DATA_AXES)

    def _input(self, x):
        """x on the device in the engine's dtype (an integer or bool input would otherwise
        compute, and pipeline-send, in float64); ValueError on a wrongly shaped input."""
        return self._check_input(self.backend.asarray(x))

    def _check_input(self, x):
        """Raise ValueError on a wrongly shaped input; returns x in the engine's dtype."""
        d_in = self.model.d_in
        if x.ndim != 2 or x.shape[1] != d_in:
            raise ValueError(f"input has shape {tuple(x.shape)}, expected (batch, {d_in}) for "
                             f"{self.model!r}")
        return x if x.dtype == self.dtype else x.astype(self.dtype)

    # -- compute -------------------------------------------------------------------------------
    def forward(self, x, mb: int = 0):
        """Forward this rank's rows, recording activations for `backward`."""
        self._require_loaded()
        if x is not None:
            x = self._input(x)
        self._drop_tape(mb)          # a forward that never got its backward is forgotten
        return self.runner.forward(x, mb=mb, record=True)

    def _drop_tape(self, mb=None) -> None:
        """Forget saved activations (of microbatch `mb`, or all): a new forward replaces
        a recorded one whose backward never came, as re-running a model does in PyTorch."""
        for layer in self.layers:
            if mb is None:
                layer.clear()
            else:
                layer.tape.pop(mb, None)

    def predict(self, x):
        """Forward without an activation tape (inference)."""
        self._require_loaded()
        if x is not None:
            x = self._input(x)
        return self.runner.forward(x, mb=-1, record=False)

    def zero_grad(self) -> None:
        for g in self.grads.values():
            g[...] = 0
        self.access.zero_grad()                # FSDP ZeRO-1: its full gradient buffers

    def backward(self, dy, mb: int = 0, accumulate: bool = False, sync: bool = True) -> dict:
        """dy: dL/dy of this rank's local-mean loss. Returns this rank's gradient shards
        (averaged over the data axes when sync=True), keyed by full parameter names.
        accumulate=True adds to the gradients already held (gradient accumulation)."""
        self._require_loaded()
        if not accumulate:
            self.zero_grad()
        self.grad_sync.begin(overlap=sync)     # only a syncing backward may communicate
        self.runner.backward(None if dy is None else self._to_device(dy), mb=mb)
        if sync:
            self.sync_grads()
        return self.grads

    def sync_grads(self) -> None:
        """Average gradients over the data axes on which they are replicated (collective)."""
        self.access.finish_grads()             # FSDP: reduce-scatter what is still full
        self.grad_sync.sync(self.grads)

    def on_grad_ready(self, name) -> None:
        """Hook: gradient `name` is final for this backward (overlap strategies use it)."""
        if self.grad_sync is not None:
            self.grad_sync.on_grad_ready(name)  # layout overlap=1: start its bucket's all-reduce

    def train_step(self, x, t, loss, *, accumulate: bool = False, sync: bool = True,
                   grad_scale: float = 1.0):
        """One forward + loss + backward. Returns (loss, grads).

        loss: the global mean loss, the same float on every rank (with sync=False, the
        local mean, without communication). grads: this rank's gradient shards.
        For gradient accumulation over k micro-steps call with grad_scale=1/k,
        accumulate=(i > 0), sync=(i == k - 1).
        """
        self._require_loaded()
        loss = get_loss(loss)
        if x is not None:
            x = self._input(x)
        if t is not None:
            t = self._to_device(t)             # float targets in the engine dtype, labels as is
            # check the targets on every rank before any communication (under pp the loss
            # itself runs on the last stage only): a shape-only stand-in for the output
            stand_in = self.xp.broadcast_to(self.xp.zeros((), self.dtype),
                                            (t.shape[0], self.model.d_out))
            loss.check(stand_in, t)
        if not accumulate:
            self.zero_grad()
        self.grad_sync.begin(overlap=sync)     # only a syncing backward may communicate
        self._drop_tape()
        value, _ = self.runner.train_step(x, t, loss, grad_scale)
        if sync:
            self.sync_grads()
            value = self.global_mean(value)
        return value, self.grads

    def global_mean(self, value: float) -> float:
        """Mean of a per-rank scalar over the data axes (and from the last pp stage)."""
        v = np.array([value], dtype=np.float64)
        if self.layout.size("pp") > 1:
            v = self.broadcast(v, root=self.layout.size("pp") - 1, group="pp")
        if self.data_parallel_size > 1:
            v = self.all_reduce(v, op="avg", group=DATA_AXES)
        return float(self.backend.to_host(v)[0])

    # -- what the optimizer sees ---------------------------------------------------------------
    def replication(self, name) -> int:
        """Number of ranks holding an identical copy of this rank's block of `name` (the
        product of the mesh axes it is replicated on, pp excluded: a parameter lives on one
        stage). Norms divide each rank's local sum of squares by it, so a replicated
        parameter is counted once and a sharded one summed over its shards.
        It describes the gradient/optimizer block (grad_placements: under ZeRO-1/2 the owned
        fsdp slice, not the replicated parameter)."""
        placement = self.grad_placements[name]
        r = 1
        for axis in self.layout.sizes:
            if axis != "pp" and placement.is_replicated_on(axis):
                r *= self.mesh.size(axis)
        return r

    def optimizer_shards(self):
        """(name, param block, grad block, replication) for every block this rank updates.

        The optimizer updates exactly these arrays in place and keeps its state shaped like
        them, so optimizer state has the sharding of its parameter. ZeRO-1/2 override this to
        hand out only the owned slice."""
        owned = self.access.owned              # FSDP ZeRO-1/2: the owned slice (a view)
        return [(n, owned(n), self.grads[n], self.replication(n)) for n in self.params]

    def after_optimizer_step(self) -> None:
        """Hook run by the optimizer after it updated its shards (ZeRO-1/2 all-gather here)."""
        self.access.after_optimizer_step()

    def block_region(self, name, which: str = "param"):
        """Where this rank's block of `name` sits in the full array: a list of (start, stop)
        per dim (padding excluded) — the block's first stop-start entries along each dim are
        real data. which='param' is the stored parameter block; which='optimizer' the block
        handed out by optimizer_shards() (ZeRO-1/2 override it). Checkpoints use this."""
        placement = self.grad_placements[name] if which == "optimizer" else \
            self.placements[name]                 # ZeRO-1/2: the owned fsdp slice
        ranges, _ = pl.local_slices(self.full_shapes[name], placement, self.layout.sizes,
                                    self.mesh.coords)
        return ranges

    # -- full views ----------------------------------------------------------------------------
    def _gather_full(self, local: dict, placements: dict | None = None) -> dict:
        placements = self.placements if placements is None else placements
        out = {}
        pp = self.layout.size("pp")
        for name, info in self.plan.items():
            full = None
            if info.placement.stage == self.stage:
                if info.placement.held_at(self.mesh.coords):
                    full = pl.gather_array(self, local[name], placements[name], info.full_shape)
                for axis, coord in info.placement.owner.items():   # e.g. an expert's ep rank
                    full = self.broadcast(full, root=coord, group=axis)
            if pp > 1:
                full = self.broadcast(full, root=info.placement.stage, group="pp")
            if full is local.get(name):        # unsharded: hand out a copy, never the live array
                full = full.copy()
            out[name] = full
        return out

    def gather_params(self) -> dict:
        """Collective: the full-shape parameter dict on every rank."""
        self._require_loaded()
        return self._gather_full(self.params)

    def gather_grads(self, grads: dict | None = None) -> dict:
        """Collective: full-shape gradients on every rank."""
        self._require_loaded()
        return self._gather_full(self.grads if grads is None else grads, self.grad_placements)

    def memory_report(self, optimizer=None) -> dict:
        """Bytes this rank holds, measured from its arrays (no communication):

        params         parameter storage (padding included; views counted once, by buffer)
        grads          gradient storage, with the full gradient buffers ZeRO-1 keeps
        optimizer      the arrays in `optimizer.state` (0 without an optimizer)
        gathered_peak  the most bytes of all-gathered (FSDP ZeRO-3) weights alive at once
        total          their sum
        """
        def held(arrays):
            buffers = {}
            for a in arrays:
                while getattr(a, "base", None) is not None and hasattr(a.base, "nbytes"):
                    a = a.base                         # a view: count the buffer it lives in
                buffers[id(a)] = int(a.nbytes)
            return sum(buffers.values())

        extra_grads = getattr(self.access, "grad_buffers", {})
        state = getattr(optimizer, "state", {}) if optimizer is not None else {}
        report = {
            "params": held(self.params.values()),
            "grads": held(list(self.grads.values()) + list(extra_grads.values())),
            "optimizer": held(v for entry in state.values() for v in entry.values()
                              if hasattr(v, "nbytes") and getattr(v, "ndim", 0) > 0),
            "gathered_peak": int(getattr(self.access, "peak_gathered_bytes", 0)),
        }
        report["total"] = sum(report.values())
        return report

    def inference_loop(self, input_stream, output_stream) -> None:
        if self.layout.size("pp") > 1:
            return self.runner.inference_loop(input_stream, output_stream)
        return super().inference_loop(input_stream, output_stream)

    def __repr__(self):
        return f"MeshEngine({self.model!r}, layout={self.layout.text!r}, rank={self.device_id})"


def make_engine(model, layout="single", dtype=np.float64, comm=None, device="cpu", debug=None):
    """Build the engine for `layout` on every rank (SPMD). See MeshEngine."""
    return MeshEngine(model, layout, comm=comm, dtype=dtype, device=device, debug=debug)

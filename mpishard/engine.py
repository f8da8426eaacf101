"""ShardedEngine: devices, collectives and a model split over a device mesh.

`ShardedEngine` is the public surface: device identity, the collectives and point-to-point
calls (each with `group=` naming a mesh axis; every one a call on its `Comm`,
comm/collectives.py), `load_checkpoint`, `forward`, `backward`, `close`, `inference_loop`.
`MeshEngine`, the one concrete engine, orchestrates what `parallel.compose` builds from (model,
layout): a parameter store, the gradient sync, an access policy, the stage's layers, a runner:

    train_step  ->  runner.train_step (layers: forward, loss, backward; tp/fsdp/pp/ep
                    communication inside the layers and the runner; then access.end_backward)
                ->  sync_grads: access.finish_grads (fsdp), grad_sync.sync (dp all_reduce)
"""
from __future__ import annotations

import functools
from abc import ABC, abstractmethod

import numpy as np
from mpi4py import MPI

from .comm.backend import Backend
from .comm.collectives import Comm
from .comm.mesh import AVERAGE_AXES, DATA_AXES, DeviceMesh, parse_layout
from .health import flight, uncaught
from .health.debug import signature_check
from .health.heap import keep_host_heap
from .health.signals import remove_singleton_segment_at_exit
from .health.threads import pin_blas_threads
from .health.watchdog import DEFAULT_TIMEOUT, Watchdog
from .models import ARCHITECTURES
from .nn.gemm import widened
from .nn.losses import get_loss
from .nn.params import ParamSpec
from .parallel.compose import compose
from .parallel.decode import generate as generate_ids
from .parallel.pipeline import step_microbatches
from .parallel.precision import Precision
from .parallel.token_batch import (check_targets, count_targets, global_mean, local_rows,
                                   set_documents, step_loss)
from .parallel.tracing import trace_engine


def _comm_method(name):
    """An engine method that calls the engine's Comm method `name` (same signature and doc)."""
    @functools.wraps(getattr(Comm, name))
    def method(self, *args, **kwargs):
        return getattr(self.comm, name)(*args, **kwargs)
    return method


class ShardedEngine(ABC):
    """Device identity, point-to-point and collective calls, the inference loop; subclasses
    implement `load_checkpoint`, `forward` and `backward`. Debug mode (`MPISHARD_DEBUG=1` or
    `debug=True`): every collective first compares op, dtype and shape across its group and
    raises `CollectiveMismatchError` on every rank."""

    def __init__(self, layout="single", comm=None, dtype=np.float64, device="cpu", debug=None,
                 cuda_aware=None, timeout=DEFAULT_TIMEOUT, blas_threads="auto",
                 host_heap=None, gpu_comm="auto", device_rank=None):
        world = MPI.COMM_WORLD if comm is None else comm
        self.layout = parse_layout(layout)
        self.host_heap = keep_host_heap(host_heap)        # health/heap.py: opt-in, no MPI
        self.mesh = DeviceMesh(world, self.layout)  # raises on a world-size mismatch
        remove_singleton_segment_at_exit(world)   # Open MPI's leak (health/signals.py)
        self.blas_threads = pin_blas_threads(world, blas_threads)    # health/threads.py
        self.backend = device if isinstance(device, Backend) else Backend(
            device, world, cuda_aware, gpu_comm=gpu_comm, local_rank=device_rank)
        self.xp = self.backend.xp
        self.dtype = np.dtype(dtype)
        self.comm = Comm(self.mesh, self.backend, watchdog=Watchdog(self.mesh, timeout),
                         flight=flight.FlightRecorder.shared(), check=signature_check(debug))
        self.optimizer_ref = None         # the optimizer last built on it (train/optim.py)
        self.kept_optimizer_state = None  # (state, blocks) a restore kept for the next one

    # -- identity ------------------------------------------------------------------------------
    mpi_comm = property(lambda self: self.mesh.world,
                        doc="The engine's mpi4py communicator (its world), for control data.")
    device_id = property(lambda self: self.mesh.rank, doc="This device's rank in mpi_comm.")
    num_devices = property(lambda self: self.mesh.world.Get_size(), doc="World size.")

    debug = property(lambda self: self.comm.debug,
                     lambda self, value: setattr(self.comm, "check", signature_check(bool(value))))

    def group_size(self, group=None) -> int:
        return self.mesh.size(group) if group is not None else self.num_devices

    def group_rank(self, group=None) -> int:
        return self.mesh.coord(group) if group is not None else self.device_id

    # -- communication statistics (per rank) ---------------------------------------------------
    comm_bytes = property(lambda self: self.comm.stats.bytes, doc="bytes sent per kind (ring)")
    comm_calls = property(lambda self: self.comm.stats.calls, doc="calls per kind")
    comm_time = property(lambda self: self.comm.stats.time, doc="seconds per kind")
    trace = trace_engine          # engine.trace(DIR): spans of every rank -> DIR/trace.json

    def reset_comm_stats(self) -> None:
        self.comm.stats.reset()

    # -- the collectives and point-to-point calls: the engine's Comm ---------------------------
    barrier = _comm_method("barrier")
    send = _comm_method("send")
    receive = _comm_method("receive")
    send_async = _comm_method("send_async")
    receive_async = _comm_method("receive_async")
    all_reduce = _comm_method("all_reduce")
    all_reduce_async = _comm_method("all_reduce_async")
    all_gather = _comm_method("all_gather")
    all_gather_async = _comm_method("all_gather_async")
    reduce_scatter = _comm_method("reduce_scatter")
    all_to_all = _comm_method("all_to_all")
    all_to_all_v = _comm_method("all_to_all_v")
    broadcast = _comm_method("broadcast")
    agree = _comm_method("agree")

    # -- lifetime ------------------------------------------------------------------------------
    def close(self) -> None:
        """Give back what the engine holds in MPI (sends completed, receives cancelled,
        communicators freed, arrival counters returned), on every rank, in the order the engines
        were built; twice does nothing; then every call raises CommUnusable. (comm/retired.py:
        an engine never closed keeps them until it is collected.)"""
        self._close(collective=True)
        uncaught.release(self)            # make_engine's error report, if it installed it

    def _close(self, collective: bool) -> None:
        if not self.mesh.closed:
            try:
                self.comm.close(collective)
            finally:
                self.mesh.close() if collective else self.mesh.keep()   # (Comm.close)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc) -> None:
        """On an exception (perhaps on this rank alone) nothing is waited for (Comm.close)."""
        self._close(collective=exc_type is None)

    # -- model lifecycle -----------------------------------------------------------------------
    @abstractmethod
    def load_checkpoint(self, params: dict) -> None: ...

    @abstractmethod
    def forward(self, x): ...

    @abstractmethod
    def backward(self, grads) -> dict: ...

    def inference_loop(self, input_stream, output_stream) -> None:
        """Forward each array of `input_stream` into `output_stream`, until it is exhausted."""
        for x in iter(input_stream):
            output_stream.write(self.predict(x) if hasattr(self, "predict") else self.forward(x))


class MeshEngine(ShardedEngine):
    """Any layout: data, fsdp, tensor, pipeline (and expert) parallel pieces composed.

    Parameters
    ----------
    model : a registered spec (models.ARCHITECTURES: ms.MLP, ms.GPT, ms.Llama, ...)
    layout : str  e.g. "dp=2,tp=2", "fsdp=4,zero=2", "pp=4,microbatches=8,schedule=1f1b"
    comm : mpi4py communicator (default COMM_WORLD)
    dtype : np.float64 or np.float32 (parameters, activations and gradients)
    device : "cpu", "gpu" or "auto" (cupy when a GPU is visible), or a comm.backend.Backend
    cuda_aware : None asks the MPI library (comm/gpu.py); True/False overrides its answer
    param_dtype, comm_dtype : "bfloat16"/"float16" with dtype=float32 (parallel/precision.py)
    compute_dtype : "bfloat16"/"float16": matmul inputs and outputs in 16 bits (on a device
        real 16-bit arrays on the tensor cores, nn/gemm.py; on numpy rounded and held in
        float32), softmax, norms and the loss in dtype=float32, as torch.autocast
        (nn/autocast.py); tf32: float32 matmuls in TF32 (cuBLAS's on cupy)
    gpu_comm : "auto", "nccl", "mpi" (CUDA-aware) or "staged" (through host memory): comm/backend
    timeout : seconds any collective or receive may wait (CollectiveTimeout after); 0: off
    blas_threads : "auto" (a node's ranks split its cores; logged), None (as is), int (threads.py)
    host_heap : None (malloc as is) or "keep": freed arrays under 32 MiB stay in glibc's heap
        instead of being page-faulted in again every step (process-wide mallopt; health/heap.py)
    device_rank : the node-local rank picking the GPU (None: comm's; serve's replicas: the job's)
    """

    def __init__(self, model, layout="single", comm=None, dtype=np.float64, device="cpu",
                 debug=None, cuda_aware=None, param_dtype=None, comm_dtype=None,
                 timeout=DEFAULT_TIMEOUT, blas_threads="auto", host_heap=None,
                 compute_dtype=None, tf32=False, gpu_comm="auto", device_rank=None):
        dtype = np.dtype(dtype)
        self.precision = Precision(dtype, param_dtype, comm_dtype, compute_dtype, tf32)  # no MPI
        super().__init__(layout, comm, dtype, device, debug, cuda_aware, timeout, blas_threads,
                         host_heap, gpu_comm, device_rank)
        if not isinstance(model, ParamSpec):           # every spec's base (models/interface.py)
            names = ", ".join(f"ms.{cls.__name__}" for cls in ARCHITECTURES.values())
            raise TypeError(f"model must be a model spec ({names}), got {type(model).__name__}")
        self.model = model
        parts = compose(model, self.layout, self.comm, self.dtype, self.precision)
        self.plan, self.store, self.stats = parts.plan, parts.store, parts.stats
        self.grad_sync, self.access = parts.grad_sync, parts.access
        self.chunks, self.runner, self.output = parts.chunks, parts.runner, parts.output
        self.meter = parts.meter               # activation bytes on the tapes (memory_report)
        self.documents = parts.documents       # packed rows' document ids, for the units
        self.stage = self.mesh.coords["pp"]
        self.microbatches = step_microbatches(self.layout)   # a train_step's, 1 without pp
        self.loaded = False

    # -- the parameter store's views -----------------------------------------------------------
    params = property(lambda self: self.store.params, doc="local parameter blocks by name")
    grads = property(lambda self: self.store.grads, doc="local gradient blocks by name")
    placements = property(lambda self: self.store.placements)
    grad_placements = property(lambda self: self.store.grad_placements)
    full_shapes = property(lambda self: self.store.full_shapes)
    local_names = property(lambda self: self.store.local_names)
    layers = property(lambda self: [layer for chunk in self.chunks for layer in chunk])

    # -- checkpoint in -------------------------------------------------------------------------
    def load_checkpoint(self, params: dict) -> None:
        """Every rank passes the full dict (arrays or lazily loaded arrays); each keeps only
        its shards. Raises the same ValueError on every rank for a missing/misshaped key."""
        self.model.check_params(params)
        self.store.load(params)
        for layer in self.layers:
            layer.clear()
        self.access.on_load()                  # FSDP ZeRO-1/2: padded parameter buffers
        self.grad_sync.on_load()               # buckets over the new gradient arrays
        self.loaded = True

    def _require_loaded(self):
        if not self.loaded:
            raise RuntimeError("call engine.load_checkpoint(params) before running the model")

    # -- data ----------------------------------------------------------------------------------
    data_parallel_size = property(lambda self: self.mesh.size(DATA_AXES))
    data_parallel_rank = property(lambda self: self.mesh.coord(DATA_AXES))

    def shard_batch(self, arr):
        """The rows of a global batch this rank is fed: block data_parallel_rank of
        data_parallel_size along axis 0 (tp, pp peers: the same rows; cp: shard_sequence)."""
        return self._to_device(local_rows(arr, self.mesh))

    def _to_device(self, a):
        a = self.backend.asarray(a)
        if a.dtype.kind == "f" and a.dtype != self.dtype:
            a = a.astype(self.dtype)
        return a

    def gather_batch(self, y_local):
        """Concatenate per-rank outputs (rows) over the data axes: the global batch's output.
        Under pp the output lives on the last stage and is broadcast to the others."""
        if self.layout.size("pp") > 1:
            y_local = self.comm.broadcast(y_local, root=self.layout.size("pp") - 1, group="pp")
        y_local = self.output.gather(y_local)  # vocab shards (GPT under tp) -> full width
        if self.data_parallel_size == 1:
            return y_local
        return self.comm.all_gather(y_local, axis=0, group=DATA_AXES)

    def _input(self, x):
        """x on the device as the model takes it (model.check_input; ValueError if wrong)."""
        return self.model.check_input(self.backend.asarray(x), self.dtype)

    # -- compute -------------------------------------------------------------------------------
    def forward(self, x, mb: int = 0, documents=None):
        """Forward this rank's rows, recording activations for `backward` (documents: see
        train_step); logits a 16-bit step's head keeps in 16 bits come back as float32."""
        self._require_loaded()
        x = None if x is None else self._input(x)
        set_documents(self.documents, documents, x, self._to_device, 1, mb)
        self._drop_tape(mb)          # a forward that never got its backward is forgotten
        return widened(self.runner.forward(x, mb=mb, record=True))

    def _drop_tape(self, mb=None) -> None:
        """Forget saved activations (microbatch `mb`'s, or all), as a PyTorch re-run does."""
        for layer in self.layers:
            layer.clear() if mb is None else layer.forget(mb)

    def predict(self, x, documents=None):
        """Forward without an activation tape (inference; documents: as train_step's)."""
        self._require_loaded()
        x = None if x is None else self._input(x)
        set_documents(self.documents, documents, x, self._to_device, 1, -1)
        return self.runner.forward(x, mb=-1, record=False)

    generate = generate_ids      # generate(prompts, max_new_tokens, ...): parallel/decode.py

    def zero_grad(self) -> None:
        self.store.zero_grads()
        self.access.zero_grad()                # FSDP ZeRO-1: its full gradient buffers

    def backward(self, dy, mb: int = 0, accumulate: bool = False, sync: bool = True) -> dict:
        """dy: dL/dy of this rank's local-mean loss. Returns this rank's gradient shards
        (averaged over the data axes when sync=True), keyed by full parameter names.
        accumulate=True adds to the gradients already held (gradient accumulation)."""
        self._require_loaded()
        self._begin_backward(accumulate, sync)
        self.runner.backward(None if dy is None else self._to_device(dy), mb=mb)
        self._end_backward(sync)
        return self.grads

    def _begin_backward(self, accumulate, sync) -> None:
        if not accumulate:
            self.zero_grad()
        self.grad_sync.begin(overlap=sync)     # only a syncing backward may communicate

    def _end_backward(self, sync) -> None:
        self.access.end_backward()             # FSDP ZeRO-2/3: the last gradient bucket
        if sync:
            self.sync_grads()

    def sync_grads(self) -> None:
        """Average gradients over the data axes on which they are replicated (collective)."""
        self.access.finish_grads()             # FSDP: reduce-scatter what is still full
        self.grad_sync.sync(self.grads)

    def train_step(self, x, t, loss, *, accumulate: bool = False, sync: bool = True,
                   grad_scale: float = 1.0, count=None, documents=None):
        """One forward + loss + backward. Returns (loss, grads).

        loss: the global mean loss, the same float on every rank (with sync=False, the
        local mean, without communication). grads: this rank's gradient shards.
        For gradient accumulation over k micro-steps call with grad_scale=1/k,
        accumulate=(i > 0), sync=(i == k - 1).
        count: the counted targets of the global batch, all micro-steps' (count_targets): the
        loss is sum(token losses) / count (grad_scale then without 1/k); None: each rank's
        mean over its own. documents: the rows' (rows, T) ids (nn/documents.py) or None.
        """
        self._require_loaded()
        loss = self.output.loss(get_loss(loss))   # GPT under tp: vocab-parallel cross-entropy
        loss = step_loss(loss, count, self.mesh.size(AVERAGE_AXES), self.microbatches)
        x = None if x is None else self._input(x)
        set_documents(self.documents, documents, x, self._to_device, self.microbatches, 0)
        if t is not None:                      # float targets in the engine dtype, labels as is
            t = check_targets(loss, self._to_device(t), self.model, self.xp, self.dtype)
        self._begin_backward(accumulate, sync)
        self._drop_tape()
        self.meter.reset_peak()                # activations_peak: this step's
        value = float(self.runner.train_step(x, t, loss, grad_scale)[0])  # read: backward out
        self._end_backward(sync)
        return (self.global_mean(value) if sync else value), self.grads

    def count_targets(self, t, loss="cross_entropy") -> int:
        """Collective (data axes, cp): the targets `loss` counts in all ranks' `t`."""
        return count_targets(self.comm, self.mesh, get_loss(loss), self.backend.asarray(t))

    def global_mean(self, value: float) -> float:
        """Mean of a per-rank scalar over the data axes and cp (and from the last pp stage)."""
        return global_mean(self.comm, self.mesh, value)

    # -- what the optimizer and checkpoints see ------------------------------------------------
    def replication(self, name) -> int:
        """Ranks holding an identical copy of this rank's gradient/optimizer block of `name`
        (see ParamStore.replication)."""
        return self.store.replication(name)

    def optimizer_shards(self):
        """(name, param block, grad block, replication) for every block this rank updates in
        place; optimizer state is shaped like them (ZeRO-1/2: the owned fsdp slice)."""
        owned = self.access.owned
        return [(n, owned(n), self.grads[n], self.replication(n)) for n in self.params]

    def after_optimizer_step(self) -> None:
        """Run by the optimizer after it updated its shards (ZeRO-1/2 all-gather here)."""
        self.access.after_optimizer_step()

    # -- full views ----------------------------------------------------------------------------
    def gather_params(self) -> dict:
        """Collective: the full-shape parameter dict on every rank."""
        self._require_loaded()
        return self.store.gather_full(self.comm, self.params, self.placements)

    def gather_grads(self, grads: dict | None = None) -> dict:
        """Collective: full-shape gradients on every rank."""
        self._require_loaded()
        return self.store.gather_full(self.comm, self.grads if grads is None else grads,
                                      self.grad_placements)

    def memory_report(self, optimizer=None) -> dict:
        """Bytes this rank holds, from its arrays (no communication): params, grads, optimizer,
        gathered_peak (FSDP ZeRO-3), activations_peak (the last train_step's tapes), total."""
        return self.store.memory_report(self.access, optimizer, self.meter)

    def inference_loop(self, input_stream, output_stream) -> None:
        if self.layout.size("pp") > 1:
            return self.runner.inference_loop(input_stream, output_stream, prepare=self._input)
        return super().inference_loop(input_stream, output_stream)

    def __repr__(self):
        return f"MeshEngine({self.model!r}, layout={self.layout.text!r}, rank={self.device_id})"


class SingleDevice(MeshEngine):
    """The one-device reference for every layout (COMM_SELF unless a size-1 comm is given)."""

    def __init__(self, model, dtype=np.float64, comm=None, device="cpu", **options):
        super().__init__(model, "single", comm=MPI.COMM_SELF if comm is None else comm,
                         dtype=dtype, device=device, **options)


def make_engine(model, layout="single", dtype=np.float64, comm=None, device="cpu",
                report_errors=True, **options):
    """Build the engine for `layout` on every rank (SPMD); options: see MeshEngine.

    dtype defaults to float64, the exact reference every layout is tested against (the
    `train` command defaults to float32 for speed). report_errors: an uncaught exception ends
    the job with one report per distinct cause (health/uncaught.py's sys.excepthook, until
    every engine that installed it is closed); False keeps Python's hook."""
    return uncaught.held_by(lambda: MeshEngine(model, layout, comm=comm, dtype=dtype,
                                               device=device, **options), report_errors)

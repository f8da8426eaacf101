"""Mixed precision: parameters stored, and gradients communicated, in 16 bits; matmuls
rounded to 16 bits (or TF32); everything else in fp32.

`make_engine(model, layout, dtype=np.float32, param_dtype="bfloat16", comm_dtype="bfloat16",
compute_dtype="bfloat16", tf32=False)` (engine keywords, not layout options: they are engine
settings, like `dtype`). param_dtype and comm_dtype default to `dtype`, compute_dtype to None
(= `dtype`); the 16-bit ones are "bfloat16" (ml_dtypes on CPU) and "float16".

    what                          dtype
    parameters (store, fsdp)      param_dtype    all-gathered under fsdp in param_dtype too
    matmul inputs and outputs     compute_dtype  rounded to 16 bits, products and sums in
                                                 fp32 (nn/autocast.py, torch.autocast's
                                                 policy): real 16-bit arrays on a device
                                                 (Narrow, nn/gemm.py's tensor-core GEMMs),
                                                 held in fp32 on numpy; tf32=True: cuBLAS's
                                                 TF32 on cupy, inputs rounded to TF32 else
    saved activations             compute_dtype  the rounded matmul inputs (2 bytes an element
                                                 on a device, 4 on numpy)
    other layer math              dtype (fp32)   softmax, norms, the loss, reductions, the
                                                 residual stream; CastingAccess.get casts
                                                 each stored weight up, Precision.autocast
                                                 rounds it at each matmul
    gradients (store)             dtype (fp32)   CastingAccess.add_grad accumulates in fp32
    gradient communication        comm_dtype     LowPrecisionComm: the sum itself is fp32
    master weights                fp32           the optimizer's state 'master' (optim.py)

float16 anywhere (param_dtype, comm_dtype or compute_dtype) needs a loss scale
(`needs_loss_scaling`: the Trainer makes a GradScaler).

Gradient reductions in comm_dtype with an fp32 sum (MPI has no bfloat16 sum, and a 16-bit
running sum over many ranks loses digits). With n ranks and x_r this rank's (flat) array, cut
into n chunks x_r[j]:

    reduce_scatter(sum)  = all_to_all of c(x_r[j])                   (comm_dtype on the wire)
                           -> sum_r f32(c(x_r[j]))                   (local fp32 sum, rank order)
    all_reduce(sum)      = that reduce_scatter
                           -> all_gather of c(sum)                   (comm_dtype on the wire)

with c = round to comm_dtype. Bytes sent per rank: (n-1)/n of the array twice, at 2 bytes an
element: half of a float32 all_reduce's 2 (n-1)/n * 4. The all_reduce result is the same on
every rank: c(sum_r c(x_r)) in fp32. Adjoints as for the float32 calls: all_reduce(sum) is its
own adjoint; reduce_scatter's is all_gather (the parameters' all_gather under fsdp, which moves
param_dtype bits unchanged).

Non-reducing calls (all_gather, all_to_all) move 16-bit arrays as their raw 2-byte words
(viewed as float16, which MPI moves without arithmetic), so bfloat16 needs no MPI type.

On a device (cupy, or the test suite's stand-in for it) a bf16 parameter or gradient chunk
is held, and sent, as its uint16 words (cupy before 14 had no bfloat16; 14.2's batched
matmul still refuses it; the 16-bit compute's matmul inputs are real bfloat16 arrays),
converted to and from fp32 by bf16.py's kernels (bit for bit what ml_dtypes does on the
host, so a device run equals the host's). `held` says which dtype an array of a precision
dtype has on `xp`; `narrow` (fp32 -> 16 bits, rounding),
`widen` (16 bits -> fp32, exact) and `assign` are the only casts the store, the optimizer's
masters and the checkpoint writer make. `precision.param` and `.comm` stay the logical dtypes
(ml_dtypes.bfloat16 names a bf16 run on any device); a uint16 array here is always bf16 words.
"""
from __future__ import annotations

import logging
from functools import partial

import ml_dtypes
import numpy as np

from ..nn.autocast import FULL, Narrow, Rounding, round_tf32
from ..nn.functional import array_module
from . import bf16
from . import placement as pl

LOW = {"bfloat16": np.dtype(ml_dtypes.bfloat16), "float16": np.dtype(np.float16)}
WIRE = np.dtype(np.float16)          # how 2-byte floats travel through non-reducing MPI calls


def low_dtype(value, what: str, compute) -> np.dtype:
    """`value` (None, a name or a dtype) as a dtype: the compute dtype or a 16-bit float."""
    compute = np.dtype(compute)
    if value is None:
        return compute
    try:
        dtype = LOW[value] if isinstance(value, str) and value in LOW else np.dtype(value)
    except TypeError:
        dtype = None
    if dtype not in (compute, *LOW.values()):
        raise TypeError(f"{what} must be one of {[compute.name, *LOW]} (or None: the compute "
                        f"dtype), got {value!r}")
    if dtype != compute and compute != np.dtype(np.float32):
        raise TypeError(f"{what}={dtype.name} needs dtype=float32 (mixed precision computes "
                        f"in fp32), got dtype={compute.name}")
    return dtype


COMPUTE_DTYPES = ("bfloat16", "float16", "float32")
"""compute_dtype's names: the dtype of matmul inputs and outputs and of the activations saved
for backward (torch.autocast's policy; softmax, norms, the loss and reductions stay in dtype)."""


def matmul_dtype(value, dtype) -> np.dtype | None:
    """compute_dtype as the 16-bit dtype matmuls round to, or None (matmuls in `dtype`)."""
    if value is None or (isinstance(value, str) and value == np.dtype(dtype).name):
        return None
    if not (isinstance(value, str) and value in COMPUTE_DTYPES):
        raise TypeError(f"compute_dtype must be one of {list(COMPUTE_DTYPES)} or None (= "
                        f"dtype), got {value!r}")
    if np.dtype(dtype) != np.dtype(np.float32):
        raise TypeError(f"compute_dtype={value} needs dtype=float32 (master weights in fp32, "
                        f"as under torch.autocast), got dtype={np.dtype(dtype).name}")
    return LOW[value]


class Precision:
    """The dtypes of one engine: compute, parameter storage, gradient communication, and the
    matmuls' 16-bit compute dtype (`matmul`, None: `compute`) and TF32 opt-in (`tf32`)."""

    def __init__(self, dtype, param_dtype=None, comm_dtype=None, compute_dtype=None,
                 tf32=False):
        self.compute = np.dtype(dtype)
        if self.compute not in (np.dtype(np.float32), np.dtype(np.float64)):
            raise TypeError(f"dtype must be float32 or float64, got {self.compute}")
        self.param = low_dtype(param_dtype, "param_dtype", self.compute)
        self.comm = low_dtype(comm_dtype, "comm_dtype", self.compute)
        self.matmul = matmul_dtype(compute_dtype, self.compute)
        if tf32 not in (True, False):
            raise TypeError(f"tf32 must be True or False, got {tf32!r}")
        if tf32 and (self.compute != np.dtype(np.float32) or self.matmul is not None):
            raise TypeError("tf32=True applies to float32 matmuls: it needs dtype=float32 and "
                            "no 16-bit compute_dtype")
        self.tf32 = bool(tf32)

    @property
    def mixed(self) -> bool:
        return self.param != self.compute or self.comm != self.compute

    @property
    def needs_loss_scaling(self) -> bool:
        """float16 has 5 exponent bits: small gradients flush to zero without a loss scale."""
        return np.dtype(np.float16) in (self.param, self.comm, self.matmul)

    def wrap_comm(self, comm):
        """The Comm the gradient sync and fsdp use: `comm` itself unless something is 16-bit."""
        return LowPrecisionComm(comm, self.compute, self.comm) if self.mixed else comm

    def autocast(self, xp=np):
        """The matmul policy the layers get (nn/autocast.py) for arrays of `xp`.

        16-bit compute: on numpy, inputs and outputs rounded to `matmul` and held in float32
        (`Rounding`); on a device (cupy, or the CPU stand-in), real 16-bit arrays multiplied
        on the tensor cores (`Narrow`, nn/gemm.py). tf32: on cupy, cuBLAS's TF32 compute
        type around each layer matmul (`CublasTF32`); elsewhere inputs rounded to TF32.
        Otherwise FULL (nothing rounded)."""
        if self.matmul is not None:
            if xp is not np and holds(xp, self.matmul):  # cupy 13 has no bfloat16: emulated
                return Narrow(self.matmul)
            if xp is not np:
                logging.getLogger("mpishard").warning(
                    "compute dtype %s is emulated on this device (float32 GEMMs, no tensor "
                    "cores): %s %s has no %s dtype; cupy >= 14 has (pip install "
                    "'cupy-cuda12x>=14', Python >= 3.10, NumPy >= 2)", self.matmul.name,
                    getattr(xp, "__name__", "the array module"),
                    getattr(xp, "__version__", ""), self.matmul.name)
            to_16 = partial(round_to, dtype=self.matmul)
            return Rounding(to_16, to_16, self.matmul.name)
        if not self.tf32:
            return FULL
        if getattr(xp, "__name__", "") == "cupy":
            return CublasTF32()
        return Rounding(round_tf32, None, "tf32")

    def wrap_access(self, access):
        """The access policy the layers use: casting when parameters are stored in 16 bits."""
        if self.param == self.compute:
            return access
        return CastingAccess(access, self.compute, access.store.xp)

    def __repr__(self):
        matmul = "" if self.matmul is None else f", matmul={self.matmul.name}"
        return (f"Precision(compute={self.compute.name}, param={self.param.name}, "
                f"comm={self.comm.name}{matmul}{', tf32' if self.tf32 else ''})")


class CublasTF32(Rounding):
    """tf32=True on cupy: the layers' float32 matmuls on cuBLAS's TF32 tensor cores
    (CUBLAS_COMPUTE_32F_FAST_TF32: cuBLAS rounds the inputs), and no other product. cupy's
    compute type is a setting of the process, so this policy switches it to TF32 as a layer
    takes a matmul's inputs (`round`; `enter` for a weight gradient whose inputs were taken
    earlier) and back to what it was as the layer takes the output (`output`). The products
    the layers use as reductions in between (LayerNorm's row sums and variance, bias
    gradients), other engines and the user's own cupy code keep full float32, as PyTorch's
    allow_tf32 leaves its reductions. A product a layer runs without `round` or `enter` first
    stays float32 (slower, never less exact)."""

    def __init__(self):
        from cupy._core import _routines_linalg as linalg

        self._set = partial(linalg.set_compute_type, np.float32)
        self._on, self._off = linalg.COMPUTE_TYPE_TF32, linalg.get_compute_type(np.float32)
        super().__init__(None, None, "tf32")          # round is its own (cuBLAS rounds)

    def round(self, x):
        """x itself, with TF32 switched on for the matmul it goes into."""
        self.enter()
        return x

    def enter(self):
        self._set(self._on)

    def output(self, y):
        """y itself, with cupy's compute type back to what it was."""
        self._set(self._off)
        return y


def holds(xp, dtype) -> bool:
    """Can arrays of `xp` have `dtype` (cupy 14's bfloat16 yes, cupy 13's no)?"""
    try:
        xp.zeros(1, dtype=dtype)
    except (TypeError, ValueError):
        return False
    return True


def held(dtype, xp) -> np.dtype:
    """The dtype an array of `dtype` has on `xp`: bfloat16 off the host as uint16 words."""
    dtype = np.dtype(dtype)
    return bf16.WORD if dtype == LOW["bfloat16"] and xp is not np else dtype


def narrow(x, dtype, xp):
    """x (a float array on xp) rounded to `dtype`, as held on xp."""
    if held(dtype, xp) == bf16.WORD:
        return x if x.dtype == bf16.WORD else bf16.to_words(xp, x)
    return x.astype(dtype, copy=False)


def widen(a, compute, xp):
    """A held array (16-bit or not) in the compute dtype: exact."""
    if a.dtype == bf16.WORD:
        return bf16.to_float32(xp, a).astype(compute, copy=False)
    return a.astype(compute, copy=False)


def round_to(x, dtype):
    """x (float32) rounded to the 16-bit `dtype` and held in float32 again (on a device:
    bf16 through bf16.py's word kernels), nearest even: the value a 16-bit matmul sees."""
    xp = array_module(x)
    return widen(narrow(x, dtype, xp), x.dtype, xp)


def assign(param, x, xp) -> None:
    """param[...] = x rounded to param's dtype (bf16 words: through the conversion)."""
    param[...] = bf16.to_words(xp, x) if param.dtype == bf16.WORD else x


def shard_held(full, placement, sizes, coords, xp, dtype, compute):
    """placement.shard_array as held on xp: a bf16 block on a device is cut in the compute
    dtype (from float64: through float32, as ml_dtypes rounds) and narrowed to words."""
    cut = compute if held(dtype, xp) == bf16.WORD else dtype
    return narrow(pl.shard_array(full, placement, sizes, coords, xp, cut), dtype, xp)


def to_wire(a):
    """A 16-bit float array (bf16 words too) as raw float16 words (a view); others as they are."""
    return a.view(WIRE) if a.dtype in LOW.values() or a.dtype == bf16.WORD else a


class CastingAccess:
    """An access policy wrapping the real one (LocalAccess or FSDPAccess, layers.py): `get`
    hands out the stored (16-bit) weight cast to the compute dtype, `add_grad` passes the
    compute-dtype gradient on (the store's gradients are in the compute dtype). Everything
    else (release, owned, on_load, finish_grads, ...) is the wrapped policy's."""

    def __init__(self, inner, compute, xp=np):
        self.inner, self.compute, self.xp = inner, np.dtype(compute), xp

    def get(self, name, mb=0):
        w = self.inner.get(name, mb)
        return w if w.dtype == self.compute else widen(w, self.compute, self.xp)  # cast up

    def add_grad(self, name, g) -> None:
        self.inner.add_grad(name, g)           # adjoint of the cast: the fp32 gradient as is

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


class DoneFuture:
    """A Future whose work is done (the low-precision all_reduce is blocking)."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value

    def done(self) -> bool:
        return True


class WireFuture:
    """A Future of a 2-byte-word transfer; `result()` views the words as `dtype` again."""

    def __init__(self, future, dtype):
        self.future, self.dtype = future, dtype

    def result(self):
        return self.future.result().view(self.dtype)

    def done(self) -> bool:
        return self.future.done()


class LowPrecisionComm:
    """A Comm (or group view) whose sum/avg reductions of compute-dtype arrays travel in
    `comm_dtype` with an fp32 local sum (module docstring), and whose non-reducing calls
    move 16-bit arrays as raw 2-byte words. Anything else is the wrapped Comm's."""

    def __init__(self, comm, compute, comm_dtype):
        self.inner, self.compute, self.comm_dtype = comm, np.dtype(compute), np.dtype(comm_dtype)

    def group(self, axes) -> "LowPrecisionComm":
        return LowPrecisionComm(self.inner.group(axes), self.compute, self.comm_dtype)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)

    def _low(self, a, op) -> bool:
        return (op in ("sum", "avg") and a.dtype == self.compute
                and self.comm_dtype != self.compute)

    # -- reductions: comm_dtype on the wire, fp32 sums -----------------------------------------
    def sum_chunks(self, chunks, group=None):
        """chunks (n, k) in the compute dtype, row j for rank j -> (k,) fp32: sum over ranks r
        of c(rank r's row for this rank), in rank order (all_to_all in comm_dtype)."""
        xp = self.inner.xp
        low = narrow(chunks, self.comm_dtype, xp)
        got = self.inner.all_to_all(to_wire(low), axis=0, group=group)      # (n, k) words
        return widen(got.view(held(self.comm_dtype, xp)), self.compute, xp).sum(axis=0)

    def reduce_scatter(self, arr, op="sum", axis=0, group=None):
        """reduce_scatter(sum|avg) along `axis` with the sum in fp32 (the wire in comm_dtype).
        Adjoint: all_gather along `axis`."""
        xp = self.inner.xp
        a = xp.asarray(arr)
        n = self.inner.size(group)
        if not self._low(a, op) or n == 1:
            return self.inner.reduce_scatter(a, op=op, axis=axis, group=group)
        moved = xp.moveaxis(a, axis, 0)
        if moved.shape[0] % n:
            raise ValueError(f"reduce_scatter: length {moved.shape[0]} along axis {axis} is "
                             f"not divisible by the group size {n}")
        mine = self.sum_chunks(xp.ascontiguousarray(moved).reshape(n, -1), group)
        if op == "avg":
            mine /= n
        out = mine.reshape((moved.shape[0] // n,) + tuple(moved.shape[1:]))
        return xp.moveaxis(out, 0, axis)

    def all_reduce(self, arr, op="sum", group=None, out=None):
        """all_reduce(sum|avg) as reduce_scatter (fp32 sum) + all_gather, both in comm_dtype:
        every rank gets c(sum_r c(x_r)) (avg: divided by n before the rounding). Adjoint:
        all_reduce(sum), as in float32."""
        xp = self.inner.xp
        a = xp.asarray(arr)
        n = self.inner.size(group)
        if not self._low(a, op) or n == 1:
            return self.inner.all_reduce(arr, op=op, group=group, out=out)
        flat = a.reshape(-1)
        k = -(-flat.size // n)
        chunks = xp.zeros(n * k, dtype=self.compute)       # zero-padded to n equal chunks
        chunks[:flat.size] = flat
        mine = self.sum_chunks(chunks.reshape(n, k), group)
        if op == "avg":
            mine /= n
        words = self.inner.all_gather(to_wire(narrow(mine, self.comm_dtype, xp)), axis=0,
                                      group=group)
        full = widen(words.view(held(self.comm_dtype, xp))[:flat.size], self.compute, xp)
        if out is None:
            out = xp.empty_like(a)
        out.reshape(-1)[...] = full
        return out

    def all_reduce_async(self, arr, op="sum", group=None, out=None):
        """Blocking here (two collectives with a local sum between); a done Future."""
        return DoneFuture(self.all_reduce(arr, op=op, group=group, out=out))

    # -- non-reducing calls: 16-bit arrays as raw 2-byte words ---------------------------------
    def all_gather(self, arr, axis=0, group=None):
        a = self.inner.xp.asarray(arr)
        return self.inner.all_gather(to_wire(a), axis=axis, group=group).view(a.dtype)

    def all_gather_async(self, arr, axis=0, group=None):
        a = self.inner.xp.asarray(arr)
        return WireFuture(self.inner.all_gather_async(to_wire(a), axis=axis, group=group),
                          a.dtype)

    def all_to_all(self, arr, axis=0, group=None):
        a = self.inner.xp.asarray(arr)
        return self.inner.all_to_all(to_wire(a), axis=axis, group=group).view(a.dtype)

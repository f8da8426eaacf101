"""Causal attention by cuDNN's fused (flash) kernels: an optional accelerator of the 16-bit
device path, through nvidia-cudnn-frontend's Python graph API on cupy arrays (no torch).

    forward(q, k, v)                        -> (out, lse), or None
    backward(dout, q, k, v, out, lse, into) -> (dq, dk, dv), or None

q, k, v (B, H, T, Dh): bfloat16 or float16 device arrays (nn/autocast.py `Narrow`'s rounded
inputs), any strides with Dh contiguous; every key j <= i visible to query i (a whole
sequence, offset 0, no further mask). cuDNN's kernels take the (B, H, T, T) scores tile by
tile in on-chip memory and never write them (FlashAttention's algorithm): the forward keeps
only lse, the backward recomputes each tile from q, k and lse.

    forward   out = softmax(q k^T / sqrt Dh) v: 16-bit, a (B, H, T, Dh) view of a C-ordered
              (B, T, H, Dh) array, so that merge_heads is a view and the next matmul reads it
              without a copy; lse (B, H, T) float32, the log-sum-exp of each query's scaled
              scores, attention_block's lse (cuDNN's "stats").
    backward  dq, dk, dv (B, H, T, Dh) from dout and the forward's out and lse, written into
              `into` (three arrays or views, e.g. split_heads_grads') when given: by cuDNN
              itself where they are 16-bit (the GPT unit's, a (B, T, 3, H, Dh) gradient the
              qkv matmul's backward takes without a cast), else widened into them; without
              `into`, float32 arrays (attention.wide), the dtype the gradients are held in.

Numerics: float32 accumulation and softmax statistics, 16-bit inputs and outputs, as
nn/fused_low.py's path; but not its values rounding for rounding. The probabilities are
rounded to 16 bits before the PV product unnormalised (normalised once at the end, in float32),
and the backward's row sums are sum_d dout out (FlashAttention's), not sum_s p dp (autocast's,
which the rounding emulation follows). So this path is an accelerator within a stated
tolerance, not a bit-level twin of the emulation: benchmarks/gpu_cudnn_check.py measures both
paths' error against a float64 reference on the same 16-bit inputs.

Used where it can be (attention.causal_attention_forward/backward) when all of these hold:
the arrays are cupy's, the environment variables MPISHARD_CUDNN and MPISHARD_FUSED are not
"0" (read at each call, as nn/fused.py's switch: MPISHARD_FUSED=0 runs the xp ops alone),
the `cudnn` module imports with a CUDA runtime, and cuDNN builds a plan for the shape.
A graph that cuDNN refuses is remembered (`refusals`) and the caller runs its own kernels. A
forward by cuDNN is recognised by its 16-bit `out` (the other paths' is float32), so the
backward runs by cuDNN exactly when the forward did.

Graphs are built once per shape, strides and dtype and kept, the last 64 of them (cuDNN's
plans, once built, run from any stream: the current cupy stream is set before each call). A
refusal (cuDNN's not-supported error, a ValueError) is kept too; any other failure to build
(out of memory, say) is reported in `refusals` and tried again at the next call.
"""
from __future__ import annotations

import ctypes
import glob
import logging
import math
import os
import sys
import threading
from functools import lru_cache

import numpy as np

from .functional import array_module
from .gemm import LOW, is_low

SWITCH = "MPISHARD_CUDNN"
refusals: dict = {}
"""Graph key -> why cuDNN did not build it (the message), while it stands: what the
benchmarks report as the attention that ran."""


@lru_cache(maxsize=1)
def load():
    """The `cudnn` module (nvidia-cudnn-frontend), or None where it does not import (absent,
    no libcudnn to load) or no CUDA runtime can be loaded for it."""
    try:
        import cudnn
    except Exception:                 # ImportError, OSError, a RuntimeError from its loader
        return None
    return cudnn if preload_cudart() else None


def preload_cudart() -> bool:
    """The frontend dlopens the CUDA runtime by its soname (libcudart.so.13 or .12). Load
    cupy's major version first (the one the arrays live in), by soname (already loaded, or on
    the loader's path), else from a wheel's folder (nvidia-cuda-runtime beside cupy's or
    torch's, which the loader's path does not hold), as torch does for its CUDA wheels. One
    runtime only (the frontend refuses two). False when none loads: this path is then off."""
    try:
        import cupy
        first = int(cupy.cuda.runtime.runtimeGetVersion()) // 1000
    except Exception:                 # no cupy, no driver: 13 first, as cupy-cuda13x's
        first = 13
    majors = [first] + [m for m in (13, 12) if m != first]
    for major in majors:
        candidates = [f"libcudart.so.{major}"] + sorted(
            path for base in sys.path for path in
            glob.glob(os.path.join(base, "nvidia", "*", "lib", f"libcudart.so.{major}")))
        for name in candidates:
            try:
                ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
            except OSError:
                continue
            logging.getLogger(__name__).info("cuDNN's attention: CUDA runtime %s loaded "
                                             "(global symbols) for the frontend", name)
            return True
    return False


def status() -> str:
    """One line for `inspect --env`: whether this path can run here, and why not."""
    if os.environ.get(SWITCH) == "0" or os.environ.get("MPISHARD_FUSED") == "0":
        return "off (MPISHARD_CUDNN or MPISHARD_FUSED is 0): our 16-bit softmax kernels"
    try:
        import cudnn
    except Exception as exc:
        return (f"not loadable ({type(exc).__name__}: {exc}; pip install "
                f"nvidia-cudnn-frontend==1.16.0): our 16-bit softmax kernels")
    if load() is None:
        return "not loadable (no libcudart.so.13 or .12 to load): our 16-bit softmax kernels"
    return (f"nvidia-cudnn-frontend {getattr(cudnn, '__version__', '?')}, libcudnn "
            f"{cudnn.backend_version()}: a 16-bit step's causal attention over whole sequences "
            f"(a refused shape is logged and runs our kernels)")


def is_cupy(xp) -> bool:
    """Whether xp is cupy (the arrays this path hands to cuDNN by pointer)."""
    return getattr(xp, "__name__", "") == "cupy"


def usable(q) -> bool:
    """Whether this path may take attention on q: a cupy 16-bit array, neither
    MPISHARD_CUDNN nor MPISHARD_FUSED (every fused and hand-written kernel, nn/fused.py) "0",
    the module loadable."""
    return (is_cupy(array_module(q)) and is_low(q) and os.environ.get(SWITCH) != "0"
            and os.environ.get("MPISHARD_FUSED") != "0" and load() is not None)


def _io_type(cudnn, dtype):
    return cudnn.data_type.BFLOAT16 if np.dtype(dtype) == LOW[0] else cudnn.data_type.HALF


def _layout(a) -> tuple:
    """(dims, strides in elements) of an array, as cuDNN's tensors take them."""
    return tuple(a.shape), tuple(s // a.itemsize for s in a.strides)


def _stats_layout(q) -> tuple:
    b, h, t, _ = q.shape
    return (b, h, t, 1), (h * t, t, 1, 1)


@lru_cache(maxsize=8)
def _handle(cudnn, device: int):
    """(One cuDNN handle per device, made while that device is current; a lock, held while
    its stream is set and a graph runs on it, so that threads on other streams do not
    interleave the two)."""
    return cudnn.create_handle(), threading.Lock()


def _tensor(graph, name, layout, dtype):
    dims, strides = layout
    return graph.tensor(name=name, dim=list(dims), stride=list(strides), data_type=dtype)


def _output(t, layout, dtype):
    dims, strides = layout
    t.set_output(True).set_dim(list(dims)).set_stride(list(strides)).set_data_type(dtype)


@lru_cache(maxsize=64)
def _graph(cudnn, device, kind, dtype_name, layouts):
    """(graph, tensors by name, workspace bytes) of one direction, or the refusal's message.
    layouts: ((name, (dims, strides)), ...) of every tensor the graph reads and writes."""
    io = _io_type(cudnn, dtype_name)
    f32 = cudnn.data_type.FLOAT
    lay = dict(layouts)
    scale = 1.0 / math.sqrt(lay["q"][0][-1])
    try:
        graph = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32,
                              compute_data_type=f32, handle=_handle(cudnn, device)[0])
        t = {n: _tensor(graph, n, lay[n], io) for n in ("q", "k", "v")}
        if kind == "forward":
            out, stats = graph.sdpa(name="sdpa", q=t["q"], k=t["k"], v=t["v"],
                                    generate_stats=True, attn_scale=scale,
                                    use_causal_mask=True)
            _output(out, lay["out"], io)
            _output(stats, lay["lse"], f32)
            t.update(out=out, lse=stats)
        else:
            t.update(out=_tensor(graph, "out", lay["out"], io),
                     dout=_tensor(graph, "dout", lay["dout"], io),
                     lse=_tensor(graph, "lse", lay["lse"], f32))
            grads = graph.sdpa_backward(name="sdpa_backward", q=t["q"], k=t["k"], v=t["v"],
                                        o=t["out"], dO=t["dout"], stats=t["lse"],
                                        attn_scale=scale, use_causal_mask=True)
            for name, g in zip(("dq", "dk", "dv"), grads):
                _output(g, lay[name], io)
                t[name] = g
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
        return graph, t, int(graph.get_workspace_size())
    except (ValueError, getattr(cudnn, "cudnnGraphNotSupportedError", ValueError)) as exc:
        return f"{type(exc).__name__}: {exc}"  # a refusal (shape, layout, version): kept


def _run(xp, kind, arrays):
    """Build (or reuse) the graph for these arrays and run it; False when cuDNN refused."""
    cudnn = load()
    device = int(xp.cuda.runtime.getDevice())
    layouts = tuple((n, _stats_layout(arrays["q"]) if n == "lse" else _layout(a))
                    for n, a in arrays.items())
    key = (kind, arrays["q"].dtype.name, layouts)
    try:
        built = _graph(cudnn, device, kind, arrays["q"].dtype.name, layouts)
    except Exception as exc:          # a passing failure (out of memory): not kept, tried again
        built = f"{type(exc).__name__}: {exc}"
    if isinstance(built, str):
        if key not in refusals:              # once per shape, while it stands
            logging.getLogger(__name__).warning(
                "cuDNN's attention did not build for %s %s %s (%s): our 16-bit kernels run",
                kind, arrays["q"].dtype.name, tuple(arrays["q"].shape), built[:300])
        refusals[key] = built
        return False
    refusals.pop(key, None)                  # built now (a passing failure before)
    graph, tensors, workspace = built
    handle, lock = _handle(cudnn, device)
    space = xp.empty(max(workspace, 1), dtype=np.uint8)
    with lock:
        cudnn.set_stream(handle, xp.cuda.get_current_stream().ptr)
        graph.execute({tensors[n]: a.data.ptr for n, a in arrays.items()}, space.data.ptr,
                      handle=handle)
    return True


def _whole(q, k, v) -> bool:
    """Self-attention of one whole sequence with the head dims cuDNN's flash kernels take."""
    return (q.ndim == 4 and q.shape == k.shape == v.shape and q.dtype == k.dtype == v.dtype
            and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128
            and all(a.strides[-1] == a.itemsize for a in (q, k, v)))


def forward(q, k, v):
    """(out, lse) of causal attention by cuDNN, as the module docstring says; None where
    this path does not take it (the caller's kernels do)."""
    if not (usable(q) and _whole(q, k, v)):
        return None
    xp = array_module(q)
    b, h, t, dh = q.shape
    out = xp.empty((b, t, h, dh), dtype=q.dtype).transpose(0, 2, 1, 3)
    lse = xp.empty((b, h, t), dtype=np.float32)
    if not _run(xp, "forward", {"q": q, "k": k, "v": v, "out": out, "lse": lse}):
        return None
    return out, lse


def backward(dout, q, k, v, out, lse, into=None):
    """(dq, dk, dv) of the attention `forward` computed, as the module docstring says; None
    where this path does not take it (out is not a 16-bit array of this path, or cuDNN
    refuses: the caller's kernels run)."""
    if not (usable(q) and _whole(q, k, v) and is_low(out) and out.shape == q.shape):
        return None
    xp = array_module(q)
    dout = dout.astype(q.dtype, copy=False)
    if dout.strides[-1] != dout.itemsize:
        dout = xp.ascontiguousarray(dout)
    lse = xp.ascontiguousarray(lse, dtype=np.float32)
    direct = into is not None and all(g.dtype == q.dtype and g.shape == q.shape
                                      and g.strides[-1] == g.itemsize for g in into)
    grads = list(into) if direct else [xp.empty(q.shape, dtype=q.dtype) for _ in range(3)]
    arrays = {"q": q, "k": k, "v": v, "out": out, "dout": dout, "lse": lse,
              "dq": grads[0], "dk": grads[1], "dv": grads[2]}
    if not _run(xp, "backward", arrays):
        return None
    if direct:                                         # written where the caller wants them
        return tuple(into)
    if into is None:
        return tuple(g.astype(np.float32) for g in grads)
    for dst, g in zip(into, grads):
        dst[...] = g                                   # widened (exact) into the caller's
    return tuple(into)


__all__ = ["SWITCH", "backward", "forward", "is_cupy", "load", "preload_cudart", "refusals",
           "status", "usable"]

"""Python side of the hand-written CUDA kernels (cuda_src.SOURCE): launch them on cupy arrays.

Each function takes cupy arrays (C-contiguous; made so when not) of one storage dtype:
float64, float32, float16, or bfloat16 (cupy's bfloat16 dtype, or the uint16 words of
parallel/bf16.py), and equals the xp path named in its docstring, to rounding (the sums run
in another order: rtol 1e-12 in float64, benchmarks/gpu_kernels_check.py; tests/nn/
test_cuda_kernels.py checks each kernel's algorithm in numpy). Statistics and parameter
gradients come back in A: float64 for float64 input, else float32. The norms save their
statistics (mean, rstd) instead of the normalised x, GELU its input u instead of dy/du,
SwiGLU nothing beyond its input: each backward recomputes the rest.

`use(xp)` is the switch the call sites check, the one fused.py's kernels share: cupy only,
and only while MPISHARD_FUSED is not "0" (read at each call). AdamW calls adamw_step
(train/optim.py), LayerNorm (functional.layernorm_forward/backward) and RMSNorm
(models/llama/units.py) the norms' kernels where `norm_takes`, saving (x, mean, rstd) or (x,
rstd) for the backward, and the Llama's SwiGLU its pair (`swiglu_takes`), saving its input;
a 16-bit step's GELU (pointwise.low_activation_forward) the bias_gelu pair on its 16-bit
input, and its loss (losses.CrossEntropy.pair) cross_entropy on 16-bit logits; the others
(the residual add, the embedding backward, attention) are checked and timed on a GPU
(gpu_kernels_check), not called (docs/gpus.md).
The module is compiled once per process (`module`, memoised like fused.kernels) by cupy's
NVRTC, without FMA contraction;
`import cupy` happens only in a caller that holds cupy arrays (xp is cupy).
"""
from __future__ import annotations

import math
from functools import lru_cache

import numpy as np

from . import cuda_attention_src, cuda_src
from .fused import use

OPTIONS = ("--fmad=false",)
NORM_BWD_BLOCKS = 256     # blocks of the norms' backward: rows of the column-sum partials
GRID_CAP = 1 << 16        # most blocks of a grid-stride element-wise launch
ADAMW_CHUNK = 16 * cuda_src.BLOCK     # elements per block of the multi-tensor AdamW

__all__ = ["use", "norm_takes", "saved_input", "layernorm_forward", "layernorm_backward",
           "rmsnorm_forward", "rmsnorm_backward", "bias_gelu_forward", "gelu_backward",
           "swiglu_takes", "swiglu_forward", "swiglu_backward", "residual_add",
           "embedding_backward", "adamw_takes", "adamw_step", "attention_forward",
           "attention_backward", "cross_entropy"]


@lru_cache(maxsize=None)
def module(cupy):
    """cuda_src.SOURCE as one cupy.RawModule (kernel code, no state)."""
    return cupy.RawModule(code=cuda_src.SOURCE, options=OPTIONS)


def suffix(dtype) -> str:
    """The entry-point suffix of a storage dtype: f64, f32, f16, or bf16 (bfloat16 or its
    uint16 words)."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16" or dtype == np.uint16:
        return "bf16"
    names = {"float64": "f64", "float32": "f32", "float16": "f16"}
    if dtype.name not in names:
        raise TypeError(f"no CUDA kernel for dtype {dtype}")
    return names[dtype.name]


def acc_dtype(dtype):
    """A: float64 for float64 storage, float32 for every other."""
    return np.float64 if np.dtype(dtype) == np.float64 else np.float32


def _launch(xp, kernel, dtype, grid, args):
    fn = module(xp).get_function(cuda_src.entry_name(kernel, suffix(dtype)))
    fn((max(int(grid), 1),), (cuda_src.BLOCK,), args)


def _elementwise_grid(n: int) -> int:
    return min(-(-n // cuda_src.BLOCK), GRID_CAP)


def _rows(x):
    d = x.shape[-1]
    return x.size // d if d else 0, d


def norm_takes(xp, x, *params) -> bool:
    """Whether a norm layer runs on these kernels: `use(xp)`, and x and its parameters of one
    dtype, float32 or float64 (the residual stream's; 16-bit compute keeps the norms in
    float32)."""
    return (use(xp) and x.dtype in (np.float32, np.float64)
            and all(a.dtype == x.dtype for a in params))


def saved_input(xp, x):
    """x as a norm's backward reads it: C-contiguous and the norm's own (a copy of the
    caller's array, which may be written later: a reused receive buffer), one pass."""
    c = xp.ascontiguousarray(x)
    return c.copy() if c is x else c


def layernorm_forward(xp, x, scale, shift, eps):
    """(y, mean, rstd) of functional.layernorm_forward's y (mean and rstd per row, A-typed,
    in place of its saved xhat)."""
    x = xp.ascontiguousarray(x)
    rows, d = _rows(x)
    a = acc_dtype(x.dtype)
    y = xp.empty_like(x)
    mean, rstd = xp.empty(x.shape[:-1], dtype=a), xp.empty(x.shape[:-1], dtype=a)
    _launch(xp, "layernorm_fwd", x.dtype, rows,
            (x, xp.ascontiguousarray(scale), xp.ascontiguousarray(shift), y, mean, rstd,
             np.int64(rows), np.int64(d), a(eps)))
    return y, mean, rstd


def layernorm_backward(xp, dy, x, scale, mean, rstd):
    """(dx, dscale, dshift) of functional.layernorm_backward, xhat recomputed from x."""
    dy, x = xp.ascontiguousarray(dy), xp.ascontiguousarray(x)
    rows, d = _rows(x)
    a = acc_dtype(x.dtype)
    blocks = max(min(rows, NORM_BWD_BLOCKS), 1)
    dx = xp.empty_like(x)
    ps, pb = xp.empty((blocks, d), dtype=a), xp.empty((blocks, d), dtype=a)
    _launch(xp, "layernorm_bwd", x.dtype, blocks,
            (dy, x, xp.ascontiguousarray(scale), mean, rstd, dx, ps, pb, np.int64(rows),
             np.int64(d)))
    return dx, ps.sum(axis=0), pb.sum(axis=0)


def rmsnorm_forward(xp, x, scale, eps):
    """(y, rstd) of models/llama/units.RMSNorm.forward's y, r (rstd per row, A-typed)."""
    x = xp.ascontiguousarray(x)
    rows, d = _rows(x)
    a = acc_dtype(x.dtype)
    y, rstd = xp.empty_like(x), xp.empty(x.shape[:-1], dtype=a)
    _launch(xp, "rmsnorm_fwd", x.dtype, rows,
            (x, xp.ascontiguousarray(scale), y, rstd, np.int64(rows), np.int64(d), a(eps)))
    return y, rstd


def rmsnorm_backward(xp, dy, x, scale, rstd):
    """(dx, dscale) of RMSNorm.backward (its n = x rstd recomputed from x)."""
    dy, x = xp.ascontiguousarray(dy), xp.ascontiguousarray(x)
    rows, d = _rows(x)
    blocks = max(min(rows, NORM_BWD_BLOCKS), 1)
    dx, ps = xp.empty_like(x), xp.empty((blocks, d), dtype=acc_dtype(x.dtype))
    _launch(xp, "rmsnorm_bwd", x.dtype, blocks,
            (dy, x, xp.ascontiguousarray(scale), rstd, dx, ps, np.int64(rows), np.int64(d)))
    return dx, ps.sum(axis=0)


def bias_gelu_forward(xp, z, bias=None):
    """(y, u): u = z + bias (z itself without a bias), y = pointwise.gelu_forward(u)[0]; u is
    what gelu_backward needs (one saved array, as gelu_forward's dy/dz)."""
    z = xp.ascontiguousarray(z)
    u = z if bias is None else xp.empty_like(z)
    y = xp.empty_like(z)
    f = z.shape[-1] if z.ndim else 1
    b = None if bias is None else xp.ascontiguousarray(bias)
    _launch(xp, "bias_gelu_fwd", z.dtype, _elementwise_grid(z.size),
            (z, b if b is not None else np.uint64(0), u, y, np.int64(z.size), np.int64(f)))
    return y, u


def gelu_backward(xp, dy, u):
    """dz = dy gelu'(u): pointwise.gelu_backward with gelu_forward's dy/dz recomputed from
    u (the bias gradient is the column sum of dz, functional.column_sums)."""
    dy, u = xp.ascontiguousarray(dy), xp.ascontiguousarray(u)
    du = xp.empty_like(u)
    _launch(xp, "gelu_bwd", u.dtype, _elementwise_grid(u.size),
            (dy, u, du, np.int64(u.size)))
    return du


def swiglu_takes(xp, a) -> bool:
    """Whether the Llama SwiGLU unit runs on these kernels: `use(xp)`, a (..., 2 F) of a
    storage dtype they have (float64, float32, float16, bfloat16)."""
    return use(xp) and a.ndim >= 1 and a.shape[-1] % 2 == 0 and np.dtype(a.dtype).name in (
        "float64", "float32", "float16", "bfloat16")


def swiglu_forward(xp, a):
    """silu(gate) up of a (..., 2 F) = gate | up: models/llama/units.SwiGLU.forward."""
    a = xp.ascontiguousarray(a)
    rows, two_f = _rows(a)
    y = xp.empty(a.shape[:-1] + (two_f // 2,), dtype=a.dtype)
    _launch(xp, "swiglu_fwd", a.dtype, _elementwise_grid(y.size),
            (a, y, np.int64(rows), np.int64(two_f // 2)))
    return y


def swiglu_backward(xp, dy, a):
    """da (..., 2 F) = dgate | dup of SwiGLU.backward, sigmoid(gate) recomputed from a."""
    dy, a = xp.ascontiguousarray(dy), xp.ascontiguousarray(a)
    rows, two_f = _rows(a)
    da = xp.empty_like(a)
    _launch(xp, "swiglu_bwd", a.dtype, _elementwise_grid(dy.size),
            (dy, a, da, np.int64(rows), np.int64(two_f // 2)))
    return da


def residual_add(xp, h, branch):
    """h += branch in place (h C-contiguous, A-typed: float32 beside a 16-bit branch, else
    branch's dtype), the branch widened in the same pass: `h += branch.astype(h.dtype)`."""
    if not h.flags.c_contiguous or h.dtype != acc_dtype(branch.dtype):
        raise ValueError(f"residual_add: h must be C-contiguous {np.dtype(acc_dtype(branch.dtype))}"
                         f" beside a {branch.dtype} branch, got {h.dtype}")
    branch = xp.ascontiguousarray(branch)
    _launch(xp, "residual_add", branch.dtype, _elementwise_grid(h.size),
            (h, branch, np.int64(h.size)))
    return h


def embedding_backward(xp, dy, ids, rows: int):
    """functional.embedding_backward, deterministic (no atomics): the ids sorted stably, each
    run of equal ids summed in order by one block, as numpy's reduceat path does."""
    d = dy.shape[-1]
    flat = xp.ascontiguousarray(ids.reshape(-1)).astype(xp.int64, copy=False)
    dy2 = xp.ascontiguousarray(dy.reshape(-1, d))
    g = xp.zeros((rows, d), dtype=dy.dtype)
    if flat.size == 0:
        return g
    order = xp.argsort(flat, kind="stable").astype(xp.int64, copy=False)
    sorted_ids = flat[order]
    new = xp.concatenate([xp.ones(1, dtype=bool), sorted_ids[1:] != sorted_ids[:-1]])
    starts = xp.flatnonzero(new).astype(xp.int64, copy=False)
    runs = starts.size
    starts = xp.concatenate([starts, xp.asarray([flat.size], dtype=xp.int64)])
    _launch(xp, "embedding_bwd", dy.dtype, min(runs, GRID_CAP),
            (dy2, order, starts, xp.ascontiguousarray(sorted_ids[starts[:-1]]), g,
             np.int64(runs), np.int64(d)))
    return g


def adamw_hyper(lr, betas, eps, weight_decay, steps) -> tuple:
    """The host scalars of AdamW.update for tensors at steps `steps` (t after the increment):
    (per tensor [lr / (1 - b1^t), sqrt(1 - b2^t)], decay 1 - lr wd (1 without decay),
    1 - b1, b2, 1 - b2, eps), each a Python float as AdamW.update computes it."""
    b1, b2 = betas
    per = [(lr / (1.0 - b1 ** t), math.sqrt(1.0 - b2 ** t)) for t in steps]
    decay = 1.0 - lr * weight_decay if weight_decay else 1.0
    return per, decay, 1.0 - b1, b2, 1.0 - b2, eps


def adamw_takes(*arrays) -> bool:
    """Whether adamw_step takes a block (p, g, m, v): all C-contiguous, of one dtype, float32
    or float64."""
    dtype = arrays[0].dtype
    return dtype in (np.float32, np.float64) and all(
        a.dtype == dtype and a.flags.c_contiguous for a in arrays)


def adamw_step(xp, blocks, lr, betas, eps, weight_decay):
    """train/optim.AdamW.update on many tensors in one launch. blocks: [(p, g, m, v, t)], all
    C-contiguous of one dtype (float32 or float64: the master weights and their state), t the
    tensor's step after the increment; p, m, v updated in place. Each scalar rounds to the
    dtype as the xp path's Python scalars do, so the elements are the xp path's, op for op."""
    dtype = np.dtype(blocks[0][0].dtype)
    if dtype not in (np.float32, np.float64) or any(
            a.dtype != dtype or not a.flags.c_contiguous for b in blocks for a in b[:4]):
        raise ValueError("adamw_step: p, g, m, v must be C-contiguous, all float32 or float64")
    per, decay, omb1, b2, omb2, eps = adamw_hyper(lr, betas, eps, weight_decay,
                                                  [b[4] for b in blocks])
    sizes = [b[0].size for b in blocks]
    chunks = [(k, lo) for k, n in enumerate(sizes) for lo in range(0, n, ADAMW_CHUNK)]
    if not chunks:
        return
    table = np.array([a.data.ptr for b in blocks for a in b[:4]], dtype=np.uint64)
    kc, lc = (np.array(c, dtype=np.int64) for c in zip(*chunks))
    s = dtype.type
    fn = module(xp).get_function(cuda_src.entry_name("adamw", suffix(dtype)))
    fn((len(chunks),), (cuda_src.BLOCK,),
       (xp.asarray(table), xp.asarray(np.array(sizes, dtype=np.int64)),
        xp.asarray(np.array(per, dtype=dtype).reshape(-1)), xp.asarray(kc), xp.asarray(lc),
        np.int64(ADAMW_CHUNK), s(decay), s(omb1), s(b2), s(omb2), s(eps)))


def _attention_args(q, k, offset):
    b, h, tq, dh = q.shape
    if dh > cuda_attention_src.MAX_DH:
        raise ValueError(f"attention kernels: head dim {dh} > {cuda_attention_src.MAX_DH}")
    tk = k.shape[-2]
    shape = (np.int64(b * h), np.int64(tq), np.int64(tk), np.int64(dh),
             np.int64(tk if offset is None else offset), acc_dtype(q.dtype)(1 / math.sqrt(dh)))
    return b * h, tq, tk, shape


def _warps_grid(rows: int) -> int:
    return -(-rows * 32 // cuda_src.BLOCK)


def attention_forward(xp, q, k, v, offset=None):
    """(out, lse) of attention.attention_block(q, k, v, offset): q (B, H, Tq, Dh), k and v
    (B, H, Tk, Dh), Dh <= 128; out C-contiguous (B, H, Tq, Dh), lse A-typed (B, H, Tq).
    Online softmax, the scores never stored (cuda_attention_src)."""
    q, k, v = (xp.ascontiguousarray(a) for a in (q, k, v))
    bh, tq, _, shape = _attention_args(q, k, offset)
    out, lse = xp.empty_like(q), xp.empty(q.shape[:-1], dtype=acc_dtype(q.dtype))
    _launch(xp, "attention_fwd", q.dtype, _warps_grid(bh * tq), (q, k, v, out, lse) + shape)
    return out, lse


def attention_backward(xp, dout, q, k, v, out, lse, offset=None):
    """(dq, dk, dv) of attention.attention_block_backward given the final out and lse (one
    block, no cast), the probabilities recomputed from q, k and lse."""
    q, k, v, out, dout, lse = (xp.ascontiguousarray(a) for a in (q, k, v, out, dout, lse))
    bh, tq, tk, shape = _attention_args(q, k, offset)
    dq, dk, dv = xp.empty_like(q), xp.empty_like(k), xp.empty_like(v)
    row = xp.empty(q.shape[:-1], dtype=acc_dtype(q.dtype))
    _launch(xp, "attention_bwd_dq", q.dtype, _warps_grid(bh * tq),
            (q, k, v, out, dout, lse, dq, row) + shape)
    _launch(xp, "attention_bwd_dkv", q.dtype, _warps_grid(bh * tk),
            (q, k, v, dout, lse, row, dk, dv) + shape)
    return dq, dk, dv


def cross_entropy(xp, y2, labels, keep, n, scale=1.0):
    """(loss, g) of the softmax cross entropy of logits y2 (N, C) as stored (16 bits: read
    there, float32 arithmetic; cuda_loss_src): loss (N,) A-typed, (y[t] - m) - lse on the
    kept rows and 0 on the others (the value is -loss.sum() / n), and g (N, C) in y2's dtype,
    ((softmax - onehot) / n) * scale on the kept rows and 0 on the others (PyTorch's rule:
    an ignored row adds nothing, whatever its logits). labels (N,): in [0, C) on kept rows
    (the engine's check_targets; a kept row's label outside it gives that row a nan loss and
    gradient, never a read outside the row), 0 on ignored rows; keep (N,) bool; n: a number
    or a 0-d device array, read on the device."""
    y2 = xp.ascontiguousarray(y2)
    rows, c = y2.shape
    a = acc_dtype(y2.dtype)
    loss, g = xp.zeros(rows, dtype=a), xp.empty_like(y2)
    if rows and c:
        count = (n if hasattr(n, "astype") else xp.asarray(n)).astype(a).reshape(1)
        _launch(xp, "cross_entropy", y2.dtype, min(rows, GRID_CAP),
                (y2, xp.ascontiguousarray(labels).astype(xp.int64, copy=False),
                 xp.ascontiguousarray(keep), count, a(scale), loss, g, np.int64(rows),
                 np.int64(c)))
    return loss, g

"""Matrix products of 16-bit operands: 16-bit inputs, float32 products and sums, a 16-bit
result. This is the contract of the tensor cores and of torch.autocast's matmul.

    matmul(xp, a, b, out=None)     a @ b (numpy's rules: 1-D operands, broadcast batch axes)

This is the one product the layers call: nn.einsum's matmul-shaped specs, fused.matmul_tn,
and attention's products. Operands of float32 or float64 go to `xp.matmul` as before (with
cupy, that is cuBLAS in the dtype, TF32 where cupy's compute type says so).

When either operand is bfloat16 or float16 (a 16-bit compute engine's rounded inputs,
nn/autocast.py `Narrow`), the result has that 16-bit dtype, or `out`'s dtype when `out` is
given:

    cupy       one cuBLAS call, cublasGemmStridedBatchedEx. The inputs are CUDA_R_16BF or
               CUDA_R_16F, the compute type is CUBLAS_COMPUTE_32F (float32 products and
               sums on the tensor cores) and the output is the 16-bit dtype, or float32 when
               written into a float32 `out`. cupy's own matmul is no use here: on 2-D
               operands it sums float16 in float16 unless told otherwise (98 ulps from float32
               sums on the H200), and its batched matmul casts 16-bit operands to float32
               (float16) or refuses them (bfloat16: "data type 'E' not understood", cupy
               14.2).
    elsewhere  numpy or the CPU stand-in: both operands widened to float32 (exact), multiplied
               by xp.matmul, the result rounded to the 16-bit dtype (nearest even). These are
               the same numerics as the rounding emulation of nn/autocast.py, bit for bit on
               numpy.

cuBLAS is column-major. A row-major (…, r, c) matrix is, read column-major, its transpose. So
C = A B is computed as C^T = B^T A^T ('N' for a row-major operand, 'T' for a transposed
view), and every operand is read where it lies: a C-contiguous matrix, a transposed view
(fused.matmul_tn's a^T), or a 2-D weight shared by the whole batch (batch stride 0).
Other layouts are made contiguous first.
"""
from __future__ import annotations

import math
from functools import lru_cache
from types import SimpleNamespace

import ml_dtypes
import numpy as np

LOW = (np.dtype(ml_dtypes.bfloat16), np.dtype(np.float16))
F32 = np.dtype(np.float32)
# CUDA's and cuBLAS's enum values (library_types.h, cublas_api.h): read from cupy when it has
# them, these numbers otherwise
CUDA_TYPES = {np.dtype(ml_dtypes.bfloat16): ("CUDA_R_16BF", 14),
              np.dtype(np.float16): ("CUDA_R_16F", 2), F32: ("CUDA_R_32F", 0)}
COMPUTE_32F = ("CUBLAS_COMPUTE_32F", 68)
GEMM_DEFAULT = ("CUBLAS_GEMM_DEFAULT", -1)


def is_low(a) -> bool:
    """Is `a` a 16-bit float array (bfloat16 or float16)?"""
    return a.dtype in LOW


def widened(a):
    """a as float32 where it is a 16-bit float array (exact: a new array), else a itself
    (None stays None): 16-bit logits for a caller that expects float32 ones."""
    return a.astype(F32) if a is not None and is_low(a) else a


def matmul(xp, a, b, out=None):
    """a @ b; 16-bit operands as the module docstring says, others by xp.matmul."""
    if not (is_low(a) or is_low(b)):
        return xp.matmul(a, b) if out is None else xp.matmul(a, b, out=out)
    low = a.dtype if is_low(a) else b.dtype
    if getattr(xp, "__name__", "") == "cupy" and a.dtype == b.dtype:
        return _cublas(xp, a, b, out)
    c = xp.matmul(a.astype(F32), b.astype(F32))            # exact inputs, float32 sums
    if out is None:
        return c.astype(low)
    out[...] = c if out.dtype == F32 else c.astype(low)    # a float32 out: rounded by its caller
    return out


def _cublas(cp, a, b, out):
    """matmul of two cupy arrays of one 16-bit dtype, one cublasGemmStridedBatchedEx call.
    The call's integers come from `plan` (cached by shapes and strides: a step repeats the
    same few dozen products), so the host's work per product is the pointers and the call."""
    from cupy.cuda import cublas, device

    p, a, b = planned(cp, a, b)
    direct = (out is not None and out.dtype in (a.dtype, F32) and out.flags.c_contiguous
              and out.shape == p.shape)
    wide = out is not None and out.dtype == F32          # the float32 product, unrounded
    c = out if direct else cp.empty(p.c_shape, dtype=F32 if wide else a.dtype)
    if p.work and p.k == 0:
        c.fill(0)
    elif p.work:
        t = _types(a.dtype, c.dtype)
        cublas.gemmStridedBatchedEx(
            device.get_cublas_handle(), p.transa, p.transb, p.m, p.n, p.k, ONE.ctypes.data,
            b.data.ptr, t[0], p.lda, p.strideA, a.data.ptr, t[0], p.ldb, p.strideB,
            ZERO.ctypes.data, c.data.ptr, t[1], p.ldc, p.strideC, p.batch, t[2], t[3])
    if direct:
        return out
    c = c.reshape(p.shape)
    if out is None:
        return c
    out[...] = c                                           # (cast to out's dtype)
    return out


ONE, ZERO = np.ones((), np.float32), np.zeros((), np.float32)   # alpha, beta (host pointers)


@lru_cache(maxsize=None)
def _types(low, c_dtype) -> tuple:
    """cuBLAS's (operand type, result type, compute type, algorithm) enums for these dtypes."""
    from cupy.cuda import cublas, runtime
    return (_enum(runtime, CUDA_TYPES[np.dtype(low)]),
            _enum(runtime, CUDA_TYPES[np.dtype(c_dtype)]),
            _enum(cublas, COMPUTE_32F), _enum(cublas, GEMM_DEFAULT))


def _enum(mod, pair):
    """cupy's value of a CUDA enum (name, value), or the value where cupy lacks the name."""
    return getattr(mod, pair[0], pair[1])


@lru_cache(maxsize=4096)
def plan(a_shape, a_strides, b_shape, b_strides, item):
    """a @ b as one strided batched GEMM in cuBLAS's terms, from the operands' shapes and
    strides (bytes) alone (numpy's rules: 1-D operands, broadcast batch axes), or None when
    an operand must be copied first (`readable`). Elements, not bytes: C' (m x n, ld ldc) =
    op(A') (m x k) op(B') (k x n) for each of `batch` matrices, C' being the row-major C
    (…, M, N) read column-major, i.e. C^T = B^T A^T: A' is b, B' is a. Also the result's
    shape (`shape`; `c_shape` with the vectors' axes kept) and whether there is work."""
    vec_a, vec_b = len(a_shape) == 1, len(b_shape) == 1
    if vec_a:                                              # a[None, :]
        a_shape, a_strides = (1,) + a_shape, (0,) + a_strides
    if vec_b:                                              # b[:, None]
        b_shape, b_strides = b_shape + (1,), b_strides + (0,)
    (m, k), (k2, n) = a_shape[-2:], b_shape[-2:]
    if k != k2:
        raise ValueError(f"matmul: shapes {a_shape} and {b_shape} not aligned")
    batch = tuple(np.broadcast_shapes(a_shape[:-2], b_shape[:-2]))
    la, lb = (None if len(sh) > 2 and sh[:-2] != batch else _layout_of(sh, st, item)
              for sh, st in ((a_shape, a_strides), (b_shape, b_strides)))
    if la is None or lb is None:
        return None
    (ta, lda, sa), (tb, ldb, sb) = la, lb
    shape = batch + ((m,) if not vec_a else ()) + ((n,) if not vec_b else ())
    return SimpleNamespace(shape=shape, c_shape=batch + (m, n),
                           work=bool(m and n and math.prod(batch)), transa=tb, transb=ta,
                           m=n, n=m, k=k, lda=ldb, strideA=sb, ldb=lda, strideB=sa, ldc=n,
                           strideC=m * n, batch=math.prod(batch))


def readable(cp, a, b):
    """(a, b) as cuBLAS can read them: a broadcast batch axis materialised, any other layout
    `plan` refuses copied to C order (vectors stay vectors)."""
    batch = tuple(np.broadcast_shapes(a.shape[:-2] if a.ndim > 1 else (),
                                      b.shape[:-2] if b.ndim > 1 else ()))
    out = []
    for x in (a, b):
        if x.ndim > 2 and x.shape[:-2] != batch:
            x = cp.ascontiguousarray(cp.broadcast_to(x, batch + x.shape[-2:]))
        elif x.ndim > 1 and _layout(x) is None:
            x = cp.ascontiguousarray(x)
        elif x.ndim == 1 and _layout_of((1,) + x.shape, (0,) + x.strides, x.itemsize) is None:
            x = cp.ascontiguousarray(x)                    # a reversed or broadcast vector
        out.append(x)
    return tuple(out)


def planned(cp, a, b) -> tuple:
    """(plan, a, b) for a @ b: the operands as cuBLAS reads them (copied by `readable` only
    where the plan cannot read one where it lies)."""
    p = plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
    if p is None:                          # an operand cuBLAS cannot read where it lies
        a, b = readable(cp, a, b)
        p = plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
    return p, a, b


def gemm_args(cp, a, b) -> SimpleNamespace:
    """`planned`'s arguments for a @ b with the operands cuBLAS reads: A (b, or its copy) and
    B (a, or its copy), as _cublas hands them over (tests/nn/test_gemm.py replays them)."""
    p, a, b = planned(cp, a, b)
    return SimpleNamespace(**vars(p), A=b, B=a)


def _layout(x):
    """(op, ld, batch stride) in elements, or None when cuBLAS cannot read x as it lies."""
    return _layout_of(x.shape, x.strides, x.itemsize)


def _layout_of(shape, strides, item):
    """_layout of an array of these shape, strides (bytes) and itemsize."""
    r, c = shape[-2:]
    sr, sc = (s // item for s in strides[-2:])
    if (sc == 1 or c == 1) and (r == 1 or sr >= c):      # row-major: op N, ld >= c
        op, ld = 0, (sr if r > 1 else c)
    elif (sr == 1 or r == 1) and (c == 1 or sc >= r):    # column-major: op T, ld >= r
        op, ld = 1, (sc if c > 1 else r)
    else:
        return None
    if len(shape) == 2:
        return op, ld, 0
    dims = [(n, s // item) for n, s in zip(shape[:-2], strides[:-2]) if n != 1]
    for (_, outer), (n, inner) in zip(dims, dims[1:]):
        if outer != inner * n:                             # not one uniform batch stride
            return None
    if dims and dims[-1][1] <= 0:
        return None
    return op, ld, dims[-1][1] if dims else 0


__all__ = ["LOW", "is_low", "matmul", "widened"]

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
    """matmul of two cupy arrays of one 16-bit dtype, one cublasGemmStridedBatchedEx call."""
    from cupy.cuda import cublas, device, runtime

    vec_a, vec_b = a.ndim == 1, b.ndim == 1
    a = a[None, :] if vec_a else a
    b = b[:, None] if vec_b else b
    (m, k), (k2, n) = a.shape[-2:], b.shape[-2:]
    if k != k2:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} not aligned")
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    shape = batch + ((m,) if not vec_a else ()) + ((n,) if not vec_b else ())
    direct = (out is not None and out.dtype in (a.dtype, F32) and out.flags.c_contiguous
              and out.shape == shape)
    wide = out is not None and out.dtype == F32          # the float32 product, unrounded
    c = out if direct else cp.empty(batch + (m, n), dtype=F32 if wide else a.dtype)
    if m and n and math.prod(batch):
        if k == 0:
            c.fill(0)
        else:
            g = gemm_args(cp, a, b, batch)
            one, zero = np.ones((), np.float32), np.zeros((), np.float32)
            cublas.gemmStridedBatchedEx(
                device.get_cublas_handle(), g.transa, g.transb, g.m, g.n, g.k, one.ctypes.data,
                g.A.data.ptr, _enum(runtime, CUDA_TYPES[g.A.dtype]), g.lda, g.strideA,
                g.B.data.ptr, _enum(runtime, CUDA_TYPES[g.B.dtype]), g.ldb, g.strideB,
                zero.ctypes.data, c.data.ptr, _enum(runtime, CUDA_TYPES[c.dtype]), g.ldc,
                g.strideC, g.batch, _enum(cublas, COMPUTE_32F), _enum(cublas, GEMM_DEFAULT))
    if direct:
        return out
    c = c.reshape(shape)
    if out is None:
        return c
    out[...] = c                                           # (cast to out's dtype)
    return out


def _enum(mod, pair):
    """cupy's value of a CUDA enum (name, value), or the value where cupy lacks the name."""
    return getattr(mod, pair[0], pair[1])


def gemm_args(cp, a, b, batch) -> SimpleNamespace:
    """a @ b (a: (…, M, K), b: (…, K, N), `batch` their broadcast batch shape) as one strided
    batched GEMM in cuBLAS's terms, elements not bytes: C' (m x n, ld ldc) = op(A') (m x k)
    op(B') (k x n) for each of `batch` matrices, C' being the row-major C (…, M, N) read
    column-major, i.e. C^T = B^T A^T. Operands are read where they lie, copied only where
    cuBLAS cannot read them."""
    (m, k), n = a.shape[-2:], b.shape[-1]
    ta, lda, sa, a = _operand(cp, a, batch)
    tb, ldb, sb, b = _operand(cp, b, batch)
    return SimpleNamespace(transa=tb, transb=ta, m=n, n=m, k=k, A=b, lda=ldb, strideA=sb, B=a,
                    ldb=lda, strideB=sa, ldc=n, strideC=m * n, batch=math.prod(batch))


def _operand(cp, x, batch):
    """(cuBLAS op, leading dimension, batch stride, array) of one operand read where it lies:
    op 0 for a row-major matrix, 1 for a column-major one (a transposed view), batch stride 0
    for a 2-D operand shared by the batch. Anything else is copied to C order first."""
    if x.ndim > 2 and x.shape[:-2] != batch:              # broadcast batch axes: materialise
        x = cp.ascontiguousarray(cp.broadcast_to(x, batch + x.shape[-2:]))
    layout = _layout(x)
    if layout is None:
        x = cp.ascontiguousarray(x)
        layout = _layout(x)
    return layout + (x,)


def _layout(x):
    """(op, ld, batch stride) in elements, or None when cuBLAS cannot read x as it lies."""
    item = x.itemsize
    r, c = x.shape[-2:]
    sr, sc = (s // item for s in x.strides[-2:])
    if (sc == 1 or c == 1) and (r == 1 or sr >= c):      # row-major: op N, ld >= c
        op, ld = 0, (sr if r > 1 else c)
    elif (sr == 1 or r == 1) and (c == 1 or sc >= r):    # column-major: op T, ld >= r
        op, ld = 1, (sc if c > 1 else r)
    else:
        return None
    if x.ndim == 2:
        return op, ld, 0
    dims = [(n, s // item) for n, s in zip(x.shape[:-2], x.strides[:-2]) if n != 1]
    for (_, outer), (n, inner) in zip(dims, dims[1:]):
        if outer != inner * n:                             # not one uniform batch stride
            return None
    if dims and dims[-1][1] <= 0:
        return None
    return op, ld, dims[-1][1] if dims else 0


__all__ = ["LOW", "is_low", "matmul"]

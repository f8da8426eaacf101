"""bfloat16 where the array module has no bfloat16 dtype (cupy): uint16 words, fp32 math.

A bfloat16 is the upper half of a float32 (1 sign, 8 exponent, 7 mantissa bits). On the host
mixed precision uses ml_dtypes.bfloat16; cupy has no such dtype, so on a device a bf16 array
is held, and sent through MPI, as its raw uint16 words w. With u the bits of a float32 x:

    float32(w) = bits(w << 16)                                exact: every bf16 is a float32
    words(x)   = (u + 0x7FFF + ((u >> 16) & 1)) >> 16         round to nearest, ties to even
    words(x)   = (u >> 16) & 0x8000 | 0x7FC0                  x NaN: the quiet NaN, x's sign

which is what ml_dtypes does on the host (checked on every pattern that matters in
tests/parallel/test_bf16_cupy.py): the carry of the rounding runs into the exponent (the next
binade; the largest float32s round to inf), subnormals round like any other value (no flush),
inf stays inf, and every NaN, whatever its payload, becomes 0x7FC0 or 0xFFC0 by sign. The sum
never wraps for a non-NaN (the largest such u is 0xFF800000, -inf). A float64 input goes
through float32 first, as ml_dtypes' float64 -> bfloat16 cast does (the same double rounding).

The same bit arithmetic twice:
- on cupy, two `cupy.ElementwiseKernel`s (one pass over memory each), built once per process
  (`cupy_kernels` is memoised on the module: kernel code, no state) and compiled by cupy on
  first use per device;
- on any other array module (numpy, the test suite's device double), xp array operations.
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

from ..nn.fused_low import BF16_TO_FLOAT32, BF16_TO_WORDS

WORD = np.dtype(np.uint16)          # a bfloat16 as stored on a device: its raw 16 bits


def is_cupy(xp) -> bool:
    return getattr(xp, "__name__", "") == "cupy"


@lru_cache(maxsize=None)
def cupy_kernels(cupy) -> tuple:
    """(float32 -> words, words -> float32) as cupy ElementwiseKernels."""
    return (cupy.ElementwiseKernel("float32 x", "uint16 w", BF16_TO_WORDS, "mpishard_bf16_words"),
            cupy.ElementwiseKernel("uint16 w", "float32 x", BF16_TO_FLOAT32,
                                   "mpishard_bf16_float32"))


def words_by_ops(xp, x):
    """words(x) with xp array operations (x any float array; float64 via float32)."""
    u = x.astype(xp.float32, copy=False).view(xp.uint32)
    one, sixteen = xp.uint32(1), xp.uint32(16)
    rounded = (u + (xp.uint32(0x7FFF) + ((u >> sixteen) & one))) >> sixteen
    quiet = ((u >> sixteen) & xp.uint32(0x8000)) | xp.uint32(0x7FC0)
    nan = (u & xp.uint32(0x7FFFFFFF)) > xp.uint32(0x7F800000)
    return xp.where(nan, quiet, rounded).astype(xp.uint16)


def float32_by_ops(xp, w):
    """float32(w) with xp array operations (w uint16 words)."""
    return (w.astype(xp.uint32) << xp.uint32(16)).view(xp.float32)


def to_words(xp, x):
    """x (float32 or float64, on xp) rounded to bfloat16, as uint16 words."""
    if is_cupy(xp):
        return cupy_kernels(xp)[0](x.astype(xp.float32, copy=False))
    return words_by_ops(xp, x)


def to_float32(xp, w):
    """uint16 bfloat16 words (on xp) as float32 (exact)."""
    if is_cupy(xp):
        return cupy_kernels(xp)[1](w)
    return float32_by_ops(xp, w)

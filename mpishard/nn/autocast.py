"""Autocast: the precision the matmuls of a layer compute in (torch.autocast's policy).

An engine with `compute_dtype` bfloat16 or float16, or with `tf32=True`, gives every layer
that multiplies matrices a `Rounding` policy (layers.attach_autocast, called by
parallel/compose.py with the policy parallel/precision.py builds); every other engine leaves
them `FULL`, whose methods hand their arguments back untouched, so the float32 and float64
paths run the same operations as without this module, bit for bit.

A layer with a policy `cast` writes each matmul as

    y = cast.output(gemm.matmul(xp, cast.round(a), cast.round(b)))   (nn.einsum alike)

(`cast.enter()` before a product whose inputs were rounded earlier, a deferred weight
gradient; `cast.linear_output(x, w, b)` for a linear layer's x W + b, which `Narrow` on cupy
adds and rounds in one kernel, fused_low.add_bias_round; `cast.kept(y)` for the head's
logits in a training step, which `Narrow` leaves in 16 bits for the loss, and
`cast.linear_kept(x, w, b)` for the MLP's fc (GPT) or gate | up (Llama), whose 16-bit output
its GELU or SwiGLU kernels read, `cast.grad_kept(dx)` for the gradient they read), and
the policy decides what that means (PyTorch autocast's lists, CUDA's, which
keep softmax, the norms and the losses in float32):

    16-bit (bfloat16 / float16)
      matmul inputs    rounded to 16 bits: activations, gradients and weights (the float32
                       master rounded at each use, as autocast's cast cache does per step)
      products, sums   float32 (the product of two bf16 or fp16 values is exact in float32;
                       the sum accumulates in float32, as tensor cores do)
      matmul outputs   rounded to 16 bits (a linear layer's bias is rounded and added first,
                       as autocast's addmm does; a weight's gradient is a matmul output too,
                       accumulated into the float32 gradient store)
      saved for the backward: the 16-bit input a matmul used (Linear, TiedHead) and the
                       attention's rounded q, k, v; the softmax probabilities stay float32
                       (softmax runs in float32 and saves its float32 output, as autocast's
                       fp32 list does; the PV matmul rounds them at use), and the softmax's
                       backward row sums are sum_s p dp (its autograd's), not flash
                       attention's sum_d dout out. On cupy with the fused kernels the
                       attention keeps lse instead and recomputes p = exp(s - lse) in float32
                       from the 16-bit scores (nn/fused_low.py): that p differs from the
                       forward's exp(s - m) / d by float32 roundings only
      everything else  float32: softmax and its statistics, LayerNorm/RMSNorm, activations,
                       the loss, reductions, the residual stream, the embeddings
    tf32
      matmul inputs    rounded to TF32 (a float32 with a 10-bit mantissa, `round_tf32`)
      outputs          float32, not rounded

Held in float32 on numpy: a rounded array keeps dtype float32, its values on the 16-bit grid,
and the GEMM runs in float32 (numpy has no 16-bit GEMM); saved activations take 4 bytes an
element. On a device (cupy, or the CPU stand-in that proves the path) the policy is `Narrow`:
rounded inputs are real 16-bit arrays (2 bytes an element, saved so), multiplied on the
tensor cores by nn/gemm.py; the same values, the speed and memory of 16 bits.

The emulation's rounding functions come from the caller (precision.py rounds through
ml_dtypes on numpy and through bf16.py's word kernels on cupy); `Narrow` casts with astype to
the 16-bit dtype it is given.
"""
from __future__ import annotations

import numpy as np

from . import fused, fused_low
from .functional import array_module, linear_forward, wide_product
from .gemm import is_low


class Full:
    """No rounding: the layers' matmuls as written (float32 or float64 throughout)."""

    active = False

    def round(self, x):
        """x itself."""
        return x

    def output(self, y):
        """y itself."""
        return y

    def enter(self):
        """Nothing (a matmul whose inputs were rounded earlier: a deferred weight gradient)."""

    def linear_output(self, x, w, b=None):
        """A linear layer's y = x W + b of its (rounded) inputs, as this policy outputs it."""
        return self.output(linear_forward(x, w, b))

    def kept(self, y):
        """A matmul output that its next user reads as it is stored (a training step's
        logits, into the loss): `output`'s here; Narrow's keeps it in 16 bits."""
        return self.output(y)

    def linear_kept(self, x, w, b=None):
        """A linear layer's x W + b for a next unit with 16-bit kernels (the MLP's GELU or
        SwiGLU): `linear_output`'s here; Narrow's is in 16 bits where those kernels run."""
        return self.linear_output(x, w, b)

    def grad_kept(self, dx):
        """A matmul's input gradient for a unit with 16-bit kernels: `output`'s here;
        Narrow's is in 16 bits where those kernels run."""
        return self.output(dx)

    def __repr__(self):
        return "FULL"


FULL = Full()


class Rounding:
    """Matmul inputs rounded by `inputs`, outputs by `outputs` (None: left as they are).

    inputs, outputs: functions of one float array returning it rounded (same dtype, a new
    array); name: what the policy is called in reports ("bfloat16", "float16", "tf32")."""

    active = True

    def __init__(self, inputs, outputs=None, name=""):
        self.inputs, self.outputs, self.name = inputs, outputs, name

    def round(self, x):
        """A matmul input: x rounded (a new array; None stays None)."""
        return None if x is None else self.inputs(x)

    def enter(self):
        """A matmul follows whose inputs were rounded earlier (a deferred weight gradient):
        nothing to do here; precision.CublasTF32 switches cuBLAS's TF32 on."""

    linear_output = Full.linear_output
    kept = Full.kept
    linear_kept = Full.linear_kept
    grad_kept = Full.grad_kept

    def output(self, y):
        """A matmul output: y rounded in place (a view is written through), and returned
        (None stays None). (Narrow returns a 16-bit y widened, a new array: callers use the
        return value, or give gemm a float32 `out`, which is rounded in place.)"""
        if self.outputs is not None and y is not None:
            y[...] = self.outputs(y)
        return y

    def __repr__(self):
        return f"Rounding({self.name})"


class Narrow(Rounding):
    """16-bit compute held in 16 bits (a device engine's policy, parallel/precision.py): a
    matmul input becomes a real `dtype` array (bfloat16 or float16: half the bytes, and so it
    is saved for the backward), nn/gemm.py multiplies two of them on the tensor cores
    (float32 products and sums, a 16-bit result), and `output` widens that result to float32
    (exact) for the float32 layer math that follows. The values are those of the rounding
    emulation; only the summation order of the GEMMs differs."""

    def __init__(self, dtype):
        self.low = np.dtype(dtype)
        super().__init__(self._narrow, None, self.low.name)

    def _narrow(self, x):
        """x as a C-ordered `low` array (x itself if it is one): the cast also lays out
        a view (split heads, a transpose) so that cuBLAS reads it without another copy."""
        return x.astype(self.low, order="C", copy=False)

    def linear_output(self, x, w, b=None):
        """x W + b: on cupy with a bias, the float32 product and the bias rounded once in
        one pass (nn/fused_low.py add_bias_round), not an add and a rounding."""
        xp = array_module(x)
        if b is None or not (fused.use(xp) and is_low(x) and is_low(b)):
            return super().linear_output(x, w, b)
        x2 = x.reshape(-1, x.shape[-1])
        y = fused_low.add_bias_round(xp, wide_product(x2, w), b)
        return y.reshape(x.shape[:-1] + w.shape[1:])

    def linear_kept(self, x, w, b=None):
        """x W + b, the values of linear_output, in 16 bits where the fused kernels run
        (cupy): with a bias, the float32 product and the bias added and rounded in one pass
        that writes 16 bits (fused_low.add_bias_narrow); without one, the 16-bit product as
        it is. Elsewhere linear_output's float32 (the next unit runs its float32 ops)."""
        xp = array_module(x)
        if not fused.use(xp):
            return self.linear_output(x, w, b)
        if b is None:
            return self.kept(linear_forward(x, w))
        if not (is_low(x) and is_low(b)):
            return self.kept(self.linear_output(x, w, b))
        y = fused_low.add_bias_narrow(xp, wide_product(x.reshape(-1, x.shape[-1]), w), b)
        return y.reshape(x.shape[:-1] + w.shape[1:])

    def grad_kept(self, dx):
        """dx in 16 bits (`kept`) where the fused kernels run (cupy), else `output`'s."""
        return self.kept(dx) if fused.use(array_module(dx)) else self.output(dx)

    def kept(self, y):
        """A matmul output as its next user reads it, in 16 bits: a training step's logits,
        which the loss reads as they are stored (nn/losses.py; cuda_loss_src on cupy), its
        gradient written in 16 bits for the head's backward. The values are `output`'s,
        without the float32 copy (the logits' bytes, halved)."""
        if y is None or y.dtype == self.low:
            return y
        return y.astype(self.low)

    def output(self, y):
        """A matmul output as float32: a 16-bit one widened (a new array); a float32 one (a
        product written into a float32 `out`) rounded to 16 bits in place and returned."""
        if y is None:
            return y
        if y.dtype == self.low:
            return y.astype(np.float32)
        xp = array_module(y)
        if fused.use(xp):                      # cupy: one pass in place (nn/fused_low.py)
            return fused_low.round_in_place(xp, y, self.low)
        y[...] = y.astype(self.low)
        return y


def round_tf32(x):
    """float32 x rounded to TF32 (1 sign, 8 exponent, 10 mantissa bits), held in float32:
    the low 13 mantissa bits cleared after rounding to nearest, ties to even, on the bits
    u of x: (u + 0xFFF + ((u >> 13) & 1)) & ~0x1FFF. The carry runs into the exponent (the
    largest float32s round to inf); inf and NaN (exponent all ones) are kept as they are.
    (NVIDIA's cvt.rna.tf32.f32 rounds ties away from zero; the two differ only on exact
    ties.)"""
    xp = array_module(x)
    u = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    r = (u + np.uint32(0xFFF) + ((u >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    special = (u & np.uint32(0x7F800000)) == np.uint32(0x7F800000)
    return xp.where(special, u, r).view(np.float32)


__all__ = ["FULL", "Full", "Narrow", "Rounding", "round_tf32"]

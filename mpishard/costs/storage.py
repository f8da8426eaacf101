"""How a training step holds its arrays, which is what the planner prices its peak at (no MPI).

    storage_for(dtype, compute_dtype=None, device="cpu") -> Storage

A step with `--compute-dtype` bfloat16 or float16 does not hold the same arrays as a float32
step. What changes (nn/autocast.py):

- On a device (cupy: `Narrow`), a matmul input is a real 16-bit array, and it is saved for the
  backward in 2 bytes: the Linear layers' inputs, the attention's q, k and v, and the head's
  input. The norms' statistics and the residual stream stay float32; so does GELU's
  derivative without the fused kernels.
  - The fused kernels (nn/fused_low.py, or cuDNN's flash attention) keep the softmax's
    log-sum-exp, (B, H, T) in float32, instead of its probabilities. Our backward recomputes
    the 16-bit scores and writes a 16-bit ds beside them (two 16-bit scores-sized arrays);
    cuDNN's flash backward holds no T x T array. Packed documents (a `visible` mask) take
    neither: their probabilities stay float32, which this does not price.
  - In a training step the model's own head keeps its 16-bit product: the loss reads the
    16-bit logits and writes a 16-bit gradient (nn/cuda_loss_src.py), the head's backward
    matmul's input as it is (`low_logits`). The head's backward adds the head weight rounded
    to 16 bits. A vocab-parallel head (tp) widens its logits to float32, and its loss
    writes a float32 gradient, as in a float32 step; so did every head before 16-bit logits
    (`kept16=False` prices those runs: the H200's of 2026-11-30).
  - With the fused kernels, the MLP's activation keeps its 16-bit input (the GPT's GELU the
    fc's output, instead of a float32 derivative; the Llama's SwiGLU gate | up, instead of
    the four float32 arrays priced before: nn/activation_layer.py) (`low_act`); also since
    the H200's runs (`kept16`).
  - cuDNN's attention (nn/cudnn_attention.py) writes its output in 16 bits, and that array is
    the projection's input. Our kernels keep a float32 output beside its rounded copy.
  - The device double (tests/device_double.py) has no fused kernels. It keeps the
    probabilities in float32 and runs the loss unfused, like numpy without numba, on the
    logits widened to float32: `fused=False`.
- On the CPU (`Rounding`), a 16-bit or tf32 compute dtype is emulated: every array stays
  float32, and its values are rounded. Saved activations take 4 bytes, as in float32. Each
  matmul input rounded at use is a float32 copy: the head's backward holds its gradient
  rounded (one more logits-sized array) and the head weight rounded.
- tf32 on a device is a cuBLAS setting: nothing is copied, so it is priced as float32.
- A device without the 16-bit dtype (cupy 13 has no bfloat16) emulates it in float32
  (parallel/precision.py warns): `device="gpu"` then under-prices it; price such a run
  with `device="cpu"`.

A float32 step on a device has the fused loss (2 logits-sized arrays at its peak, as numba's
on the CPU), the fused float32 softmax, which keeps the probabilities, and the Llama's SwiGLU
kernels, which keep gate | up alone (the models' `act_fused`).
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import numpy as np

from ..nn import cudnn_attention

SIXTEEN_BIT = ("bfloat16", "float16")


@dataclass(frozen=True)
class Storage:
    """itemsize: --dtype's bytes (parameters, and every float32 activation); low: the bytes
    a saved matmul input takes (2 for 16-bit compute on a device, else itemsize); device:
    the arrays live on a GPU; fused: the device's fused kernels run (the loss, and with
    low < itemsize the attention keeping log-sum-exp); rounding: the CPU emulates a compute
    dtype with rounded float32 copies; name: the compute dtype's, for reports; cudnn:
    cuDNN's flash attention runs (its 16-bit output is the next matmul's input, where our
    kernels keep a float32 output beside its rounded copy); kept16: a 16-bit step's own
    head keeps its logits in 16 bits for the loss, and its MLP's activation its 16-bit input
    (False: as both did before, in float32)."""

    itemsize: int = 4
    low: int = 4
    device: bool = False
    fused: bool = False
    rounding: bool = False
    name: str = "float32"
    cudnn: bool = False
    kept16: bool = True

    @property
    def low_logits(self) -> bool:
        """A model's own head hands the loss 16-bit logits, and the loss gives a 16-bit
        gradient back (a device's 16-bit step)."""
        return self.kept16 and self.device and self.low < self.itemsize

    @property
    def low_act(self) -> bool:
        """The MLP's activation keeps its 16-bit input for the backward (a device's 16-bit
        step with the fused kernels)."""
        return self.low_logits and self.fused

    @property
    def keeps_lse(self) -> bool:
        """The attention keeps (B, H, T) log-sum-exp, not its probabilities."""
        return self.device and self.fused and self.low < self.itemsize

    @property
    def rounds_copies(self) -> bool:
        """A matmul input rounded at use is a new array (16-bit on a device, a float32 copy
        in the CPU's emulation)."""
        return self.rounding or self.low < self.itemsize

    @property
    def label(self) -> str:
        """What reports say was priced beyond --dtype: 'bfloat16 compute on the GPU', or ''
        for --dtype's own arrays on the CPU."""
        if not (self.device or self.rounding):
            return ""
        return f"{self.name} compute on the {'GPU' if self.device else 'CPU'}"

    def rounded(self, nbytes: float) -> float:
        """Bytes of the rounded copy of a float array of `nbytes`."""
        return nbytes * self.low / self.itemsize


def storage_for(dtype="float32", compute_dtype=None, device: str = "cpu",
                fused=None, cudnn=None) -> Storage:
    """The Storage of a step in `dtype` with `compute_dtype` (None, 'bfloat16', 'float16',
    'tf32' or dtype's own name) on `device` ('cpu' or 'gpu'). fused: whether the device's
    fused kernels run (default: unless MPISHARD_FUSED=0, nn/fused.py's switch; the device
    double's tests pass False); cudnn: whether cuDNN's attention runs in a 16-bit step on
    the device (default: fused, MPISHARD_CUDNN not 0 and the `cudnn` module installed, not
    loaded: nn/cudnn_attention.py)."""
    if device not in ("cpu", "gpu"):
        raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")
    itemsize = np.dtype(dtype).itemsize
    name = compute_dtype or np.dtype(dtype).name
    if name != np.dtype(dtype).name and itemsize != 4:
        raise ValueError(f"compute dtype {name} needs dtype float32, got {np.dtype(dtype)}")
    gpu = device == "gpu"
    fused = gpu and (os.environ.get("MPISHARD_FUSED") != "0" if fused is None else bool(fused))
    if compute_dtype in SIXTEEN_BIT:
        if cudnn is None:
            cudnn = bool(fused) and os.environ.get(cudnn_attention.SWITCH) != "0" and \
                importlib.util.find_spec("cudnn") is not None
        return Storage(itemsize, 2 if gpu else itemsize, gpu, fused, not gpu, name,
                       fused and bool(cudnn))
    return Storage(itemsize, itemsize, gpu, fused, compute_dtype == "tf32" and not gpu, name)


FLOAT32 = Storage()

"""Every CUDA kernel source of the package compiles to PTX with NVRTC, without a GPU.

NVRTC comes from the `nvidia-cuda-nvrtc-cu12` wheel (the `nvrtc` extra); without it these
tests skip, unless MPISHARD_REQUIRE_NVRTC=1 (`make test-nvrtc`, which installs the wheel), which
turns the skip into a failure. Compiled, for compute_80 and compute_90, with the options cupy
gets from the package (no FMA contraction):
- nn/cuda_src.SOURCE, whole: every entry point cuda_ops launches must be in the PTX, and the
  compiler must have nothing to say (no warning);
- nn/fused.py's ElementwiseKernel and ReductionKernel bodies, for T float and double,
  nn/fused_low.py's bodies after each 16-bit dtype's preamble, and
  the bfloat16 word kernels' bodies (fused_low.BF16_TO_WORDS and BF16_TO_FLOAT32,
  parallel/bf16.py's), each inside nvrtc.elementwise_source's / reduction_source's harness
  (cupy's parameter binding, flat indices);
and a source with an error is refused with NVRTC's log, so the check can fail.
"""
import os

import pytest

from mpishard.nn import cuda_ops, cuda_src, fused, fused_low, nvrtc

ARCHS = ("compute_80", "compute_90")


@pytest.fixture(scope="module")
def compiler():
    if nvrtc.library_path() is None:
        reason = "needs libnvrtc: pip install nvidia-cuda-nvrtc-cu12 (make test-nvrtc)"
        if os.environ.get("MPISHARD_REQUIRE_NVRTC") == "1":
            pytest.fail(f"MPISHARD_REQUIRE_NVRTC=1 but {reason}")
        pytest.skip(reason)
    return nvrtc.Nvrtc()


def options(arch):
    return (f"--gpu-architecture={arch}",) + tuple(fused._NO_FMA)


@pytest.mark.parametrize("arch", ARCHS)
def test_cuda_src_compiles_with_every_entry(compiler, arch):
    ptx = compiler.ptx(cuda_src.SOURCE, "cuda_src.cu", (f"--gpu-architecture={arch}",)
                       + cuda_ops.OPTIONS)
    found = nvrtc.entries(ptx)
    print(f"NVRTC {compiler.version()} {arch}: {len(found)} entries")
    assert compiler.log.strip() == ""                            # not even a warning
    assert sorted(found) == sorted(cuda_src.ENTRIES)
    for kernel in ("layernorm_fwd", "layernorm_bwd", "rmsnorm_fwd", "rmsnorm_bwd",
                   "bias_gelu_fwd", "gelu_bwd", "swiglu_fwd", "swiglu_bwd", "residual_add",
                   "embedding_bwd", "attention_fwd", "attention_bwd_dq", "attention_bwd_dkv",
                   "cross_entropy"):
        for s in ("f64", "f32", "bf16", "f16"):
            assert cuda_src.entry_name(kernel, s) in found
    assert {"mpishard_adamw_f64", "mpishard_adamw_f32"} <= set(found)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("t", ["float", "double"])
@pytest.mark.parametrize("name", sorted(fused.ELEMENTWISE))
def test_fused_elementwise_compiles(compiler, name, t, arch):
    in_params, out_params, body, entry = fused.ELEMENTWISE[name]
    src = nvrtc.elementwise_source(in_params, out_params, body, entry, t)
    assert nvrtc.entries(compiler.ptx(src, entry, options(arch))) == [entry]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("low", sorted(fused_low.PREAMBLE))
@pytest.mark.parametrize("name", sorted(fused_low.ELEMENTWISE))
def test_fused_low_compiles(compiler, name, low, arch):
    in_params, out_params, body, entry = fused_low.ELEMENTWISE[name]
    src = fused_low.PREAMBLE[low] + nvrtc.elementwise_source(in_params, out_params, body,
                                                              entry, "float")
    assert nvrtc.entries(compiler.ptx(src, entry, options(arch))) == [entry]
    assert compiler.log.strip() == ""


@pytest.mark.parametrize("t", ["float", "double"])
@pytest.mark.parametrize("name", sorted(fused.REDUCTION))
def test_fused_reduction_compiles(compiler, name, t):
    spec = fused.REDUCTION[name]
    src = nvrtc.reduction_source(*spec, t)
    assert nvrtc.entries(compiler.ptx(src, spec[-1], options(ARCHS[0]))) == [spec[-1]]


@pytest.mark.parametrize("spec", [
    ("float32 x", "uint16 w", fused_low.BF16_TO_WORDS, "bf16_words"),
    ("uint16 w", "float32 x", fused_low.BF16_TO_FLOAT32, "bf16_float32")])
def test_bf16_kernels_compile(compiler, spec):
    src = nvrtc.elementwise_source(*spec, "float")
    assert nvrtc.entries(compiler.ptx(src, spec[-1])) == [spec[-1]]


def test_a_broken_source_is_refused_with_the_log(compiler):
    bad = cuda_src.SOURCE.replace("ms_block_sum(s) / (A)d", "ms_block_sum(s, s) / (A)d", 1)
    assert bad != cuda_src.SOURCE
    with pytest.raises(nvrtc.NvrtcError, match="ms_block_sum"):
        compiler.ptx(bad, "broken.cu")
    with pytest.raises(nvrtc.NvrtcError, match="undefined"):
        compiler.ptx(nvrtc.elementwise_source("T z", "T y", "y = nope(z)", "k", "float"))

"""Compile CUDA C to PTX with NVRTC through ctypes: no GPU, no driver, no cupy.

The `nvidia-cuda-nvrtc-cu12` wheel (the `nvrtc` extra) ships libnvrtc.so.12; NVRTC compiles
a source to PTX for a virtual architecture without a device, so a kernel written on a
machine without a GPU at least compiles, with the compiler a GPU run will use, before one is
lent (tests/nn/test_nvrtc.py compiles every kernel source of the package: cuda_src.SOURCE,
and fused.py's and parallel/bf16.py's kernel bodies inside a harness like cupy's).
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib.util
import os

ARCH = "compute_80"          # Ampere: the oldest architecture with bf16 tensor cores


def library_path() -> str | None:
    """libnvrtc.so.12 of the installed nvidia-cuda-nvrtc-cu12 wheel, else the system's, else
    None."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "cuda_nvrtc", "lib", "libnvrtc.so.12")
        if os.path.exists(path):
            return path
    return ctypes.util.find_library("nvrtc")


class NvrtcError(RuntimeError):
    """A compilation failed; the message holds NVRTC's log."""


class Nvrtc:
    """The NVRTC library, loaded once: `ptx(source, name, options)` -> PTX text; `log`: the
    compiler's messages of the last compilation."""

    def __init__(self, path: str | None = None):
        path = path or library_path()
        if path is None:
            raise OSError("libnvrtc not found: pip install nvidia-cuda-nvrtc-cu12 "
                          "(the mpishard[nvrtc] extra)")
        self.lib = lib = ctypes.CDLL(path)
        self.log = ""
        p, size = ctypes.c_void_p, ctypes.c_size_t
        lib.nvrtcCreateProgram.argtypes = [ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_char_p,
                                           ctypes.c_int, p, p]
        lib.nvrtcCompileProgram.argtypes = [p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(p)]
        for name in ("nvrtcGetProgramLogSize", "nvrtcGetPTXSize"):
            getattr(lib, name).argtypes = [p, ctypes.POINTER(size)]
        for name in ("nvrtcGetProgramLog", "nvrtcGetPTX"):
            getattr(lib, name).argtypes = [p, ctypes.c_char_p]
        lib.nvrtcGetErrorString.restype = ctypes.c_char_p
        lib.nvrtcGetErrorString.argtypes = [ctypes.c_int]

    def version(self) -> tuple:
        major, minor = ctypes.c_int(), ctypes.c_int()
        self._check(self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "version")
        return major.value, minor.value

    def _check(self, rc: int, what: str, log: str = "") -> None:
        if rc != 0:
            raise NvrtcError(f"nvrtc {what}: {self.lib.nvrtcGetErrorString(rc).decode()}"
                             + (f"\n{log}" if log else ""))

    def ptx(self, source: str, name: str = "kernel.cu", options=()) -> str:
        """PTX of `source` compiled with `options` (default: --gpu-architecture=ARCH), or
        NvrtcError with the compiler's log."""
        lib, prog = self.lib, ctypes.c_void_p()
        self._check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(),
                                           0, None, None), "create")
        try:
            opts = [o.encode() for o in (options or (f"--gpu-architecture={ARCH}",))]
            rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
            n = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
            log = ctypes.create_string_buffer(n.value)
            lib.nvrtcGetProgramLog(prog, log)
            self.log = log.value.decode(errors="replace")      # warnings, after a success
            self._check(rc, f"compile {name}", self.log)
            self._check(lib.nvrtcGetPTXSize(prog, ctypes.byref(n)), "PTX size")
            out = ctypes.create_string_buffer(n.value)
            self._check(lib.nvrtcGetPTX(prog, out), "PTX")
            return out.value.decode()
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))


def entries(ptx: str) -> list:
    """The kernel entry points a PTX text defines ('.entry name(')."""
    return [line.split(".entry", 1)[1].split("(", 1)[0].strip()
            for line in ptx.splitlines() if ".entry" in line]


# -- cupy's ElementwiseKernel / ReductionKernel bodies in a standalone harness ---------------------
_CTYPES = {"int64": "long long", "I": "long long", "bool": "bool", "float32": "float",
           "float64": "double", "uint16": "unsigned short", "uint32": "unsigned int", "T": "T"}


def _params(spec: str, output: bool):
    """(C parameters, per-element bindings) of a cupy parameter list like "raw T p, T lse":
    a raw parameter is a pointer indexed by the body itself; any other is element i of its
    array, read-only for an input and a reference for an output, as in cupy's kernels."""
    params, binds = [], []
    for item in (p.split() for p in spec.split(",") if p.strip()):
        raw = item[0] == "raw"
        ctype, name = _CTYPES[item[-2]], item[-1]
        if raw:
            params.append(f"{ctype}* {name}")
        elif output:
            params.append(f"{ctype}* _out_{name}")
            binds.append(f"{ctype}& {name} = _out_{name}[i];")
        else:
            params.append(f"const {ctype}* _in_{name}")
            binds.append(f"const {ctype} {name} = _in_{name}[i];")
    return params, binds


def elementwise_source(in_params: str, out_params: str, body: str, name: str, t: str) -> str:
    """A CUDA source with an `extern "C"` kernel `name` that runs an ElementwiseKernel's
    `body` (and a `;`, as cupy adds) for every i < n, the type placeholder T being `t`: the
    body compiled as cupy compiles it, in a loop of the same shape (cupy's indexer replaced
    by flat indices)."""
    pi, bi = _params(in_params, False)
    po, bo = _params(out_params, True)
    return (f"typedef {t} T;\n"
            f'extern "C" __global__ void {name}(long long n, {", ".join(pi + po)}) {{\n'
            f"  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n;\n"
            f"       i += (long long)gridDim.x * blockDim.x) {{\n"
            f"    {' '.join(bi + bo)}\n{body};\n  }}\n}}\n")


def reduction_source(in_params: str, out_params: str, map_expr: str, reduce_expr: str,
                     post_expr: str, identity: str, name: str, t: str) -> str:
    """A CUDA source with an `extern "C"` kernel `name` that folds a ReductionKernel's map
    over i < n with its reduce expression (a, b) from its identity, then runs its post-map
    expression on the result a, T being `t` (one thread's share of cupy's reduction)."""
    pi, bi = _params(in_params, False)
    po, _ = _params(out_params, True)
    out = out_params.split()[-1]
    return (f"typedef {t} T;\n"
            f'extern "C" __global__ void {name}(long long n, {", ".join(pi + po)}) {{\n'
            f"  T a = (T)({identity});\n"
            f"  for (long long i = threadIdx.x; i < n; i += blockDim.x) {{\n"
            f"    {' '.join(bi)}\n    const T b = (T)({map_expr});\n    a = {reduce_expr};\n  }}\n"
            f"  T& {out} = _out_{out}[blockIdx.x];\n  {post_expr};\n}}\n")

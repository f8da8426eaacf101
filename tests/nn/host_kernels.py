"""cupy ElementwiseKernel bodies compiled for the host CPU by a C++ compiler and run there.

A CUDA kernel body that uses no CUDA intrinsic beyond its preamble (nn/fused_low.py's: the
16-bit words' ms16_ld and ms16_st) is plain C++: here it is compiled with a host preamble
that defines those two to the same effect (for bfloat16 fused_low.bf16_helpers' own text,
over host versions of the two CUDA bit-cast intrinsics it calls; for float16 the compiler's
_Float16, where the device uses PTX's cvt; both round to nearest even), inside a loop over
i as cupy's kernel runs it
(nvrtc._params' binding: a raw parameter is a pointer, any other is element i of its array,
a scalar passed as an array of n copies), and loaded with ctypes. So the kernel's logic (its
indexing, masking, in-place order) runs on this machine; only the device's exp and log
differ (a few float32 ulps at most). Without a C++ compiler (`c++`, `g++`) the tests skip.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile

import numpy as np

from mpishard.nn import fused_low, nvrtc

HOST_PREAMBLE = {
    "bfloat16": r"""
static inline unsigned int __float_as_uint(float v) {
    unsigned int u; std::memcpy(&u, &v, 4); return u;
}
static inline float __uint_as_float(unsigned int u) {
    float v; std::memcpy(&v, &u, 4); return v;
}
""" + fused_low.bf16_helpers("static inline"),
    "float16": r"""
static inline float ms16_ld(unsigned short w) {
    _Float16 h; std::memcpy(&h, &w, 2); return (float)h;
}
static inline unsigned short ms16_st(float v) {
    _Float16 h = (_Float16)v; unsigned short w; std::memcpy(&w, &h, 2); return w;
}
""",
}

_NUMPY = {"long long": np.int64, "float": np.float32, "double": np.float64,
          "unsigned short": np.uint16, "unsigned int": np.uint32, "bool": np.bool_}


def compiler() -> str | None:
    """A host C++ compiler on PATH, or None."""
    return shutil.which("c++") or shutil.which("g++")


def host_source(in_params: str, out_params: str, body: str, name: str, preamble: str) -> str:
    """C++ of an `extern "C"` function name(n, params...) running `body` for i < n."""
    pi, bi = nvrtc._params(in_params, False)
    po, bo = nvrtc._params(out_params, True)
    return ("#include <cmath>\n#include <cstring>\n"
            "using std::exp; using std::log; using std::isfinite;\n" + preamble +
            f'extern "C" void {name}(long long n, {", ".join(pi + po)}) {{\n'
            f"  for (long long i = 0; i < n; ++i) {{\n    {' '.join(bi + bo)}\n{body};\n  }}\n}}\n")


class HostKernel:
    """One ElementwiseKernel spec (in, out, body, name) built for the host with `preamble`;
    called with n and one numpy array (or scalar) per parameter, in order."""

    def __init__(self, spec, preamble: str, workdir: str):
        in_params, out_params, body, self.name = spec
        src = host_source(in_params, out_params, body, self.name, preamble)
        tag = hashlib.sha1(src.encode()).hexdigest()[:12]
        path = os.path.join(workdir, f"{self.name}_{tag}.so")
        with tempfile.NamedTemporaryFile("w", suffix=".cpp", dir=workdir, delete=False) as f:
            f.write(src)
        subprocess.run([compiler(), "-std=c++17", "-O1", "-ffp-contract=off", "-shared",
                        "-fPIC", f.name, "-o", path], check=True, capture_output=True)
        self.fn = getattr(ctypes.CDLL(path), self.name)
        self.params = [p.split() for p in f"{in_params}, {out_params}".split(",") if p.strip()]

    def __call__(self, n: int, *args):
        keep = []
        for p, a in zip(self.params, args):
            ctype = nvrtc._CTYPES[p[-2]]
            a = np.asarray(a)
            if p[0] != "raw":                      # element i of it (a scalar: n copies)
                a = a.reshape(-1) if a.ndim and a.size == n else np.full(n, a, _NUMPY[ctype])
            assert a.dtype == _NUMPY[ctype] and a.flags.c_contiguous, (p, a.dtype)
            keep.append(a)
        self.fn(ctypes.c_longlong(n), *(ctypes.c_void_p(a.ctypes.data) for a in keep))
        return keep

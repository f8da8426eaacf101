"""The benchmarks' BLAS kernel: run_all.py's children run without OPENBLAS_CORETYPE and
OPENBLAS_L2_SIZE, every result records numpy's and PyTorch's BLAS, the both-kernels table, the
GPT-2-small section, and results.md keeping the sections other benchmarks wrote.

The kernel check starts a child process with OPENBLAS_CORETYPE=Haswell set in its parent's
environment and reads back the kernel numpy's OpenBLAS chose there (threadpoolctl).
"""
import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import _common  # noqa: E402
import gpt_small  # noqa: E402
import kernels  # noqa: E402
import run_all  # noqa: E402

CONFIG = """PyTorch built with:
  - GCC 13.3
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605
  - CPU capability usage: AVX512
  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=mkl, PERF_WITH_AVX=1,
"""


def test_torch_blas_is_read_from_its_config():
    got = _common.torch_blas(CONFIG)
    assert got == {"blas_info": "mkl", "lapack_info": "mkl", "cpu_capability": "AVX512",
                   "library": "Intel(R) oneAPI Math Kernel Library Version 2024.2-Product "
                              "Build 20240605"}
    assert _common.torch_blas("OpenBLAS 0.3.27\nBLAS_INFO=open, LAPACK_INFO=open") == {
        "blas_info": "open", "lapack_info": "open", "library": "OpenBLAS 0.3.27",
        "cpu_capability": None}


def test_true_kernel_env_drops_only_the_kernel_variables():
    env = {"OPENBLAS_CORETYPE": "Haswell", "OPENBLAS_L2_SIZE": "1048576",
           "OPENBLAS_NUM_THREADS": "1", "PATH": "/bin"}
    assert kernels.true_kernel_env(env) == {"OPENBLAS_NUM_THREADS": "1", "PATH": "/bin"}


def test_runner_children_run_on_the_cpus_own_kernel(monkeypatch):
    """A child of run_all's Runner, started from an environment forcing Haswell, reports the
    kernel numpy picks with nothing forced (and records it with the library and version)."""
    plain = subprocess.run(
        [sys.executable, "-c", "import json, _common; print(json.dumps(_common.numpy_blas()))"],
        cwd=BENCH, capture_output=True, text=True, timeout=120,
        env=kernels.true_kernel_env(dict(os.environ)), check=True)
    own = json.loads(plain.stdout)[0]["architecture"]
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    monkeypatch.setenv("OPENBLAS_L2_SIZE", "1048576")
    args = SimpleNamespace(tiny=True, quick=False, verbose=False, mpiexec="mpiexec")
    r = run_all.Runner(args)
    assert "OPENBLAS_CORETYPE" not in r.env and "OPENBLAS_L2_SIZE" not in r.env
    res = r.run([sys.executable, BENCH / "kernels.py"], timeout=120)
    numpy_libs = res["blas"]["numpy"]
    assert numpy_libs[0]["architecture"] == own
    assert numpy_libs[0]["internal_api"] and numpy_libs[0]["version"]


def test_write_json_records_the_blas(tmp_path):
    path = tmp_path / "r.json"
    _common.write_json(str(path), {"x": 1})
    res = json.loads(path.read_text())
    assert res["x"] == 1 and res["blas"]["numpy"] == _common.numpy_blas()


def _job(arch, ratios):
    return {"blas": {"numpy": [{"architecture": arch}]},
            "peers": {peer: {"layout": f"l-{peer}", "ratio": ratios[peer]}
                      for peer in kernels.PEER_NAMES}}


def test_part_kernels_alternates_the_kernels_and_takes_medians():
    seen = []

    class FakeRunner:
        mode = "full"
        env = {"PATH": "/bin"}
        args = SimpleNamespace(part_timeout=10)

        def mpi(self, n, script, *extra, timeout):
            forced = self.env.get("OPENBLAS_CORETYPE") == "Haswell"
            seen.append("forced" if forced else "own")
            i = len(seen)
            base = 0.8 if forced else 0.5
            return _job("Haswell" if forced else "SkylakeX",
                        {peer: base + 0.01 * i for peer in kernels.PEER_NAMES})
    r = FakeRunner()
    res = kernels.part_kernels(r)
    assert seen == ["own", "forced", "forced", "own"] * 2 + ["own", "forced"]
    assert r.env == {"PATH": "/bin"}
    own = res["kernels"]["own"]["peers"]["ddp"]
    assert own["round_ratios"] == pytest.approx([0.51, 0.54, 0.55, 0.58, 0.59])
    assert own["ratio"] == pytest.approx(0.55)
    lines = "\n".join(kernels.markdown_lines(res))
    assert "| DDP | `l-ddp` | 0.860 (0.820-0.900) | 0.550 (0.510-0.590) |" in lines
    assert "numpy's own kernel (SkylakeX)" in lines


def test_results_md_keeps_the_sections_it_does_not_write(tmp_path):
    md = tmp_path / "results.md"
    md.write_text("old header\n\n## Serving\n\nserve table\n\n## GPT-2-small-shaped step at "
                  "one rank\n\nold gpt2\n\n## Memory\n\nmemory table\n")
    generated = "new header\n\n## GPT-2-small-shaped step at one rank\n\nnew\n"
    kept = run_all.kept_sections(md, generated)
    assert kept == "\n## Serving\n\nserve table\n\n## Memory\n\nmemory table\n"
    assert run_all.kept_sections(tmp_path / "missing.md", generated) == ""


def test_gpt_small_section_and_headline():
    res = {"model": dict(gpt_small.SIZES["full"]), "gflop_per_step": 200.0,
           "matmul_gflops": 100.0, "ours_gflops": 70.0, "gpt_mfu_fraction": 0.7,
           "mfu_fraction_paired": 0.71, "samples": 5, "ours_adamw_over_matmul": 0.6,
           "profile": {"steps": 2, "profiled_s": 1.0, "top": [
               {"function": "functional.py:1(gelu)", "tottime_s": 0.1, "share": 0.1,
                "calls": 24}]}}
    text = "\n".join(gpt_small.markdown_lines(res))
    assert "`gpt_mfu_fraction` 0.700 (paired 0.710" in text
    assert "| `functional.py:1(gelu)` | 10.0% | 24 |" in text
    assert run_all.headline({"gpt_small": res})["gpt2_small_mfu_fraction"] == 0.7

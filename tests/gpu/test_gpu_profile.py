"""The GPU profile (benchmarks/gpu_profile.sh, gpu_profile.py) on the CPU stand-in.

The exact command a GPU node runs, with GPU_PROFILE_STANDIN=1: tests/device_double.py in
place of cupy, tiny sizes. It must exit 0 inside its time box and write one JSON line per
measurement: the exactness tests passed, the step timed fused and unfused (MPISHARD_FUSED
1 and 0) and PyTorch's, every unit type forward and backward both ways, and torch.profiler's
kernel tables of the three steps (on the stand-in only PyTorch's has rows: the profiler sees
torch's CPU ops, not the stand-in's numpy); the log holds every PROFILE line.
"""
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import leftovers

ROOT = Path(__file__).resolve().parents[2]
UNITS = {"embedding", "layernorm", "linear_qkv", "linear_proj", "linear_fc", "linear_fc2",
         "attention_core", "gelu", "head", "loss", "adamw"}


def test_gpu_profile_standin(tmp_path):
    env = dict(os.environ, GPU_PROFILE_STANDIN="1", GPU_PROFILE_OUT=str(tmp_path),
               PYTHON=sys.executable, GPU_PROFILE_TIMEOUT="240")
    env.pop("OUT", None)
    before = leftovers.mpi_files()
    proc = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_profile.sh")], env=env,
                          capture_output=True, text=True, timeout=270, cwd=tmp_path)
    for path in leftovers.left_since(before):     # Open MPI singletons keep their segment
        if os.path.basename(path).startswith("sm_segment."):
            os.unlink(path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = [json.loads(line) for line in (tmp_path / "gpu_profile.jsonl").read_text()
            .splitlines()]
    by = {}
    for r in recs:
        by.setdefault(r["part"], []).append(r)
    assert [r["ok"] for r in by["exactness"]] == [True]
    (step,) = [r for r in by["step"] if "fused_s" in r]
    assert "fused_error" not in json.dumps(by["step"])
    torch_peer = importlib.util.find_spec("torch") is not None     # make test's venv has none
    for key in ("fused_s", "unfused_s") + (("torch_s",) if torch_peer else ()):
        assert step[key] > 0
    assert ("torch_s" in step) == torch_peer and step["compute_dtype"] == "float32"
    units = by["unit"]
    assert not [r for r in units if "error" in r or "skipped" in r]
    assert {r["unit"] for r in units} == UNITS
    for r in units:
        assert r["fused_s"] > 0 and r["unfused_s"] > 0 and r["count"] >= 1
    assert {(r["unit"], r["what"]) for r in units} >= {(u, w) for u in UNITS - {"loss", "adamw"}
                                                        for w in ("forward", "backward")}
    if not torch_peer:                     # the kernel profile is torch.profiler's
        assert [r.get("skipped") for r in by["kernels"]] == ["no torch"]
    else:
        kernels = {r["which"]: r for r in by["kernels"]}
        assert set(kernels) == {"ours_fused", "ours_unfused", "torch_fp32"}
        assert kernels["torch_fp32"]["top"] and all(
            row["ms_per_step"] >= 0 and row["calls"] >= 1 for row in kernels["torch_fp32"]["top"])
    log = (tmp_path / "gpu_profile.log").read_text()
    assert log.count("PROFILE ") == len(recs) and "gpu_profile: exit 0" in log

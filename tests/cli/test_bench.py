"""Smoke test of `make bench` (benchmarks/run_all.py) so the harness does not rot.

Runs the harness end to end in --tiny mode (toy sizes, 2-4 ranks through mpiexec, ~30 s) and
checks what it writes: every part produced numbers (with torch installed, the torch peers too),
and a crashing benchmark fails the run. The report formatting and the no-torch path are checked
directly. The timings themselves are only checked to be positive: the machine is shared.
"""
import importlib.util
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))

import bench_parts  # noqa: E402
import peers_torch  # noqa: E402
import run_all  # noqa: E402
import leftovers  # noqa: E402
from conftest import mpiexec_cmd, run_mpi, run_python  # noqa: E402

HAVE_TORCH = importlib.util.find_spec("torch") is not None


def _mpiexec():
    """The launch prefix run_all.py prepends (it adds `-n N`): conftest's MPIEXEC and
    MPIEXEC_FLAGS, as one string."""
    return shlex.join(mpiexec_cmd(1)[:-2])


def test_run_all_tiny_end_to_end(tmp_path):
    out, md = tmp_path / "results.json", tmp_path / "results.md"
    parts = "mfu,collectives,peers,gpt,planner,scaling-dp,scaling-pp"
    proc = run_python(                         # some parts run without a launcher
        [str(BENCH / "run_all.py"), "--mpiexec", _mpiexec(), "--tiny",
         "--parts", parts, "--out", str(out), "--md", str(md), "--part-timeout", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert res["meta"]["mode"] == "tiny" and res["meta"]["threads_per_rank"] >= 1
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert res["meta"]["commit"].split("-")[0] == head
    # every part either produced numbers or says why not; none crashed
    for part in ("mfu", "collective_overhead", "peers"):
        assert "error" not in json.dumps(res[part]), res[part]
    assert not any("error" in m for m in res["planner"]["models"].values()), res["planner"]
    coll = res["collective_overhead"]["2"]
    kinds = {r["kind"] for r in coll["rows"]}
    assert kinds == {"all_reduce", "all_reduce_out", "all_gather", "reduce_scatter",
                     "all_to_all", "all_to_all_v"}
    assert all(r["ratio"] > 0 and r["ranks"] == 2 for r in coll["rows"])
    assert max(r["bytes"] for r in coll["rows"]) == 1024 * 1024     # tiny adds 1 MiB
    # each kind's headline: its (only) 1 MiB row, with its trials' range
    for kind, key in bench_parts.COLLECTIVE_KEYS.items():
        (row,) = [r for r in coll["rows"] if r["kind"] == kind and r["bytes"] == 1024 * 1024]
        assert res["headline"][key] == row["ratio"]
        lo, hi = res["headline_spread"][key]
        assert lo <= row["ratio"] <= hi
    single, gpt2 = res["peers"]["single"], res["peers"]["gpt2"]
    if not HAVE_TORCH:                   # the one reason a torch comparison may be skipped
        assert "torch is not installed" in single["skipped"] and "skipped" in gpt2
    else:                                # same work on both sides
        assert single["max_loss_rel_diff"] < 1e-4
        assert res["headline"]["vs_torch_single_step_ratio"] == single["ratio"]
        assert gpt2["ranks"] == 2 and set(gpt2["peers"]) == {"ddp", "fsdp", "tp", "local"}
        for peer, row in gpt2["peers"].items():
            assert row["ours_s"] > 0 and row["torch_s"] > 0 and row["ratio_paired"] > 0
            assert row["ours_loss_rel_diff"] < 1e-5 and row["torch_loss_rel_diff"] < 1e-5
            if peer != "local":
                assert res["headline"][f"vs_torch_{peer}_gpt_step_ratio"] == row["ratio"]
                assert row["torch_max_grad_rel_diff"] < 1e-4
        assert "| `tp=2` | parallelize_module" in md.read_text()
    gpt = res["gpt"]
    assert gpt["mfu_fraction"] > 0 and gpt["gflop_per_step"] > 0
    if HAVE_TORCH:                       # the two GPTs agree on the weights
        assert gpt["cross_check"]["loss_rel_diff"] < 1e-5
        assert gpt["cross_check"]["max_grad_rel_diff"] < 1e-4
        assert res["headline"]["gpt_vs_torch_step_ratio"] == gpt["vs_torch_ratio"]
        assert res["headline"]["vs_torch_gpt_step_ratio"] == gpt["vs_torch_ratio"]
    planner = res["planner"]
    for name, model in planner["models"].items():      # plan --validate 3 --json, 4 ranks
        v = model["validate"]
        assert len(v["layouts"]) == 3 and v["median_abs_error"] >= 0 and v["best_gap"] >= 0
    assert set(planner["models"]) == {"mlp", "gpt"}
    assert res["headline"]["planner_median_error"] == max(
        m["validate"]["median_abs_error"] for m in planner["models"].values())
    assert res["headline"]["planner_best_gap"] == max(
        m["validate"]["best_gap"] for m in planner["models"].values())
    dp = res["scaling"]["dp"]
    assert dp["ranks"] == 2 and dp["dp_efficiency"] > 0
    pp = res["scaling"]["pp"]
    assert pp["gpipe"]["peak_stashed"] >= pp["1f1b"]["peak_stashed"]
    assert pp["gpipe"]["peak_activation_bytes"] > pp["1f1b"]["peak_activation_bytes"]
    assert pp["zb1p"]["peak_stashed"] == pp["1f1b"]["peak_stashed"]     # ZB-H1's memory
    for name in ("gpipe", "1f1b", "interleaved", "zb1p"):
        s = pp[name]
        lo, hi = s["bubble_measured_range"]
        assert 0 <= lo <= s["bubble_measured"] <= hi < 1
        assert 0 <= s["bubble_simulated"] < 1
        assert s["step_s"] > 0
    assert pp["zb1p"]["bubble_schedule"] < pp["1f1b"]["bubble_schedule"]
    assert res["headline"]["zb1p_bubble_ratio"] == pytest.approx(
        pp["zb1p"]["bubble_measured"] / pp["1f1b"]["bubble_measured"])
    text = md.read_text()
    assert text.startswith(f"Measured at commit `{res['meta']['commit']}`")
    assert "| figure | value | target | met |" in text
    for key in run_all.TARGETS:
        assert f"| `{key}` |" in text
    assert "| zb1p |" in text and "| mlp `64,32,32,16` | 32 | 3 |" in text


def test_a_crashing_benchmark_fails_the_run(tmp_path):
    """Defect 13: the pipeline benchmark raising (BENCH_FAIL=pp) is an error in results.json
    and results.md and makes run_all exit non-zero, not a 'skipped' that tests step over."""
    out, md = tmp_path / "results.json", tmp_path / "results.md"
    before = leftovers.mpi_files()
    proc = subprocess.run(
        [sys.executable, str(BENCH / "run_all.py"), "--mpiexec", _mpiexec(), "--tiny",
         "--parts", "scaling-pp", "--out", str(out), "--md", str(md), "--part-timeout", "120"],
        cwd=ROOT, capture_output=True, text=True, timeout=200,
        env={**os.environ, "BENCH_FAIL": "pp"})
    for path in leftovers.left_since(before):  # it raises before any make_engine: mpi4py's
        os.unlink(path)                        # own abort, not mpishard's report, ends it
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    pp = json.loads(out.read_text())["scaling"]["pp"]
    assert "skipped" not in pp and "made to fail" in pp["error"], pp
    assert "FAILED scaling.pp: exit" in proc.stderr
    assert "Pipeline: exit" in md.read_text()


def test_failures_names_every_part_that_crashed():
    results = {"mfu": {"sizes": [{"mfu_fraction": 0.8}, {"error": "exit 1: boom"}]},
               "peers": {"single": {"skipped": "torch is not installed"},
                         "gpt2": {"error": "timed out after 600 s"}},
               "planner": {"models": {"mlp": {"validate": {"layouts": [{"error": -0.2}]}}}},
               "scaling": {"pp": {"zb1p_bubble_ratio": 0.5}}}
    assert run_all.failures(results) == [("mfu.sizes[1]", "exit 1: boom"),
                                         ("peers.gpt2", "timed out after 600 s")]
    assert run_all.failures({"peers": {"single": {"skipped": "torch is not installed"}}}) == []


def test_report_marks_targets_met_or_not():
    mib = 1024 * 1024

    def row(kind, ranks, nbytes, trials):
        return {"kind": kind, "ranks": ranks, "bytes": nbytes,
                "ratio": sorted(trials)[len(trials) // 2], "trial_ratios": trials}
    coll = {"2": {"rows": [row("all_gather", 2, mib, [1.02, 1.04, 1.03]),
                           row("all_gather", 2, 64 * 1024, [3.0]),    # < 1 MiB: not counted
                           row("all_reduce_out", 2, mib, [1.05])]},
            "4": {"rows": [row("all_gather", 4, 4 * mib, [1.2, 1.07, 1.09]),
                           row("all_reduce", 4, mib, [1.25])]}}
    coll.update(bench_parts.worst_collectives(coll))
    assert coll["worst"]["allgather_overhead_ratio"]["spread"] == [1.07, 1.2]
    results = {
        "mfu": {"mfu_fraction": 0.8},
        "collective_overhead": coll,
        "peers": {"single": {"skipped": "torch is not installed"}},
        "planner": {"planner_median_error": 0.15, "planner_best_gap": 0.12},
        "scaling": {"dp": {"dp_efficiency": 0.9}, "pp": {"zb1p_bubble_ratio": 0.6}},
    }
    results["headline"] = run_all.headline(results)
    results["headline_spread"] = run_all.spreads(results)
    results["meta"] = {"commit": "abc123", "date": "d", "machine": "m", "command": "c",
                       "mode": "quick", "threads_per_rank": 1, "wall_s": 1.0}
    text = run_all.markdown(results)
    assert text.startswith("Measured at commit `abc123`, d on m")
    assert "| `mfu_fraction` | 0.800 | >= 0.75 | yes |" in text
    assert "| `allreduce_overhead_ratio` | 1.050 (1.050-1.050) | <= 1.1 | yes |" in text
    assert "| `allreduce_overhead_ratio_default` | 1.250 (1.250-1.250) | <= 1.1 | no |" in text
    assert "| `allgather_overhead_ratio` | 1.090 (1.070-1.200) | <= 1.1 | yes |" in text
    assert "| `reduce_scatter_overhead_ratio` | not measured | <= 1.1 | - |" in text
    assert "| `vs_torch_single_step_ratio` | skipped: torch is not installed |" in text
    assert "| `planner_median_error` | 0.150 | <= 0.2 | yes |" in text
    assert "| `planner_best_gap` | 0.120 | <= 0.1 | no |" in text
    assert "| `zb1p_bubble_ratio` | 0.600 | < 1.0 | yes |" in text
    assert "| `dp_1_to_2_efficiency` | 0.900 |" in text


def test_peers_skip_with_a_message_without_torch(monkeypatch):
    monkeypatch.setattr(peers_torch, "torch_or_none", lambda: None)
    for res in (peers_torch.run_single([4, 4], 2, 1), peers_torch.run_torch_ddp2([4, 4], 2, 1),
                peers_torch.run_gpt_peers({}, 1)):
        assert "torch is not installed" in res["skipped"]


def test_unknown_part_is_refused():
    with pytest.raises(SystemExit):
        run_all.main(["--parts", "collectives,nope"])


@pytest.mark.parametrize("spec,sa,sb", [("bij,bjk->bik", (3, 4, 5), (3, 5, 2)),
                                        ("ebd,edf->ebf", (2, 3, 4), (2, 4, 6)),
                                        ("bd,df->bf", (3, 4), (4, 5))])
def test_cached_einsum_paths_give_the_same_numbers(spec, sa, sb, monkeypatch):
    import numpy as np

    from mpishard.nn import functional as nn

    rng = np.random.default_rng(0)
    a, b = rng.standard_normal(sa), rng.standard_normal(sb)
    want = np.einsum(spec, a, b)
    monkeypatch.setattr(nn, "CACHE_PATHS", False)
    off = nn.einsum(spec, a, b)
    monkeypatch.setattr(nn, "CACHE_PATHS", True)
    on1, on2 = nn.einsum(spec, a, b), nn.einsum(spec, a, b)
    for got in (off, on1, on2):
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)
    if nn._matmul_plan(spec) is None:            # the path was computed once and kept
        assert (spec, sa, sb) in nn._PATHS


def test_sync_points_runs_and_reports_every_group(tmp_path):
    """benchmarks/sync_points.py at 2 ranks: a row per chunk for the one group that fits,
    each with the chunk's seconds and the sync point's cost and share."""
    out = tmp_path / "sync.json"
    proc = run_mpi(2, BENCH / "sync_points.py", "--json", out, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads(out.read_text())
    assert [(r["ranks"], r["group"]) for r in rows] == [(2, 2), (2, 2)]
    assert all(r["chunk_s"] > 1e-4 and r["share"] == r["sync_s"] / r["chunk_s"] for r in rows)
    assert "2 ranks, group 2:" in proc.stdout

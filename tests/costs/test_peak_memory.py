"""costs/peak_memory.rank_peak: the predicted peak against each rank's measured high-water
mark (benchmarks/memory_check.py's small ci- cases, each its own 2-rank mpiexec job), and
the pieces it is built from (schedule in-flight microbatches, components adding up)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import mpishard as ms
from mpishard.costs.peak_memory import COMPONENTS, in_flight, rank_peak

ROOT = Path(__file__).resolve().parents[2]
CHECK = ROOT / "benchmarks" / "memory_check.py"


def test_in_flight_follows_the_schedule():
    """GPipe holds every microbatch on every stage; 1F1B at most pp - stage; interleaved
    counts a chunk's microbatch as 1/v of the stage's."""
    gpipe = ms.parse_layout("pp=4,schedule=gpipe,microbatches=8")
    assert [in_flight(gpipe, s) for s in range(4)] == [8, 8, 8, 8]
    one_f = ms.parse_layout("pp=4,microbatches=8")
    assert [in_flight(one_f, s) for s in range(4)] == [4, 3, 2, 1]
    assert in_flight(ms.parse_layout("single"), 0) == 1
    inter = ms.parse_layout("pp=2,schedule=interleaved,microbatches=4")
    assert 1 <= in_flight(inter, 0) <= 4


def test_components_add_up_and_follow_the_layout():
    model = ms.GPT(512, 64, 64, 4, 4)
    single = rank_peak(model, ms.parse_layout("single"), 0, 8)
    assert single["total"] == sum(single[k] for k in COMPONENTS)
    tp = rank_peak(model, ms.parse_layout("tp=2"), 0, 8)
    assert tp["activations"] < single["activations"] and tp["parameters"] < \
        single["parameters"]
    recompute = rank_peak(model, ms.parse_layout("single"), 0, 8, recompute="1")
    assert recompute["activations"] < single["activations"]
    cached = rank_peak(model, ms.parse_layout("single"), 0, 8, generate=(2, 64))
    # k and v of 4 blocks, 2 rows x 64 positions x 64 wide, float32, and the prefill logits
    assert cached["kv_cache"] == 2 * 4 * 2 * 64 * 64 * 4 + 2 * 64 * 512 * 4


def test_predicted_peak_within_15_percent_of_the_measured(tmp_path):
    """Four layouts (tp, a GPipe pipeline, FSDP, a Llama's tp with sequence_parallel) of a GPT,
    an MLP and a Llama of about 100-200 MB per rank: every rank's prediction within 15% of
    VmHWM above its start-up size."""
    out = tmp_path / "rows.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    run = subprocess.run([sys.executable, str(CHECK), "--only", "ci-gpt-tp2",
                          "ci-gpt-pp2-gpipe", "ci-mlp-fsdp2", "ci-llama-tp2-sp", "--json",
                          str(out)],
                         capture_output=True, text=True, env=env, timeout=240)
    rows = json.loads(out.read_text()) if out.exists() else []
    assert len(rows) == 8, run.stdout + run.stderr
    for row in rows:
        assert row["measured"] > 50 * 2**20, row
        assert abs(row["error"]) <= 0.15, run.stdout

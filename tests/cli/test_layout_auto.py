"""`--layout auto` end to end in real jobs: train at 2 and 4 ranks runs the layout that
choose_layout picks in-process for the same flags and logs why; bench with a calibration
ranks by predicted time; generate picks a decoding layout; a --max-memory nothing fits in is
one error line and exit code 2 from every rank."""
import json
from pathlib import Path

import pytest

from conftest import engine_lines, run_mpi
from mpishard.cli.auto_layout import choose_layout
from mpishard.cli.model_flag import model_from_flag
from mpishard.cli.plan import plan_layouts

ROOT = Path(__file__).resolve().parents[2]
CALIBRATION = ROOT / "examples" / "calibration.example.json"
DIGITS = "64,128,128,10"                       # train's default model for digits


def auto_line(text):
    lines = [line for line in engine_lines(text) if "layout auto:" in line]
    assert len(lines) == 1, text[-3000:]
    return lines[0]


@pytest.mark.parametrize("n", [2, 4])
def test_train_runs_the_chosen_layout_and_logs_why(n):
    model = model_from_flag(DIGITS, "relu")
    rows, _ = plan_layouts(model, n, 64)
    limit = sorted(r["memory"] for r in rows)[len(rows) // 2]     # some fit, some do not
    want = choose_layout(model, n, limit, 64)
    assert any(r["memory"] > limit for r in rows)
    r = run_mpi(n, "-m", "mpishard", "train", "--layout", "auto", "--max-memory", str(limit),
                "--steps", "2", "--no-progress", "--log-every", "0", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = auto_line(r.stdout + r.stderr)
    assert f"layout auto: {want['layout']} (" in line and "no --calibration" in line
    assert f"{want['line'].split('; ')[2]}" in line                # k of N layouts fit in ...
    assert f"layout {want['layout']}:" in r.stdout + r.stderr      # the run's own line


def test_nothing_fits_is_one_error_and_exit_2_on_every_rank():
    r = run_mpi(2, "-m", "mpishard", "train", "--layout", "auto", "--max-memory", "16K",
                "--steps", "1", "--no-progress", timeout=300)
    assert r.returncode == 2, r.stdout[-2000:] + r.stderr[-2000:]
    errors = [line for line in engine_lines(r.stderr) if line.startswith("mpishard: error:")]
    assert len(errors) == 1 and "no layout of 2 rank(s) fits in 16.0 KiB per rank" in errors[0]
    assert "Traceback" not in r.stderr
    bad = run_mpi(2, "-m", "mpishard", "train", "--layout", "auto", "--max-memory", "lots",
                  "--steps", "1", "--no-progress", timeout=300)
    assert bad.returncode == 2 and "expected a positive number of bytes" in bad.stderr


def test_bench_with_a_calibration_ranks_by_predicted_time():
    model = model_from_flag("64,256,256,10", "relu")
    want = choose_layout(model, 4, 2 ** 30, 64,
                         calibration=json.loads(CALIBRATION.read_text()))
    r = run_mpi(4, "-m", "mpishard", "bench", "--model", "64,256,256,10", "--layout", "auto",
                "--max-memory", "1G", "--calibration", CALIBRATION, "--steps", "1",
                "--warmup", "0", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = auto_line(r.stdout)
    assert f"layout auto: {want['layout']} (predicted" in line and "step time" in line
    assert f"layout {want['layout']!r} on 4 rank(s)" in r.stdout


def test_generate_picks_a_decoding_layout(tmp_path):
    ckpt = tmp_path / "ckpt"
    r = run_mpi(1, "-m", "mpishard", "train", "--model", "gpt", "--gpt",
                "d_model=32,n_heads=4,n_layers=2,seq_len=16", "--text", ROOT / "README.md",
                "--steps", "1", "--no-progress", "--checkpoint-dir", ckpt, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    r = run_mpi(2, "-m", "mpishard", "generate", "--checkpoint", ckpt, "--layout", "auto",
                "--prompt", "ab", "--prompt", "cd", "--max-new-tokens", "2",
                "--temperature", "0", timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    line = auto_line(r.stderr)
    assert line.startswith("mpishard: layout auto: dp=2 (KV cache, 0 B sent per decode step")
    assert "--- prompt 1 ---" in r.stdout

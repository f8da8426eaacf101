"""The chapter examples run under mpiexec, agree with their references and print on rank 0 only.

Serial tests: each launches `mpiexec -n N python -m mpi4py examples/<script>` (single on 1 rank,
dp and tp on 2; the GPT examples, tp + sequence parallel, cp ring and Ulysses, pp 1F1B and
GPipe, on 2) with a timeout, and checks the return code, the launch line in the docstring,
and that every line is printed once (a line printed by every rank would appear N times).
"""
import ast
from collections import Counter
from pathlib import Path

import pytest

from conftest import run_mpi

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"

CHAPTER = [("chapter_single.py", 1, "single device"),
           ("chapter_data_parallel.py", 2, "data parallel dp=2"),
           ("chapter_tensor_parallel.py", 2, "tensor parallel tp=2")]
GPT = [("gpt_tensor_sequence_parallel.py", 2, "GPT tensor parallel tp=2"),
       ("gpt_context_parallel.py", 2, "GPT context parallel cp=2"),
       ("gpt_pipeline.py", 2, "GPT pipeline pp=2")]


def run(script, n, timeout=120):
    proc = run_mpi(n, EXAMPLES / script, timeout=timeout)
    print(proc.stdout)
    print(proc.stderr[-3000:])
    return proc


@pytest.mark.parametrize("script,n,banner", CHAPTER, ids=[c[0] for c in CHAPTER])
def test_chapter_example(script, n, banner):
    proc = run(script, n)
    assert proc.returncode == 0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[0].startswith(banner)
    repeated = {line: c for line, c in Counter(lines).items() if c > 1}
    assert not repeated, f"lines printed more than once (by several ranks?): {repeated}"
    steps = [line for line in lines if line.startswith("step ")]
    assert len(steps) == 5
    losses = [float(line.split()[3]) for line in steps]
    assert losses == sorted(losses, reverse=True), f"loss should fall: {losses}"
    assert "OK, tolerance 1e-09" in lines[-1]


@pytest.mark.parametrize("script,n,banner", GPT, ids=[c[0] for c in GPT])
def test_gpt_example_agrees_with_single(script, n, banner):
    """Each GPT example trains its layouts beside single (float64) and says OK; the loss it
    prints per step equals single's to the printed digits."""
    proc = run(script, n)
    assert proc.returncode == 0
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    assert lines and lines[0].startswith(banner)
    repeated = {line: c for line, c in Counter(lines).items() if c > 1}
    assert not repeated, f"lines printed more than once (by several ranks?): {repeated}"
    steps = [line.split() for line in lines if " step " in line and " single " in line]
    assert len(steps) == 6, steps                    # 3 steps for each of two layouts
    assert all(row[4] == row[6] for row in steps), steps
    assert "OK, tolerance 1e-09" in lines[-1]


@pytest.mark.parametrize("script,n,banner", CHAPTER + GPT, ids=[c[0] for c in CHAPTER + GPT])
def test_docstring_has_launch_line(script, n, banner):
    doc = ast.get_docstring(ast.parse((EXAMPLES / script).read_text()))
    assert f"mpiexec -n {n} python -m mpi4py examples/{script}" in doc


def test_tensor_parallel_example_rejects_a_world_that_does_not_divide_the_hidden_size():
    """At 3 ranks tp=3 does not divide 64: every rank raises the same ValueError, the job
    ends non-zero instead of hanging."""
    proc = run("chapter_tensor_parallel.py", 3, timeout=60)
    assert proc.returncode != 0
    assert "tp=3 does not divide the hidden size 64" in proc.stderr

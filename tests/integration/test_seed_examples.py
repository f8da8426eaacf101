"""The examples from the ShardedEngine chapter's notebooks (examples/seed_*.py: the BCE
classifier under every layout, memory per rank) run briefly on 2 ranks and say what they should.

    pytest -m "not mpi" tests/integration/test_seed_examples.py

Serial tests: each launches `mpiexec -n 2 python -m mpi4py examples/<script> ...` with a short
run, and the memory accounting is checked against formulas from the shapes.
"""
import importlib.util
import re
from pathlib import Path

import mpishard as ms
from conftest import run_mpi

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def launch(n, script, *args, timeout=240):
    r = run_mpi(n, EXAMPLES / script, *args, timeout=timeout)
    print(r.stdout)
    print(r.stderr[-3000:])
    return r


def load_example(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def is_png(path):
    return Path(path).read_bytes()[:8] == PNG_MAGIC


# -- 16 -> 8 -> 1 sigmoid + BCE ------------------------------------------------------------------
def test_bce_example_prints_matching_columns():
    r = launch(2, "seed_bce_16_8_1.py", "--steps", 300, "--print-every", 100)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    header = next(ln for ln in r.stdout.splitlines() if ln.split()[:1] == ["step"])
    assert header.split()[1:4] == ["single", "dp=2", "tp=2"]
    rows = [ln.split() for ln in r.stdout.splitlines() if re.match(r"\s+\d+\s", ln)]
    assert [row[0] for row in rows] == ["100", "200", "300"]
    for row in rows:
        assert len(set(row[1:])) == 1, row                   # same loss printed per layout
    losses = [float(row[1]) for row in rows]
    assert losses[-1] < losses[0]
    for layout in ("dp=2", "tp=2"):
        d = float(re.search(rf"{layout}: max relative difference from single over all steps "
                            r"(\S+)", r.stdout).group(1))
        assert d <= 1e-9


# -- the 784-512-256-128-10 classifier's memory ----------------------------------------------------
def test_memory_plan_against_shape_formulas():
    mod = load_example("seed_memory_placement")
    model = ms.MLP(mod.DIMS)
    full = model.num_params()
    dp = mod.plan_memory(model, "dp=4", 4)
    assert [row["bytes"] for row in dp] == [4 * full] * 4
    tp = mod.plan_memory(model, "tp=4", 4)
    replicated = 256 + 10                # biases of the row-parallel layers 1 and 3
    assert sum(row["bytes"] for row in tp) == 4 * (full + 3 * replicated)
    assert tp[0]["params"]["layer_0"] == 784 * 512 // 4 + 512 // 4
    fsdp = mod.plan_memory(model, "fsdp=4", 8)
    assert all(row["params"]["layer_3"] == 32 * 10 + 3 for row in fsdp)   # 128/4 rows, 10/4 padded


def test_memory_example_measures_the_plan(tmp_path):
    png = tmp_path / "memory.png"
    r = launch(2, "seed_memory_placement.py", "--layouts", "dp=2", "tp=2", "fsdp=2", "tp=4",
               "--png", png)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    assert "567,434 parameters" in r.stdout
    assert r.stdout.count("= the plan") == 3                 # tp=4 is shown, not built, on 2
    assert "tp=4: parameters held per rank" in r.stdout
    assert is_png(png)


# -- loss curves -----------------------------------------------------------------------------------
def test_loss_curve_plot(tmp_path):
    png = tmp_path / "curves.png"
    r = launch(2, "plot_loss_curves.py", "--steps", 12, "--png", png, "--dataset",
               "synthetic-classification", "--model", "16,32,32,16,4", "--batch", 32)
    assert r.returncode == 0 and "Traceback" not in r.stderr
    for layout in ("dp=2", "tp=2", "pp=2", "fsdp=2"):          # the defaults on 2 ranks
        if layout in ("pp=2", "fsdp=2") and f"skipping {layout}" in r.stdout:   # optional
            continue
        row = next(ln.split() for ln in r.stdout.splitlines() if ln.startswith(layout + " "))
        assert float(row[-1]) <= 1e-9, row
    assert is_png(png)

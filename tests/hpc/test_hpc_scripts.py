"""The Slurm and PBS scripts parse, run the same training command, and README.md documents it.

Serial test (no MPI): `pytest tests/hpc/test_hpc_scripts.py`.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = [ROOT / "examples" / "hpc" / "train.slurm", ROOT / "examples" / "hpc" / "train.pbs"]
README = ROOT / "README.md"
LAUNCH = "python -m mpi4py -m mpishard train"


def _logical_lines(text):
    """Lines with backslash continuations joined, so a wrapped command reads as one line."""
    return text.replace("\\\n", " ").splitlines()


def train_args(text):
    """The argument strings that follow every `python -m mpi4py -m mpishard train` in text, up to
    the scripts' `${MPISHARD_ARGS:-}` (the documented extra arguments) or a trailing `&`."""
    pattern = re.compile(re.escape(LAUNCH) + r"[ \t]+(.*?)[ \t]*(?:\$\{MPISHARD_ARGS:-\}.*|&)?$")
    found = []
    for line in _logical_lines(text):
        if line.lstrip().startswith("#"):
            continue
        m = pattern.search(line)
        if m:
            found.append(" ".join(m.group(1).split()))
    return found


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_parses_with_bash_n(script):
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("bash not installed")
    result = subprocess.run([bash, "-n", str(script)], check=False, capture_output=True, text=True)
    assert result.returncode == 0, f"bash -n {script.name} failed:\n{result.stderr}"


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_script_runs_one_train_command(script):
    args = train_args(script.read_text())
    assert len(args) == 1, f"{script.name}: expected one '{LAUNCH}' line, found {args}"
    assert "--layout" in args[0], args[0]


def test_scripts_share_the_train_arguments():
    slurm, pbs = (train_args(s.read_text())[0] for s in SCRIPTS)
    print(f"slurm: {slurm}\npbs:   {pbs}")
    assert slurm == pbs


def test_readme_documents_the_batch_command():
    expected = train_args(SCRIPTS[0].read_text())[0]
    documented = train_args(README.read_text())
    print(f"scripts: {expected}\nREADME:  {documented}")
    assert expected in documented, (
        f"README.md must quote '{LAUNCH} {expected}'; it has {documented}"
    )


def _layout_size(args):
    layout = re.search(r"--layout[ =](\S+)", args).group(1)
    size = 1
    for part in layout.split(","):
        axis, _, n = part.partition("=")
        if axis in ("dp", "fsdp", "tp", "pp", "ep"):
            size *= int(n)
    return size


def test_layout_fits_the_requested_ranks():
    slurm_text, pbs_text = (s.read_text() for s in SCRIPTS)
    nodes = int(re.search(r"^#SBATCH --nodes=(\d+)", slurm_text, re.MULTILINE).group(1))
    per_node = int(
        re.search(r"^#SBATCH --ntasks-per-node=(\d+)", slurm_text, re.MULTILINE).group(1))
    chunks, procs = map(int, re.search(
        r"^#PBS -l select=(\d+):\S*mpiprocs=(\d+)", pbs_text, re.MULTILINE).groups())
    mpiexec_n = int(re.search(r"^mpiexec -n (\d+) .*" + re.escape(LAUNCH), pbs_text,
                              re.MULTILINE).group(1))
    layout = _layout_size(train_args(slurm_text)[0])
    print(f"layout {layout}, slurm {nodes}x{per_node}, pbs {chunks}x{procs}, "
          f"mpiexec -n {mpiexec_n}")
    assert layout == nodes * per_node == chunks * procs == mpiexec_n

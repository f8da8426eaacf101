"""examples/hpc/serve.slurm outside Slurm: run by bash with MPISHARD_LAUNCH=mpiexec, it serves
a tiny model on its layout, answers a request, and the SIGUSR1 that Slurm sends before the time
limit (--signal=B:USR1@120) reaches the ranks through the script's trap: the server drains and
the script exits 0. Its `serve` command line parses and its layout fits its #SBATCH ranks.

Serial test: the script starts its own `mpiexec -n 2` job.
"""
import re
import shlex
import signal
import sys
from pathlib import Path

import pytest

from conftest import ROOT
from mpishard.cli import build_parser
from serve_job import ServeJob, references, text_of, write_model

httpx = pytest.importorskip("httpx")
SCRIPT = ROOT / "examples" / "hpc" / "serve.slurm"


def test_the_serve_command_parses_and_its_layout_fits_the_ranks():
    text = SCRIPT.read_text()
    line = next(s for s in text.splitlines() if "-m mpishard serve" in s)
    layout = re.search(r"MPISHARD_LAYOUT:-([\w=,]+)", line).group(1)
    shown = re.sub(r"\$\{MPISHARD_LAYOUT:-[^}]*\}", layout, line).replace(
        "${MPISHARD_ARGS:-}", "").replace("$port", "8000").replace("$MODEL", "./model").rstrip(" &")
    args = build_parser().parse_args(shlex.split(shown.split("-m mpishard ", 1)[1]))
    assert (args.host, args.port, args.layout) == ("127.0.0.1", 8000, layout)
    ranks = int(re.search(r"^#SBATCH --ntasks-per-node=(\d+)", text, re.M).group(1))
    sizes = [int(part.split("=")[1]) for part in layout.split(",")]
    assert int(re.search(r"^#SBATCH --nodes=(\d+)", text, re.M).group(1)) == 1
    assert sizes[0] * (sizes[1] if len(sizes) > 1 else 1) == ranks, (layout, ranks)


def test_the_script_serves_and_drains_on_sigusr1(tmp_path):
    directory = write_model(tmp_path / "gpt", "gpt")
    env = {"MODEL": directory, "MPISHARD_VENV": str(Path(sys.executable).parent.parent),
           "MPISHARD_LAUNCH": "mpiexec", "SLURM_NTASKS": "2", "MPISHARD_LAYOUT": "tp=2",
           "MPISHARD_PORT": "0", "MPISHARD_ARGS": "--tokenizer bytes --dtype float64"}
    job = ServeJob(2, [], env=env, argv=["bash", SCRIPT])
    try:
        r = httpx.post(f"{job.url}/v1/completions", timeout=60, json={
            "model": "gpt", "prompt": "slurm", "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == text_of(references(directory, [b"slurm"],
                                                                    8)[0])
    finally:
        rc, out = job.stop(signal.SIGUSR1)
    print(out[-3000:])
    assert "batch shell got SIGUSR1" in out
    assert rc == 0 and not job.left, (rc, job.left)


"""`python -m mpishard` as people use it: piped into `head`, pointed at a missing directory,
resumed without repeating --model, planning a Hugging Face directory.

    pytest -m "not mpi" tests/cli/test_command_line.py
"""
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from mpishard import cli
from mpishard.checkpoint import read_index
from mpishard.checkpoint.format import spec_text

ROOT = Path(__file__).resolve().parents[2]

PIPED = {
    "plan": ["plan", "--model", "64,256,256,10", "--world-size", "8", "--top", "50"],
    "inspect": ["inspect", "--layout", "dp=2,tp=2", "--model", "64,256,256,10"],
    "schedule": ["schedule", "--pp", "4", "--microbatches", "8"],
}


def command(*argv, mpi4py=False):
    """`python [-m mpi4py] -m mpishard argv...` as an argv list."""
    return [sys.executable, *(["-m", "mpi4py"] if mpi4py else []), "-m", "mpishard", *argv]


def run(cmd, timeout=120, **kwargs):
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True,
                          timeout=timeout, **kwargs)


@pytest.mark.parametrize("mpi4py", [False, True], ids=["python", "mpi4py"])
@pytest.mark.parametrize("name", sorted(PIPED))
def test_a_closed_pipe_ends_the_command_quietly(name, mpi4py):
    """`mpishard CMD | head -1` once head has gone: the reading end of stdout is closed before
    the command writes, so its first write meets a broken pipe. It ends with no traceback and
    no "Exception ignored" at shutdown, and exit status 128 + SIGPIPE, what a shell reports
    for a writer that head left behind."""
    read, write = os.pipe()
    os.close(read)
    try:
        proc = run(command(*PIPED[name], mpi4py=mpi4py), stdout=write)
    finally:
        os.close(write)
    print(f"rc {proc.returncode}\nstderr: {proc.stderr!r}")
    assert proc.stderr == ""
    assert proc.returncode == 128 + signal.SIGPIPE


def test_head_reads_the_first_line_of_a_long_output():
    """A real `| head -1`: a GPT's plan of 32 ranks (80 kB) is longer than what a pipe holds
    (64 kB) and head reads (8 kB) together, so the command is still writing when head exits."""
    shell = " ".join(command("plan", "--model", "gpt:d_model=64,n_heads=4,n_layers=4,seq_len=64",
                             "--world-size", "32", "--top", "100000"))
    proc = run(["bash", "-c", f"set -o pipefail; {shell} | head -1"], stdout=subprocess.PIPE)
    print(f"rc {proc.returncode}\nstdout: {proc.stdout!r}\nstderr: {proc.stderr!r}")
    assert proc.stdout.startswith("plan   GPT(")
    assert proc.stdout.count("\n") == 1 and proc.stderr == ""
    assert proc.returncode == 128 + signal.SIGPIPE


# -- small fixes ---------------------------------------------------------------------------------
def one_error_line(capfd) -> str:
    """The single `mpishard: error: ...` line a command printed (and nothing else)."""
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mpishard: error: "), err
    return err[0]


def test_generate_names_a_missing_hf_directory(tmp_path, capfd):
    missing = tmp_path / "missing"
    assert cli.main(["generate", "--hf", str(missing), "--prompt", "hi"]) == 2
    assert one_error_line(capfd) == f"mpishard: error: --hf {missing}: the directory does not exist"
    (tmp_path / "file").write_text("x")
    assert cli.main(["generate", "--hf", str(tmp_path / "file"), "--prompt", "hi"]) == 2
    assert one_error_line(capfd).endswith(f"--hf {tmp_path / 'file'}: not a directory")


TEXT = ["--corpus-bytes", "20000", "--batch", "4", "--no-progress", "--log-every", "0"]
MODELS = {
    "mlp": ["--model", "64,32,10", "--activation", "gelu", "--batch", "16", "--no-progress"],
    "gpt": ["--model", "gpt:d_model=32,n_heads=2,n_layers=1,seq_len=16,tied=1", *TEXT],
    "mixtral": ["--model", "llama:d_model=32,n_heads=4,n_kv_heads=2,n_layers=1,seq_len=16,"
                "n_experts=4,top_k=2,rope_theta=1e6", *TEXT],
}


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_resume_without_model_takes_the_checkpoints(tmp_path, capfd, kind):
    """`train --resume` without --model continues the checkpoint's model (kind and sizes);
    a --model that builds another one is refused, naming both."""
    ckpt = tmp_path / "ckpt"
    first = MODELS[kind]
    assert cli.main(["train", *first, "--steps", "2", "--checkpoint-dir", str(ckpt)]) == 0
    saved = read_index(ckpt)["model"]
    rest = [a for i, a in enumerate(first) if a not in ("--model", "--activation") and
            first[i - 1] not in ("--model", "--activation")]
    capfd.readouterr()
    assert cli.main(["train", *rest, "--steps", "3", "--checkpoint-dir", str(ckpt),
                     "--resume"]) == 0, capfd.readouterr().err
    index = read_index(ckpt)
    assert index["model"] == saved and index["step"] == 3
    capfd.readouterr()
    other = first[first.index("--model") + 1].replace("32", "48", 1)
    assert cli.main(["train", *rest, "--model", other, "--steps", "4", "--checkpoint-dir",
                     str(ckpt), "--resume"]) == 2
    line = one_error_line(capfd)
    print(line)
    assert line.startswith(f"mpishard: error: --model {other} builds ")
    assert line.endswith(f"but the checkpoint {ckpt} holds {spec_text(saved)}; leave out "
                         f"--model to take the checkpoint's")

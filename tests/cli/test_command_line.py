"""`python -m mpishard` as people use it: piped into `head`, pointed at a missing directory,
resumed without repeating --model, planning a Hugging Face directory.

    pytest -m "not mpi" tests/cli/test_command_line.py
"""
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

from mpishard import cli
from mpishard.checkpoint import read_index
from mpishard.checkpoint.format import spec_text
from mpishard.cli.cluster_options import validate_cluster_args
from mpishard.cli.flight_options import flight_dir
from mpishard.cli.model_flag import model_from_flag
from mpishard.cli.train import parse_train_args
from mpishard.comm.mesh import parse_layout

import leftovers
from conftest import mpiexec_cmd, run_mpi

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


def test_generate_on_two_ranks_piped_into_head_leaves_no_mpi_file(tmp_path):
    """`mpiexec -n 2 ... generate | head -c 1`: head exits, mpiexec dies of SIGPIPE writing
    the next token, and MPICH's proxies SIGKILL the ranks mid-generation, where nothing of
    theirs runs. The node's watcher (health/reaper.py) removes the job's /dev/shm segment and
    the proxy's topology file once the ranks are gone; nothing says "Traceback"."""
    ckpt = tmp_path / "ckpt"
    assert cli.main(["train", *MODELS["gpt"], "--steps", "1", "--checkpoint-dir", str(ckpt)]) == 0
    job = shlex.join([*mpiexec_cmd(2), *command("generate", "--checkpoint", str(ckpt),
                                                "--max-new-tokens", "3000", mpi4py=True)])
    before = leftovers.mpi_files()
    proc = run(["bash", "-c", f"set -o pipefail; {job} | head -c 1"], stdout=subprocess.PIPE)
    left = leftovers.left_since(before)
    for _ in range(50):                       # the watcher removes them once the ranks are gone
        if not left:
            break
        time.sleep(0.1)
        left = leftovers.left_since(before)
    for path in left:                         # not for the next test to find
        os.unlink(path)
    print(f"rc {proc.returncode}\nstdout: {proc.stdout!r}\nstderr: {proc.stderr[-3000:]}")
    assert proc.stdout == "\n"                # the default prompt, its first byte
    # MPICH's mpiexec dies of the SIGPIPE (141); Open MPI's prterun catches it, says "SIGPIPE
    # detected - aborting" and exits 1
    assert proc.returncode == (128 + signal.SIGPIPE if "MPICH" in MPI.Get_library_version()
                               else 1), proc.returncode
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr
    assert left == [], f"the job left the MPI library's files {left}"


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


# -- plan and inspect: --hf DIR, and what is sharded ---------------------------------------------
HF_CONFIGS = {   # a Hugging Face config.json of each architecture, and the same model as --model
    "gpt2": ({"architectures": ["GPT2LMHeadModel"], "vocab_size": 1000, "n_positions": 32,
              "n_embd": 64, "n_layer": 2, "n_head": 4},
             "gpt:vocab=1000,seq_len=32,d_model=64,n_heads=4,n_layers=2,tied=1"),
    "llama": ({"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 64,
               "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
               "num_key_value_heads": 2, "max_position_embeddings": 32, "rope_theta": 5e5,
               "rms_norm_eps": 1e-6, "tie_word_embeddings": False},
              "llama:vocab=1000,seq_len=32,d_model=64,n_heads=4,n_kv_heads=2,n_layers=2,"
              "d_ff=96,rope_theta=5e5,norm_eps=1e-6"),
    "mixtral": ({"architectures": ["MixtralForCausalLM"], "vocab_size": 1000,
                 "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                 "num_attention_heads": 4, "num_key_value_heads": 2,
                 "max_position_embeddings": 32, "num_local_experts": 4,
                 "num_experts_per_tok": 2, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                 "tie_word_embeddings": False},
                "llama:vocab=1000,seq_len=32,d_model=64,n_heads=4,n_kv_heads=2,n_layers=2,"
                "d_ff=96,rope_theta=1e6,norm_eps=1e-5,n_experts=4,top_k=2"),
}


@pytest.mark.parametrize("arch", sorted(HF_CONFIGS))
def test_plan_and_inspect_take_a_hugging_face_directory(tmp_path, capsys, arch):
    """--hf DIR is the model DIR's config.json describes (no weights there: none are read),
    the same table as the equivalent --model."""
    config, flag = HF_CONFIGS[arch]
    (tmp_path / "config.json").write_text(json.dumps(config))
    for command in (["plan", "--world-size", "4", "--batch", "8"],
                    ["inspect", "--layout", "dp=2,tp=2"]):
        assert cli.main([*command, "--hf", str(tmp_path)]) == 0
        from_hf = capsys.readouterr().out
        assert cli.main([*command, "--model", flag]) == 0
        assert from_hf == capsys.readouterr().out
        assert f"{'GPT' if arch == 'gpt2' else 'Llama'}(vocab_size=1000, seq_len=32" in from_hf


def test_plan_and_inspect_name_a_bad_hf_flag(tmp_path, capfd):
    missing = tmp_path / "missing"
    assert cli.main(["plan", "--hf", str(missing), "--world-size", "2"]) == 2
    assert one_error_line(capfd).endswith(f"--hf {missing}: the directory does not exist")
    assert cli.main(["inspect", "--layout", "dp=2", "--hf", str(tmp_path)]) == 2
    assert "config.json" in one_error_line(capfd)
    assert cli.main(["plan", "--hf", str(tmp_path), "--model", "4,8,2", "--world-size", "2"]) == 2
    assert one_error_line(capfd).endswith("give --model DIMS|gpt:...|llama:...|qwen2:... or "
                                          "--hf DIR, not both")
    assert cli.main(["plan", "--world-size", "2"]) == 2
    assert one_error_line(capfd).endswith("give --model DIMS|gpt:...|llama:...|qwen2:... or "
                                          "--hf DIR")


def placement(line) -> str:
    """The placement column of a line of inspect's shard shapes."""
    return re.split(r" on ranks [\d,]+ +", line)[-1]


def test_inspect_says_which_tensors_are_sharded(capsys):
    """Each parameter's line says along which dim and mesh axis it is split, or that it is
    replicated, and over which axes its block is copied."""
    assert cli.main(["inspect", "--layout", "dp=2,tp=2", "--model", "8,16,4"]) == 0
    out = capsys.readouterr().out
    said = {ln.split()[0]: placement(ln) for ln in out.splitlines() if ln.startswith("  layer_")}
    assert said == {"layer_0/weights": "sharded dim 1 over tp; copies over dp",
                    "layer_0/bias": "sharded dim 0 over tp; copies over dp",
                    "layer_1/weights": "sharded dim 0 over tp; copies over dp",
                    "layer_1/bias": "replicated over dp, tp"}
    assert "3 of 4 tensors sharded, 1 replicated" in out


@pytest.mark.parametrize("layout", ["tp=2,pp=2", "fsdp=2,tp=2", "fsdp=2,zero=2,cp=2",
                                    "dp=2,ep=2,tp=2"])
def test_what_inspect_calls_sharded_is_what_each_rank_holds(capsys, layout):
    """For every parameter, each `dim D over AXIS` is a split of dim D into that axis' size
    (rounded up where padded) in the block every rank holds (costs/rank_costs.py's, the
    engine's placements); a replicated one is whole on each rank holding it."""
    spec = "llama:vocab=30,seq_len=8,d_model=16,n_heads=4,n_kv_heads=2,n_layers=2,n_experts=2"
    model = model_from_flag(spec)
    mesh = parse_layout(layout)
    assert cli.main(["inspect", "--layout", layout, "--model", spec]) == 0
    out = capsys.readouterr().out
    shapes = model.param_shapes()
    checked = 0
    for line in out.splitlines():
        name = line.split()[0] if line.startswith("  ") else None
        if name not in shapes:
            continue
        block = [int(n) for n in line.split(" -> ")[1].split()[0].split("x")]
        full = list(shapes[name])
        for dim, axis, padded in re.findall(r"dim (\d) over (\w+)( \(padded\))?", line):
            full[int(dim)] = -(-full[int(dim)] // mesh.size(axis))
            assert padded or shapes[name][int(dim)] % mesh.size(axis) == 0, line
        assert block == full, line
        assert placement(line).startswith("replicated") == (full == list(shapes[name]))
        checked += 1
    assert checked == len(shapes)


# -- make clean and .gitignore -------------------------------------------------------------------
def run_outputs():
    """{path relative to the repository: is a directory} of everything that `make demo`,
    `make demo-digits` and `train --config configs/X.toml` write, from their own command
    lines as train parses them: each checkpoint directory D with D.old and D.tmp-STEP (a save
    mid-swap, checkpoint/writer.py), the flight dumps (D.flight, or flight-rank* in the
    working directory without one) and the metrics streams and files."""
    dry = subprocess.run(["make", "-n", "demo", "demo-digits"], cwd=ROOT, capture_output=True,
                         text=True, timeout=60, check=True).stdout
    runs = [shlex.split(ln.split(" -m mpishard ", 1)[1]) for ln in dry.splitlines()
            if " -m mpishard train " in ln]
    runs += [["train", "--config", str(path)] for path in sorted(ROOT.glob("configs/*.toml"))]
    assert len(runs) == 2 + len(list(ROOT.glob("configs/*.toml"))), dry
    outputs = {}
    cwd = os.getcwd()
    os.chdir(ROOT)                      # the paths of a run started in the repository root
    try:
        for argv in runs:
            args = parse_train_args(argv[1:])
            validate_cluster_args(args, complete=False)       # the default metrics stream
            if args.checkpoint_dir:
                for suffix in ("", ".old", ".tmp-400"):
                    outputs[args.checkpoint_dir + suffix] = True
            where = flight_dir(args)
            outputs.update({where: True} if where != os.getcwd() else {"flight-rank0.json": False})
            for path in (args.metrics_json, args.metrics_jsonl, args.metrics_csv):
                if path:
                    outputs[path] = False
            for path in (args.tensorboard, args.trace):
                if path:
                    outputs[path] = True
    finally:
        os.chdir(cwd)
    return {os.path.relpath(os.path.abspath(os.path.join(ROOT, p)), ROOT): d
            for p, d in outputs.items()}


def test_make_clean_and_gitignore_cover_what_the_demos_and_configs_write(tmp_path):
    outputs = run_outputs()
    print(outputs)
    assert {"demo-ckpt", "demo-ckpt.flight", "demo-ckpt.metrics.jsonl", "demo-metrics.json",
            "gpt-ckpt", "gpt-ckpt.tmp-400", "gpt-metrics.json"} <= set(outputs)
    names = [p + ("/" if d else "") for p, d in sorted(outputs.items())]
    ignored = subprocess.run(["git", "check-ignore", "--stdin"], cwd=ROOT, input="\n".join(names),
                             capture_output=True, text=True, timeout=60).stdout.split()
    assert sorted(set(names) - set(ignored)) == []
    shutil.copy(ROOT / "Makefile", tmp_path)
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    for path, is_dir in outputs.items():
        if is_dir:
            (tmp_path / path).mkdir()
            (tmp_path / path / "index.json").write_text("{}")
        else:
            (tmp_path / path).write_text("{}")
    (tmp_path / "notes.txt").write_text("mine")
    subprocess.run(["make", "-s", "clean", "VENV=.venv-absent"], cwd=tmp_path, check=True,
                   timeout=60)
    left = sorted(p.name for p in tmp_path.iterdir())
    assert left == ["Makefile", "configs", "notes.txt"]
    assert sorted(p.name for p in (tmp_path / "configs").iterdir()) == \
        sorted(p.name for p in (ROOT / "configs").iterdir())


def test_inspect_of_a_checkpoint_says_how_its_tensors_were_sharded(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    r = run_mpi(2, "-m", "mpishard", "train", "--layout", "tp=2", "--model", "64,16,10",
                "--steps", "1", "--no-progress", "--checkpoint-dir", ckpt)
    assert r.returncode == 0, r.stderr[-2000:]
    assert cli.main(["inspect", str(ckpt)]) == 0
    out = capsys.readouterr().out
    print(out)
    tail = out.split("  as saved under layout 'tp=2' (3 of 4 tensors sharded, 1 replicated):\n")
    assert [" ".join(ln.split()) for ln in tail[1].splitlines()] == [
        "layer_0/weights sharded dim 1 over tp", "layer_0/bias sharded dim 0 over tp",
        "layer_1/weights sharded dim 0 over tp", "layer_1/bias replicated over tp"]

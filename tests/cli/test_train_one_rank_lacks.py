"""`train` when one rank cannot read its input (a node-local copy missing on one node): every
rank stops with rank 1's error, one line, exit 2, instead of rank 0 waiting inside
make_engine's collectives for a rank that never comes (cli/train.py's prepare_training runs
everything that reads a file before the engine is made, and is agreed on every rank).

    pytest tests/cli/test_train_one_rank_lacks.py
"""
import os
import re
import time

import pytest

import mpishard as ms
from mpishard import cli
from conftest import engine_lines, run_mpi
from test_tokens import VOCAB, train_bpe, write_corpus

pytest.importorskip("tokenizers")

# A job of two ranks: rank 1's copy of the input named by each case is missing (the argv
# comes from sys.argv, "@" standing for the input, which rank 1 sees as root/nowhere).
SCRIPT = """
import sys
from mpi4py import MPI
from mpishard.cli import main

rank = MPI.COMM_WORLD.Get_rank()
root, cases = sys.argv[1], sys.argv[2:]
for case in cases:
    path, *argv = case.split("|")
    where = path if rank == 0 else root + "/nowhere"
    rc = main(["train", *[a.replace("@", where) for a in argv]])
    print(f"rank {rank} rc {rc}", flush=True)
"""
GPT = ["--model", "gpt", "--gpt", "d_model=16,n_heads=2,n_layers=1,seq_len=16"]
RUN = ["--steps", "1", "--batch", "4", "--no-progress", "--log-level", "WARNING", "--layout",
       "dp=2"]


def hf_dir(root) -> str:
    """A random-init Hugging Face GPT-2 directory (ms.hf.save) with the corpus's BPE."""
    model = ms.GPT(vocab_size=VOCAB, seq_len=32, d_model=16, n_heads=2, n_layers=1, tied=True)
    path = ms.hf.save(os.path.join(root, "hf"), model, model.init(seed=0))
    train_bpe(os.path.join(root, "corpus")).save(os.path.join(path, "tokenizer.json"))
    return path


def test_an_input_one_rank_lacks_is_one_error_on_every_rank(tmp_path):
    root = str(tmp_path)
    corpus = write_corpus(os.path.join(root, "corpus"))
    hf = hf_dir(root)
    tokens = os.path.join(root, "tok")
    assert cli.main(["tokenize", "--tokenizer", hf, "--text", corpus, "--out", tokens]) == 0
    cases = {                          # the input rank 1 lacks: the line naming it
        "--text": [corpus, *GPT, "--text", "@"],
        "--tokenizer": [hf, *GPT, "--text", corpus, "--tokenizer", "@"],
        "tokens:DIR": [tokens, *GPT, "--dataset", "tokens:@"],
        "--init-from-hf": [hf, "--init-from-hf", "@", "--text", corpus, "--seq-len", "16"],
    }
    start = time.monotonic()
    proc = run_mpi(2, "-c", SCRIPT, root,
                   *("|".join([path, *argv, *RUN]) for path, *argv in cases.values()),
                   timeout=120)
    took = time.monotonic() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    codes = sorted(re.findall(r"rank (\d) rc (\d+)", proc.stdout))
    assert codes == [(r, "2") for r in "01" for _ in cases], proc.stdout + proc.stderr
    errors = engine_lines(proc.stderr)
    assert len(errors) == len(cases), proc.stderr       # one line per case, from rank 0
    for line, flag in zip(errors, cases):
        assert line.startswith("mpishard: error: ") and "nowhere" in line, (flag, line)
    print(f"{len(cases)} cases in {took:.1f} s:", *errors, sep="\n")

"""`train --model gpt` (cli/train.py's build_training, the Trainer) under cp, tp and their
mixes follows single's run: the loss of every step and the validation loss equal single's in
float64 (rtol 1e-9). Under cp the trainer feeds each rank its two sequence chunks of its rows
(train/text.sequence_cut, as engine.shard_batch cuts them), targets too, and the evaluation
scores each rank's chunks with the training loss (train/evaluate.py).

MPI tests, for N in 1, 2, 4, 8:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi \
    tests/integration/test_gpt_train_layouts.py`
(a k-rank layout runs on `group_comm(k)`).
"""
import pytest
from mpi4py import MPI

from conftest import RTOL64, assert_close, group_comm
from mpishard.cli.train import build_training, parse_train_args

TINY = ["--model", "gpt", "--gpt", "d_model=16,n_heads=2,n_layers=2,seq_len=16",
        "--corpus-bytes", "20000", "--batch", "8", "--lr", "0.01", "--no-progress",
        "--log-every", "0", "--dtype", "float64", "--steps", "6", "--eval-every", "3",
        "--log-level", "WARNING"]

_REFERENCE = {}


def run(layout, comm):
    trainer = build_training(parse_train_args(["--layout", layout, *TINY]), comm)
    return trainer.fit()


def reference():
    if "single" not in _REFERENCE:
        _REFERENCE["single"] = run("single", MPI.COMM_SELF)
    return _REFERENCE["single"]


def check(layout, n):
    m, ref = run(layout, group_comm(n)), reference()
    assert_close(m["loss_history"], ref["loss_history"], rtol=RTOL64,
                 what=f"{layout} loss history")
    assert_close([e["test_loss"] for e in m["eval_history"]],
                 [e["test_loss"] for e in ref["eval_history"]], rtol=RTOL64,
                 what=f"{layout} validation losses")
    assert ref["loss_history"][-1] < ref["loss_history"][0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("layout", ["cp=2", "cp=2,cp_kind=ulysses", "tp=2"])
def test_train_on_two_ranks_follows_single(layout):
    check(layout, 2)


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["dp=2,cp=2", "tp=2,cp=2", "cp=4"])
def test_train_on_four_ranks_follows_single(layout):
    check(layout, 4)

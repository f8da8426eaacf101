"""`train --resume auto` where there is nothing to resume says so in one line (rank 0) and
starts at step 0: a missing --checkpoint-dir, an empty one, one that holds only what a crashed
first save left (tests/checkpoint/test_crashed_saves.py kills the ranks for real).

Serial tests: train in-process on one rank.
"""
import os

import pytest

from mpishard import cli
from mpishard.checkpoint import read_index

TRAIN = ["train", "--dataset", "synthetic-regression", "--model", "4,8,1", "--n-train", "32",
         "--batch", "8", "--steps", "2", "--no-progress", "--log-every", "0"]


@pytest.mark.parametrize("where", ["missing", "empty", "crashed first save"])
def test_resume_auto_with_nothing_to_resume_says_it_starts_fresh(tmp_path, capfd, where):
    ckpt = tmp_path / "ckpt"
    keep = ["--keep-last", "2"] if where == "crashed first save" else []
    if where != "missing":
        os.mkdir(ckpt)
    if where == "crashed first save":
        os.mkdir(ckpt / "step-00000003.tmp-3")          # no index: killed mid-save
    assert cli.main([*TRAIN, *keep, "--checkpoint-dir", str(ckpt), "--resume", "auto"]) == 0, \
        capfd.readouterr().err
    err = capfd.readouterr().err
    said = [s for s in err.splitlines() if "--resume auto" in s]
    print("\n".join(said))
    assert len(said) == 1 and said[0].endswith(
        f"INFO mpishard: --resume auto: no checkpoint in {ckpt}; starting fresh"), err[-2000:]
    assert read_index(ckpt)["step"] == 2 and "resumed from" not in err
    if keep:
        assert sorted(os.listdir(ckpt)) == ["step-00000002"]     # the leftover removed

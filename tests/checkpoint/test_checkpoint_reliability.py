"""Checkpoints a long job can rely on (issue 14): the directory checked before the first step,
retention of the N newest complete checkpoints, and an exact resume across layouts and world
sizes through the command line (the same batches and, in float64, the same parameters as the
uninterrupted run to 1e-12). A save that fails mid-run is injected in tests/hpc/test_faults.py.

Serial tests: the Trainer on one rank in-process, and `mpiexec` jobs for the CLI legs.
"""
import json
import os
import shutil
from collections import namedtuple

import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint import CheckpointError, Checkpointer, checkpoint_bytes, latest
from mpishard.train.data import synthetic_classification
from mpishard.train.optim import AdamW
from mpishard.train.trainer import Trainer

from conftest import assert_close, engine_lines, run_mpi

DIMS = [6, 8, 3]


def make_trainer(steps=7, ckpt=None, **kw):
    data = synthetic_classification(48, 16, d_in=DIMS[0], n_classes=DIMS[-1], seed=3)
    model = ms.MLP(DIMS)
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=5))
    t = Trainer(e, AdamW(e, lr=0.01), data, batch=16, steps=steps, progress=False,
                log_every=0, seed=11)
    if ckpt is not None:
        t.callbacks.append(Checkpointer(ckpt, **kw))
    return t


# -- before the first step -----------------------------------------------------------------------
def test_an_unwritable_directory_is_refused_before_the_first_step():
    """/proc refuses new files even to root: the probe fails, no step is taken."""
    t = make_trainer(ckpt="/proc/mpishard-ckpt", every=2)
    with pytest.raises(CheckpointError, match=r"checkpoint directory /proc is not writable"):
        t.fit()
    assert t.state.step == 0


def test_a_full_disk_is_refused_before_the_first_step(tmp_path, monkeypatch):
    """Free space below (kept + 1) checkpoints of params + AdamW moments (float64)."""
    t = make_trainer(ckpt=tmp_path / "ck", every=2, keep_last=2)
    n = sum(a * b for a, b in zip(DIMS, DIMS[1:])) + sum(DIMS[1:])
    need = checkpoint_bytes(t.engine, t.optimizer)
    assert need - ms.checkpoint.storage.HEADROOM == 3 * 8 * n        # params, exp_avg, exp_avg_sq
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 ** 9, 10 ** 9 - 1000, 1000))
    with pytest.raises(CheckpointError, match=rf"has 1000 bytes free, the checkpoints need "
                                              rf"{3 * need} \({need} bytes each, 2 kept"):
        t.fit()
    assert t.state.step == 0 and not (tmp_path / "ck" / "step-00000002").exists()


def test_the_cli_checks_the_directory_on_every_rank_and_prints_one_line():
    r = run_mpi(2, "-m", "mpishard", "train", "--dataset", "synthetic-regression", "--steps", "3",
                "--no-progress", "--checkpoint-dir", "/proc/mpishard-ckpt", timeout=120)
    lines = engine_lines(r.stderr)             # without the launcher's own lines
    print(r.stderr[-2000:])
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(lines) == 1 and lines[0].startswith(
        "mpishard: error: checkpoint directory /proc is not writable: "), lines


# -- retention -----------------------------------------------------------------------------------
def test_keep_last_keeps_the_newest_complete_checkpoints(tmp_path):
    ck = tmp_path / "ck"
    t = make_trainer(ckpt=ck, every=2, keep_last=2)
    m = t.fit()
    assert sorted(os.listdir(ck)) == ["step-00000006", "step-00000007"]
    assert m["checkpoint_failures"] == 0 and m["checkpoint_last_step"] == 7
    os.mkdir(ck / "step-00000009")                   # incomplete (no index): never the newest
    assert latest(ck) == str(ck / "step-00000007")
    ckpt = ms.checkpoint.load(ck)                    # the newest complete one
    assert ckpt.step == 7 and ckpt.path.endswith("step-00000007")
    ckpt.verify()
    data = ckpt.extra["data"]
    assert (data["epoch"], data["batch_index"], data["samples"]) == (2, 1, 7 * 16)
    # a resumed run continues from it, and one more save prunes step 6, never step 7 first
    r = make_trainer(steps=8, ckpt=ck, every=2, keep_last=2)
    assert ms.checkpoint.resume(r, ck) == 7
    r.fit()
    assert sorted(os.listdir(ck)) == ["step-00000007", "step-00000008", "step-00000009"]


def test_the_two_retention_kinds_do_not_mix(tmp_path):
    make_trainer(steps=2, ckpt=tmp_path / "single").fit()
    with pytest.raises(CheckpointError, match="holds a single checkpoint"):
        make_trainer(steps=2, ckpt=tmp_path / "single", keep_last=3).fit()
    make_trainer(steps=2, ckpt=tmp_path / "kept", keep_last=3).fit()
    with pytest.raises(CheckpointError, match="holds step folders"):
        make_trainer(steps=2, ckpt=tmp_path / "kept").fit()


# -- exact resume across layouts through the CLI ---------------------------------------------
MLP_ARGS = ["--dataset", "synthetic-classification", "--model", "16,16,16,4", "--n-train", "64",
            "--batch", "16", "--optimizer", "adamw", "--lr", "0.01", "--weight-decay", "0.05"]
GPT_ARGS = ["--model", "gpt", "--gpt", "d_model=16,n_heads=2,n_layers=2,seq_len=8",
            "--text", "synthetic:4", "--corpus-bytes", "6000", "--batch", "8", "--lr", "0.01",
            "--train-stride", "3"]
LEGS = [(4, "dp=2,tp=2"), (2, "pp=2"), (1, "single")]


def resume_legs(tmp_path, args, k):
    """The uninterrupted run (single, 3k steps, checkpoints at k, 2k, 3k kept) and the same run
    in three legs of k steps under dp=2,tp=2 on 4 ranks, pp=2 on 2, single on 1, each resuming
    the previous leg's checkpoint."""
    common = ["-m", "mpishard", "train", *args, "--dtype", "float64", "--no-progress",
              "--log-every", "0", "--checkpoint-every", str(k), "--keep-last", "3"]
    whole, legs = tmp_path / "whole", tmp_path / "legs"
    r = run_mpi(1, *common, "--steps", 3 * k, "--checkpoint-dir", whole,
                "--metrics-json", tmp_path / "whole.json", timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    for i, (n, layout) in enumerate(LEGS):
        resume = ["--resume"] if i else []
        r = run_mpi(n, *common, "--steps", (i + 1) * k, "--layout", layout, "--checkpoint-dir",
                    legs, *resume, "--metrics-json", tmp_path / "legs.json", timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        assert "other data settings" not in r.stderr
    a, b = (json.loads((tmp_path / f).read_text()) for f in ("whole.json", "legs.json"))
    assert_close(b["loss_history"], a["loss_history"], rtol=1e-12, what="loss, step by step")
    for step in (k, 2 * k, 3 * k):
        want = ms.checkpoint.load(whole / f"step-{step:08d}")
        got = ms.checkpoint.load(legs / f"step-{step:08d}")
        assert got.step == want.step == step
        assert got.extra["data"] == want.extra["data"]      # position, samples, shuffle digest
        for name in want:
            assert_close(np.asarray(got[name]), np.asarray(want[name]), rtol=1e-12,
                         what=f"step {step} {name}")
        for name in want:
            for key, v in want.optimizer_state(name).items():
                if not np.isscalar(v):
                    assert_close(np.asarray(got.optimizer_state(name)[key]), np.asarray(v),
                                 rtol=1e-12, what=f"step {step} {name} {key}")
    return a, b


def test_exact_resume_across_layouts_and_world_sizes(tmp_path):
    """MLP, AdamW, 4 steps per epoch and legs of 3 steps: each resume lands mid-epoch and the
    next epoch's shuffle is crossed inside a leg."""
    resume_legs(tmp_path, MLP_ARGS, 3)


def test_exact_resume_of_a_gpt_across_layouts(tmp_path):
    a, b = resume_legs(tmp_path, GPT_ARGS, 2)
    assert_close(b["val_loss"], a["val_loss"], rtol=1e-12, what="val loss")

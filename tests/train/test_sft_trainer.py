"""The Trainer on fine-tune rows (train/sft_rows.py): masked labels, packed or padded rows.

A step's loss and gradients are the single-device engine's on the whole global batch, its
mean over the counted targets of all rows (train_step's count=, packed rows' documents=), in
float64 at rtol 1e-9, for several layouts and with gradient accumulation (accumulate=2 gives
the same step as accumulate=1). The evaluation's test loss is the mean over the counted
targets of the test rows.

    mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_sft_trainer.py
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.train.examples import ExampleTokens
from mpishard.train.optim import SGD
from mpishard.train.sft_rows import IGNORE_INDEX, example_dataset
from mpishard.train.summary import rate_text
from mpishard.train.trainer import Trainer, configure_logging

from conftest import assert_close, assert_dicts_close, group_comm

VOCAB, SEQ, BATCH = 17, 8, 8
CE = ms.losses.CrossEntropy()


def model():
    return ms.GPT(vocab_size=VOCAB, seq_len=SEQ, d_model=16, n_heads=4, n_layers=2, d_ff=32)


def examples(n, seed):
    """n examples of 1..12 tokens, a random mask with whole prompts (the first third) off."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 13, n)
    starts = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=starts[1:])
    mask = (rng.random(starts[-1]) < 0.7).astype(np.uint8)
    for s, length in zip(starts[:-1], lengths):
        mask[s:s + length // 3] = 0
    return ExampleTokens(rng.integers(0, VOCAB, starts[-1]).astype(np.uint16), mask, starts)


def dataset(pack):
    splits = {"train": examples(60, 1), "val": examples(9, 2)}
    return example_dataset("sft", splits, SEQ, VOCAB, {}, pack=pack)


def first_step(layout, comm, data, accumulate):
    """(trainer, loss, full gradients) after the Trainer's first step (lr 0: the parameters
    stay, the gradients are the step's)."""
    m = model()
    engine = ms.make_engine(m, layout, comm=comm)
    engine.load_checkpoint(m.init(seed=4))
    trainer = Trainer(engine, SGD(engine, lr=0.0), data, batch=BATCH, steps=1,
                      accumulate=accumulate, progress=False, log_every=0, seed=7)
    loss = trainer.train_step()
    return trainer, loss, engine.gather_grads(engine.grads)


def reference(trainer, data):
    """The single-device loss and gradients of step 0's whole global batch."""
    rows = trainer.batcher.global_indices(0, 0)
    x, t = data.x_train[rows], data.t_train[rows]
    documents = None if data.d_train is None else data.d_train[rows]
    m = model()
    ref = ms.SingleDevice(m)
    ref.load_checkpoint(m.init(seed=4))
    count = int((t != IGNORE_INDEX).sum())
    assert 0 < count < t.size
    loss, grads = ref.train_step(x, t, CE, count=count, documents=documents)
    return ref, loss, {k: v.copy() for k, v in grads.items()}


LAYOUTS = ["dp=2", "tp=2", "cp=2", "pp=2,microbatches=2"]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_first_step_equals_single_on_the_global_batch(layout, pack):
    data = dataset(pack)
    for accumulate in (1, 2):
        trainer, loss, grads = first_step(layout, group_comm(2), data, accumulate)
        _, want_loss, want_grads = reference(trainer, data)
        what = f"{layout} {'packed' if pack else 'padded'} accumulate={accumulate}"
        assert_close(loss, want_loss, what=f"{what} loss")
        assert_dicts_close(grads, want_grads, what=what)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_test_loss_is_the_mean_over_counted_targets(pack):
    data = dataset(pack)
    trainer, _, _ = first_step("dp=2", group_comm(2), data, 1)
    got = trainer.evaluate()["test_loss"]
    ref, _, _ = reference(trainer, data)
    x, t = np.asarray(data.x_test), np.asarray(data.t_test)
    documents = None if data.d_test is None else np.asarray(data.d_test)
    y = ref.predict(x, documents=documents)
    assert_close(got, CE.value(y, t), what="test loss")


def test_unmasked_data_sets_say_so():
    digits_like = ms.train.data.synthetic_classification(32, 8, d_in=4, n_classes=3)
    assert not digits_like.masked and digits_like.d_train is None
    assert dataset(True).masked


@pytest.mark.parametrize("pack", [True, False], ids=["packed", "padded"])
def test_tokens_per_s_counts_the_counted_targets(pack):
    """A masked set's tokens/s is its counted targets over the training time (padding and
    prompts are not counted), in the final metrics and the per-step stream alike."""
    data = dataset(pack)
    m = model()
    engine = ms.make_engine(m, "single")
    engine.load_checkpoint(m.init(seed=4))
    trainer = Trainer(engine, SGD(engine, lr=0.0), data, batch=BATCH, steps=3, progress=False,
                      log_every=0, seed=7, eval_batches=0)
    counted = 0
    for step in range(3):
        rows = trainer.batcher.global_indices(*trainer.batcher.position(step))
        counted += int((data.t_train[rows] != IGNORE_INDEX).sum())
    metrics = trainer.fit()
    assert trainer.run_tokens == counted < 3 * BATCH * SEQ
    assert_close(metrics["tokens_per_s"], counted / trainer.train_time, what="tokens/s")


def test_the_step_line_gives_the_counted_tokens_per_s(capsys):
    """Each step's log line gives tokens/s beside samples/s: the counted targets so far over
    the training time so far (the last line: the run's)."""
    data = dataset(True)
    m = model()
    engine = ms.make_engine(m, "single")
    engine.load_checkpoint(m.init(seed=4))
    trainer = Trainer(engine, SGD(engine, lr=0.0), data, batch=BATCH, steps=3, progress=False,
                      log_every=1, seed=7, eval_batches=0, logger=configure_logging(0))
    trainer.fit()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if " samples/s " in ln]
    assert len(lines) == 3 and all(" tokens/s " in ln for ln in lines)
    logged = float(lines[-1].rsplit("tokens/s ", 1)[1].split()[0])
    assert logged == float(rate_text(trainer.run_tokens / trainer.train_time))

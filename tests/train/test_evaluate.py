"""Evaluation (train/evaluate.py): the training loss on predict's local output, in bounded batches.

    pytest -q tests/train/test_evaluate.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_evaluate.py

The reference is a full-logits evaluation: `predict` on the rows, the (rows, T, V) logits on
one rank, CrossEntropy in float64.
"""
import tracemalloc

import numpy as np
import pytest

import mpishard as ms
from mpishard.train.data import synthetic_classification
from mpishard.train.evaluate import evaluate
from mpishard.train.optim import SGD
from mpishard.train.text import windows_dataset
from mpishard.train.trainer import Trainer

from conftest import RTOL64, assert_close, world

VOCAB = 97                         # tp = 2, 4 pad it (vocab_parallel.py)
GPT = dict(vocab_size=VOCAB, seq_len=16, d_model=16, n_heads=4, n_layers=2)


def token_data(n_test=13, seq_len=16, vocab=VOCAB, seed=0):
    """A language data set of random tokens: 40 training windows, n_test test windows."""
    tokens = np.random.default_rng(seed).integers(0, vocab, (40 + n_test) * seq_len + 2)
    cut = 40 * seq_len + 1
    return windows_dataset("t", (tokens, 0, cut), (tokens, cut, len(tokens) - cut), seq_len,
                           vocab, {})


def full_logits_loss(model, params, x, t) -> float:
    """The old evaluation: every row's (T, V) logits on one rank, the float64 token mean."""
    e = ms.SingleDevice(model, dtype=np.float64)
    e.load_checkpoint(params)
    y = np.asarray(e.predict(np.asarray(x))).astype(np.float64)
    return ms.losses.CrossEntropy().value(y, np.asarray(t))


def layouts(n: int) -> list:
    """GPT layouts for n ranks: dp, vocab-parallel tp, pp, cp (4 heads, 2 layers, T = 16)."""
    if n == 1:
        return ["single", "dp=1"]
    tp = f"tp={n}" if 4 % n == 0 else f"dp={n // 4},tp=4"
    out = [f"dp={n}", tp, "pp=2" if n == 2 else f"dp={n // 4},tp=2,pp=2" if n > 4 else
           "tp=2,pp=2", "cp=2" if n == 2 else f"dp={n // 2},cp=2"]
    return out + (["dp=2,pp=2,microbatches=2"] if n == 4 else [])


def never_gathered(engine):
    """Make gathering full outputs fail on this engine: evaluation must not need it."""
    def refuse(*_):
        raise AssertionError("evaluation gathered full outputs")
    engine.gather_batch = refuse
    engine.output.gather = refuse


@pytest.mark.mpi(min_size=1)
def test_gpt_evaluation_equals_the_full_logits_loss_on_every_layout():
    """13 test windows in batches of 2 x world rows (the last padded), on dp, vocab-parallel tp
    (V = 97 padded), pp and cp: the loss of the full-logits evaluation (float64, 1e-9), with
    nothing gathered; at most k batches score exactly the first k * rows windows."""
    comm, n = world(), world().Get_size()
    model, data = ms.GPT(**GPT), token_data()
    params = model.init(seed=1)
    rows = 2 * n
    want = full_logits_loss(model, params, data.x_test[:], data.t_test[:])
    want_1 = full_logits_loss(model, params, data.x_test[:rows], data.t_test[:rows])
    for layout in layouts(n):
        e = ms.SingleDevice(model, dtype=np.float64) if layout == "single" else \
            ms.make_engine(model, layout, dtype=np.float64, comm=comm)
        e.load_checkpoint(params)
        never_gathered(e)
        got = evaluate(e, data, "cross_entropy", rows)["test_loss"]
        got_1 = evaluate(e, data, "cross_entropy", rows, max_batches=1)["test_loss"]
        print(f"{layout}: {abs(got - want):.2e} from the full-logits loss")
        assert_close(got, want, rtol=RTOL64, what=f"{layout} test loss")
        assert_close(got_1, want_1, rtol=RTOL64, what=f"{layout} first batch")
        e.close()


@pytest.mark.mpi(min_size=1)
def test_classification_loss_and_accuracy_with_padding_on_dp():
    """An MLP on dp=n: loss and accuracy of 37 test rows in padded batches are those of all
    rows predicted at once (the padding counts nowhere)."""
    comm, n = world(), world().Get_size()
    data = synthetic_classification(64, 37, d_in=8, n_classes=4, seed=3)
    model = ms.MLP([8, 16, 4])
    params = model.init(seed=2)
    ref = ms.SingleDevice(model)
    ref.load_checkpoint(params)
    y = np.asarray(ref.predict(data.x_test))
    e = ms.make_engine(model, f"dp={n}", comm=comm)
    e.load_checkpoint(params)
    got = evaluate(e, data, "cross_entropy", 4 * n)
    assert_close(got["test_loss"], ms.losses.CrossEntropy().value(y, data.t_test),
                 what="test loss")
    assert got["test_accuracy"] == float((y.argmax(axis=1) == data.t_test).mean())
    e.close()


def test_padding_takes_no_expert_capacity():
    """An ms.MoE with tight capacity: 13 rows in batches of 8 score as batches of 8 and of the
    5 real rows alone; routing the 3 padded rows as tokens would drop different assignments."""
    data = synthetic_classification(64, 13, d_in=8, n_classes=4, seed=5)
    model = ms.MoE(8, 16, n_experts=4, top_k=2, capacity_factor=1.0, groups=1)
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=3))
    ce = ms.losses.CrossEntropy()
    alone = [ce.value(np.asarray(e.predict(data.x_test[a:b])), data.t_test[a:b]) * (b - a)
             for a, b in ((0, 8), (8, 13))]
    padded = np.asarray(e.predict(data.x_test[np.arange(8, 16) % 13]))[:5]
    as_tokens = (alone[0] + ce.value(padded, data.t_test[8:13]) * 5) / 13
    got = evaluate(e, data, "cross_entropy", 8)["test_loss"]
    assert_close(got, sum(alone) / 13, what="test loss")
    assert abs(as_tokens - got) > 1e-6, "capacity does not bind: the test shows nothing"


def evaluation_peak(n_test: int) -> int:
    """tracemalloc's peak bytes of one Trainer.evaluate on n_test windows of a V = 4096 GPT
    trained in batches of 2 rows."""
    data = token_data(n_test=n_test, seq_len=8, vocab=4096)
    model = ms.GPT(vocab_size=4096, seq_len=8, d_model=8, n_heads=2, n_layers=1)
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=0))
    t = Trainer(e, SGD(e, 0.1), data, batch=2, steps=1, progress=False, log_every=0)
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        t.evaluate()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_evaluation_memory_does_not_grow_with_the_test_split():
    """The peak of an evaluation is a batch's (2 rows x 8 x 4096 logits, 0.5 MiB in float64),
    whatever the number of test rows: 64 windows peak like 4 do (the full-logits evaluation
    held 64 rows' logits, 16 MiB)."""
    batch_logits = 2 * 8 * 4096 * 8
    small, large = evaluation_peak(4), evaluation_peak(64)
    print(f"evaluation peak: 4 windows {small / 2**20:.2f} MiB, 64 windows "
          f"{large / 2**20:.2f} MiB; one batch's logits {batch_logits / 2**20:.2f} MiB")
    assert large <= 1.25 * small and large <= 8 * batch_logits


def test_eval_batch_and_eval_batches_reach_the_evaluation():
    """Trainer(eval_batch=, eval_batches=) score the first eval_batches * eval_batch rows; the
    default batch is one training micro-step's rows; bad values are refused up front."""
    data = synthetic_classification(64, 37, d_in=8, n_classes=4, seed=3)
    model = ms.MLP([8, 16, 4])
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=2))
    y = np.asarray(e.predict(data.x_test))
    t = Trainer(e, SGD(e, 0.1), data, batch=16, accumulate=2, steps=1, progress=False,
                eval_batch=5, eval_batches=2)
    assert_close(t.evaluate()["test_loss"],
                 ms.losses.CrossEntropy().value(y[:10], data.t_test[:10]), what="10 rows")
    assert Trainer(e, SGD(e, 0.1), data, batch=16, accumulate=2, steps=1).eval_batch == 8
    for kw, msg in (({"eval_batch": 0}, "eval_batch must be"),
                    ({"eval_batches": -1}, "eval_batches must be"),
                    ({"eval_batches": 0, "eval_every": 2}, "eval_every=2 asks for evaluations")):
        with pytest.raises(ValueError, match=msg):
            Trainer(e, SGD(e, 0.1), data, batch=16, steps=1, **kw)


def test_eval_batches_0_skips_every_evaluation():
    data = synthetic_classification(64, 37, d_in=8, n_classes=4, seed=3)
    model = ms.MLP([8, 16, 4])
    e = ms.SingleDevice(model)
    e.load_checkpoint(model.init(seed=2))
    t = Trainer(e, SGD(e, 0.1), data, batch=16, steps=3, progress=False, eval_batches=0)
    t.evaluate = None                                  # never called
    m = t.fit()
    assert m["test_loss"] is None and m["test_accuracy"] is None and m["eval_history"] == []
    assert "eval" not in m["peak_rss_bytes"] and "train" in m["peak_rss_bytes"]

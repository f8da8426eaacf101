"""Text corpora for `train --model gpt`: the synthetic Markov grammar (train/grammar.py) whose
best achievable loss is known, `--text` (alias of --corpus), training windows at every offset
(--train-stride 1), and a tiny GPT approaching the grammar's bound from above.

    pytest -m "not mpi" tests/train/test_gpt_corpora.py
"""
import math

import numpy as np
import pytest
from mpi4py import MPI

from mpishard.cli.train import build_training, parse_train_args
from mpishard.cli.usage import UsageError
from mpishard.train.grammar import MarkovGrammar, synthetic_corpus, synthetic_seed
from mpishard.train.text import Windows, split_windows, text_dataset


def test_grammar_entropy_matches_the_sampled_text():
    """The exact entropy rate against the empirical conditional entropy of 200k bytes."""
    g = MarkovGrammar(seed=1)
    np.testing.assert_allclose(g.pi @ g.P, g.pi, atol=1e-12)
    x = np.searchsorted(np.sort(g.symbols), g.sample(200_000))
    order = np.argsort(g.symbols)                          # sorted index -> symbol index
    s = order[x]
    counts = np.zeros_like(g.P)
    np.add.at(counts, (s[:-1], s[1:]), 1)
    p = counts / counts.sum(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        h_emp = -np.nansum(counts / counts.sum() * np.log(p))
    print(f"entropy rate {g.entropy_rate():.4f}, empirical {h_emp:.4f}, first byte "
          f"{g.first_entropy():.4f} nats/byte")
    assert abs(h_emp - g.entropy_rate()) < 0.01
    assert 0 < g.best_loss() == g.entropy_rate() < math.log(4)
    assert g.entropy_rate() < g.first_entropy() <= math.log(16)


def test_synthetic_corpus_is_seeded():
    a, info = synthetic_corpus(5, 1000)
    b, _ = synthetic_corpus(5, 1000)
    c, _ = synthetic_corpus(6, 1000)
    assert np.array_equal(a, b) and not np.array_equal(a, c) and a.dtype == np.uint8
    assert info["source"] == "synthetic:5" and info["entropy_rate"] > 0
    assert synthetic_seed("synthetic:7") == 7 and synthetic_seed("notes.txt") is None
    with pytest.raises(ValueError, match="SEED"):
        synthetic_seed("synthetic:x")
    data = text_dataset(16, "synthetic:5", max_bytes=4000)
    assert data.corpus["best_loss"] == pytest.approx(MarkovGrammar(5).best_loss())


def test_training_windows_at_every_offset():
    tokens = np.arange(200, dtype=np.uint8)
    assert split_windows(200, 16, 0.1) == {"train": (0, 11), "val": (180, 1)}
    assert split_windows(200, 16, 0.1, train_stride=1)["train"] == (0, 180 - 16)
    x, t = Windows(tokens, 0, 164, 16, 0, 1), Windows(tokens, 0, 164, 16, 1, 1)
    assert np.array_equal(x[[0, 5, 163]][:, 0], [0, 5, 163]) and t[163][-1] == 179
    for stride in (None, 1, 7):                 # no training window reaches the val bytes
        (s0, n0), (s1, _) = (split_windows(200, 16, 0.1, stride)[k] for k in ("train", "val"))
        assert s0 + (n0 - 1) * (stride or 16) + 16 + 1 <= s1


def test_text_flag_and_errors():
    args = parse_train_args(["--model", "gpt", "--text", "synthetic:2", "--train-stride", "1"])
    assert args.corpus == "synthetic:2" and args.train_stride == 1
    bad = parse_train_args(["--model", "gpt", "--text", "synthetic:x", "--steps", "1"])
    with pytest.raises(UsageError, match="--text"):
        build_training(bad, MPI.COMM_SELF)


def test_tiny_gpt_approaches_the_grammar_bound_from_above():
    """Validation loss after 40, 80, 120, 160 steps: always above the exact bound (the
    entropy rate), the gap shrinking (measured: 0.19, 0.11, 0.06, 0.05 nats/byte)."""
    argv = ["--model", "gpt", "--gpt", "d_model=32,n_heads=2,n_layers=1,seq_len=16",
            "--text", "synthetic:1", "--corpus-bytes", "80000", "--val-fraction", "0.1",
            "--batch", "16", "--lr", "0.01", "--steps", "160", "--eval-every", "40",
            "--train-stride", "1", "--no-progress", "--log-every", "0", "--log-level",
            "WARNING", "--schedule", "cosine", "--warmup", "10"]
    trainer = build_training(parse_train_args(argv), MPI.COMM_SELF)
    bound = trainer.data.corpus["best_loss"]
    m = trainer.fit()
    val = [e["test_loss"] for e in m["eval_history"]]
    gaps = [v - bound for v in val]
    print(f"bound {bound:.4f} nats/byte; val {['%.4f' % v for v in val]}; "
          f"gaps {['%.4f' % g for g in gaps]}")
    assert all(g > 0 for g in gaps), "a validation loss below the best achievable"
    assert gaps[-1] < gaps[0] and gaps[-1] == min(gaps)
    assert gaps[-1] < 0.5 * gaps[0]

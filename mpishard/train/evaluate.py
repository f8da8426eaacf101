"""Evaluation on the test split: the training loss on forwards without a tape, in bounded batches.

    result = evaluate(engine, data, loss, rows=64, max_batches=None)
    # {"test_loss": ..., "test_accuracy": ... (classification and binary tasks)}, every rank

The test rows go through `engine.predict` (no activation tape) in batches of `rows` global rows
(data.eval_chunks: each data-parallel rank its share; the last batch is padded by repeating
rows from the start, so every batch has the same shape), at most `max_batches` of them, the
first ones (None: the whole split). Each rank scores its own output with the loss training
uses, `engine.output.loss(loss)`: for a GPT under tp that is the vocabulary-parallel
cross-entropy on this rank's vocabulary shard, so no rank ever holds a (rows, T, V) array, and
it runs in the engine's dtype. Nothing is gathered but four scalars at the end.

Padding counts nowhere: a rank cuts its padded rows from its output and targets before the loss
(the tp peers of a rank hold the same rows, so they cut alike). The test loss is the mean over
what the loss averages (tokens, rows or output elements) of the scored rows: each rank adds
`value * count` for its rows (count: `loss.counted`, so fine-tune rows' ignored targets, -100,
count nowhere; fine-tune rows are predicted with their document ids, data.d_test), on the last
pipeline stage where the output is, and the sums of those and of the counts are taken over the
data axes and cp (engine.global_mean, the same ratio as a sum); nan when nothing counted.
Padding takes no expert capacity either: `predict_rows` runs the forward inside
nn/moe_routing.valid_tokens with this rank's real rows, so a mixture of experts routes the
padded rows to no expert and a batch's real rows get the drops they would get alone (and,
from the document ids, the padding inside fine-tune rows likewise).
"""
from __future__ import annotations

import math

import numpy as np

from ..nn.losses import get_loss
from ..nn.moe_routing import valid_tokens
from ..validate import check_number
from .data import eval_chunks
from .text import sequence_cut

ACCURACY_TASKS = ("classification", "binary")


def check_eval_args(rows, max_batches, dp: int, layout: str) -> None:
    """ValueError (the same on every rank) unless rows is a positive multiple of the dp
    data-parallel ranks and max_batches is None or an integer >= 0."""
    check_number("eval_batch", rows, low=1, integer=True)
    if rows % dp:
        raise ValueError(f"eval_batch {rows} must divide by the {dp} data-parallel ranks of "
                         f"layout {layout!r}")
    if max_batches is not None:
        check_number("eval_batches", max_batches, low=0, integer=True)


def predict_rows(engine, x, real: int, documents=None):
    """engine.predict on this rank's rows, of which the first `real` are data and the rest
    padding (never scored, and routed to no expert); documents: the rows' ids or None."""
    rows = len(x)
    with valid_tokens(engine.chunks, None if real == rows else np.arange(rows) < real):
        return engine.predict(x) if documents is None else engine.predict(x, documents)


def evaluate(engine, data, loss, rows: int, max_batches=None) -> dict:
    """Collective: {"test_loss", and "test_accuracy" for classification and binary tasks} over
    the first `max_batches` batches of `rows` test rows (module docstring); the same floats
    on every rank."""
    check_eval_args(rows, max_batches, engine.data_parallel_size, engine.layout.text)
    if max_batches == 0:
        raise ValueError("evaluate needs max_batches >= 1 (0 turns evaluation off)")
    scorer = engine.output.loss(get_loss(loss))      # vocab-parallel for a GPT under tp
    dp, rank = engine.data_parallel_size, engine.data_parallel_rank
    share = rows // dp
    sums, scored = [0.0, 0, 0], 0           # loss * count, count, hits; real rows in all
    for k, (idx, real) in enumerate(eval_chunks(len(data.x_test), rows, dp, rank)):
        if max_batches is not None and k >= max_batches:
            break
        scored += real
        mine = min(max(real - rank * share, 0), share)          # this rank's real rows
        documents = None if data.d_test is None else data.d_test[idx]
        y = predict_rows(engine, sequence_cut(engine, data.x_test[idx]), mine, documents)
        if y is None or mine == 0:           # not the last pipeline stage, or padding only
            continue
        y, t = y[:mine], _targets(engine, sequence_cut(engine, data.t_test[idx[:mine]]))
        counted = scorer.counted(t)
        sums[0] += scorer.value(y, t) * counted
        sums[1] += counted
        if data.task in ACCURACY_TASKS:
            hits = y.argmax(axis=-1) == t if data.task == "classification" else \
                (y >= 0.5) == (t >= 0.5)
            sums[2] += int(hits.sum())
    loss_sum, count, hits = (engine.global_mean(float(v)) for v in sums)  # sums' ratios
    result = {"test_loss": loss_sum / count if count else float("nan")}
    if data.task in ACCURACY_TASKS:          # a count of items: exact, as a plain mean is
        items = scored * math.prod(data.t_test.shape[1:])
        result["test_accuracy"] = round(hits / count * items) / items
    return result


def _targets(engine, t):
    """Targets on the engine's device: labels as they are, float targets in its dtype (as
    train_step takes them)."""
    t = engine.backend.asarray(t)
    return t.astype(engine.dtype) if t.dtype.kind == "f" else t


__all__ = ["ACCURACY_TASKS", "check_eval_args", "evaluate", "predict_rows"]

"""train's --dataset names and the loss that fits a table data set (no MPI, every rank alike)."""
from __future__ import annotations

import argparse

from ..train.data import DATASETS, DIGITS_CLASSES, DIGITS_FEATURES
from ..train.npy_data import is_npy_name, npy_task
from ..train.records import is_records_name
from ..train.tokens import is_tokens_name
from .gpt_options import TEXT_DATASET
from .usage import UsageError


def dataset_name(text):
    """--dataset: a built-in name, npy:DIR, tokens:DIR or fine-tune records
    (jsonl:FILE|GLOB, parquet:FILE|GLOB, hfdisk:DIR)."""
    if text in DATASETS + (TEXT_DATASET,) or (is_npy_name(text) and len(text) > 4) or \
            (is_tokens_name(text) and len(text) > 7) or \
            (is_records_name(text) and text.partition(":")[2]):
        return text
    raise argparse.ArgumentTypeError(f"invalid choice: {text!r} (choose from "
                                     f"{', '.join(DATASETS + (TEXT_DATASET,))}, npy:DIR, "
                                     f"tokens:DIR, jsonl:FILE|GLOB, parquet:FILE|GLOB or "
                                     f"hfdisk:DIR)")


def fitting_loss(args, dims) -> str:
    """The loss for --dataset and the model's output width: --loss if given and it fits."""
    if args.dataset == "digits" and (dims[0] != DIGITS_FEATURES or dims[-1] != DIGITS_CLASSES):
        raise UsageError(f"--model {args.model}: the digits dataset has {DIGITS_FEATURES} "
                         f"features and {DIGITS_CLASSES} classes, so the model must be "
                         f"{DIGITS_FEATURES},...,{DIGITS_CLASSES}")
    # the one loss that fits the dataset (one class output: bce, sigmoid added)
    if is_npy_name(args.dataset):
        try:
            fits = {args.dataset: "cross_entropy" if npy_task(args.dataset) == "classification"
                    else "mse"}
        except ValueError as exc:
            raise UsageError(str(exc)) from None
    else:
        fits = {"synthetic-regression": "mse", "digits": "cross_entropy",
                "synthetic-classification": "bce" if dims[-1] == 1 else "cross_entropy"}
    loss = args.loss or fits[args.dataset]
    if loss != fits[args.dataset]:
        raise UsageError(f"--loss {loss} does not fit dataset {args.dataset} with {dims[-1]} "
                         f"output(s); use --loss {fits[args.dataset]}")
    return loss


__all__ = ["dataset_name", "fitting_loss"]

"""Data: seeded synthetic sets, scikit-learn's digits, and a distributed batcher.

Every rank builds the same `Dataset` (host numpy arrays, drawn from the seed), and feeds its
engine only the rows it needs: `DistributedBatcher` indexes a per-epoch permutation of the
training rows (drawn from (seed, epoch), so every rank agrees without communication), cuts the
global batch into `accumulate` micro-batches, and takes this rank's block of each:

    global batch  B rows   = perm[i*B : (i+1)*B]
    micro-batch   B/k rows   (k = accumulate)
    this rank     B/(k*R) rows, block data_parallel_rank of R = data_parallel_size

which is exactly what `engine.shard_batch` would cut from the global micro-batch, without
materialising the rest. tp and pp peers get the same rows.

Targets: float (N, d_out) arrays for regression and binary (BCE) sets, int64 labels (N,) for
CrossEntropy.

What the model sees is not always the raw input: digits' features are standardised with the
training split's mean and standard deviation, a text's ids come from a tokenizer. A Dataset
says so (`standardize`, `tokenizer`), and `carried(data)` is what a checkpoint keeps of it,
so `infer` and `generate` read raw input as training did: the arrays as .npy files and the
tokenizer's files beside the blocks, named in the index's extra (no pickle).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from ..validate import check_number

DATASETS = ("synthetic-regression", "synthetic-classification", "digits")
DIGITS_FEATURES, DIGITS_CLASSES = 64, 10
# the files of a checkpoint that hold a data set's standardisation (extra["standardize"])
STANDARDIZE_FILES = {"mean": "standardize.mean.npy", "std": "standardize.std.npy"}


@dataclass
class Dataset:
    """Train and test arrays (host numpy), and what kind of targets they hold.

    task: 'regression' (float targets, MSE), 'classification' (int64 labels, CrossEntropy) or
    'binary' (float 0/1 targets of shape (N, 1), BCE on a sigmoid output).
    standardize: None, or {"mean": (d_in,), "std": (d_in,)} arrays when x_train and x_test
    are the raw features standardised, (raw - mean) / std. tokenizer: the HFTokenizer whose
    ids the inputs are (None for numbers and bytes). d_train, d_test: None, or the document
    ids (N, T) of packed or padded rows (nn/documents.py: -1 on padding), row for row with
    x_train and x_test.
    """

    name: str
    x_train: np.ndarray
    t_train: np.ndarray
    x_test: np.ndarray
    t_test: np.ndarray
    task: str
    n_classes: int = 0
    standardize: Any = None
    tokenizer: Any = None
    d_train: Any = None
    d_test: Any = None

    @property
    def masked(self) -> bool:
        """Whether targets may hold the loss' ignore index (fine-tune rows, sft_rows.py): the
        Trainer then divides by the global count of counted targets."""
        return False

    @property
    def d_in(self) -> int:
        return int(self.x_train.shape[1])

    @property
    def d_out(self) -> int:
        if self.task == "classification":
            return self.n_classes
        return int(self.t_train.shape[1])

    @property
    def default_loss(self) -> str:
        return {"regression": "mse", "classification": "cross_entropy", "binary": "bce"}[self.task]

    def __repr__(self) -> str:
        return (f"Dataset({self.name!r}, {self.task}, train {self.x_train.shape}, "
                f"test {self.x_test.shape}, d_in {self.d_in}, d_out {self.d_out})")


def synthetic_regression(n_train=1024, n_test=256, d_in=16, d_out=1, seed=0, noise=0.05):
    """x ~ N(0, 1); t = sin(x A) B / sqrt(h) + noise, a smooth teacher an MLP can learn."""
    for what, v in (("n_train", n_train), ("n_test", n_test), ("d_in", d_in), ("d_out", d_out)):
        check_number(what, v, low=1, integer=True)
    rng = np.random.default_rng([int(seed), 1])
    hidden = 32
    a = rng.normal(0.0, 1.0 / np.sqrt(d_in), (d_in, hidden))
    b = rng.normal(0.0, 1.0, (hidden, d_out))
    x = rng.normal(0.0, 1.0, (n_train + n_test, d_in))
    t = np.sin(2.0 * x @ a) @ b / np.sqrt(hidden) + noise * rng.normal(size=(len(x), d_out))
    return Dataset("synthetic-regression", x[:n_train], t[:n_train], x[n_train:], t[n_train:],
                   "regression")


def synthetic_classification(n_train=1024, n_test=256, d_in=16, n_classes=4, seed=0,
                             spread=1.0):
    """Gaussian blobs: a random centre per class (N(0, spread^2) per feature), unit noise.

    n_classes >= 2 gives int64 labels; n_classes == 1 gives the binary task (two blobs, float
    0/1 targets of shape (N, 1), for a sigmoid output and BCE)."""
    for what, v in (("n_train", n_train), ("n_test", n_test), ("d_in", d_in),
                    ("d_out", n_classes)):
        check_number(what, v, low=1, integer=True)
    rng = np.random.default_rng([int(seed), 2])
    k = max(2, n_classes)
    centres = rng.normal(0.0, spread, (k, d_in))
    labels = rng.integers(0, k, n_train + n_test)
    x = centres[labels] + rng.normal(0.0, 1.0, (len(labels), d_in))
    if n_classes == 1:
        t = labels.astype(np.float64).reshape(-1, 1)
        return Dataset("synthetic-classification", x[:n_train], t[:n_train], x[n_train:],
                       t[n_train:], "binary", 2)
    t = labels.astype(np.int64)
    return Dataset("synthetic-classification", x[:n_train], t[:n_train], x[n_train:],
                   t[n_train:], "classification", k)


def digits(seed=0, test_fraction=0.2):
    """scikit-learn's bundled 8x8 digits (1797 images, 64 features, 10 classes; shipped with
    scikit-learn, never downloaded): a seeded stratified train/test split, then every feature
    standardised with the training set's mean and standard deviation."""
    if not 0.0 < test_fraction < 1.0:
        raise ValueError(f"test_fraction must lie in (0, 1), got {test_fraction}")
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ValueError("the digits dataset needs scikit-learn: pip install scikit-learn "
                         "(or pip install -e '.[data]'; no MPI wheel, safe with a site MPI)"
                         ) from None
    x, y = load_digits(return_X_y=True)
    x_train, x_test, y_train, y_test = train_test_split(
        x.astype(np.float64), y.astype(np.int64), test_size=test_fraction,
        random_state=int(seed), stratify=y)
    mean = x_train.mean(axis=0)
    std = x_train.std(axis=0)
    std[std == 0.0] = 1.0                      # pixels that are blank in every training image
    return Dataset("digits", standardized(x_train, mean, std), y_train,
                   standardized(x_test, mean, std), y_test, "classification", DIGITS_CLASSES,
                   standardize={"mean": mean, "std": std})


def standardized(x, mean, std) -> np.ndarray:
    """(x - mean) / std, feature by feature: what a standardised data set feeds the model."""
    return (np.asarray(x, dtype=np.float64) - mean) / std


def carried(data) -> tuple:
    """(extra, assets): what a checkpoint keeps of `data` so raw input reads as in training.
    extra["standardize"] names the .npy files of the mean and std (STANDARDIZE_FILES);
    extra["tokenizer"] is the tokenizer's record (name, sha256, eos id, its file names), its
    files stored under those names. Both empty for raw numbers and bytes."""
    extra, assets = {}, {}
    if data.standardize is not None:
        extra["standardize"] = dict(STANDARDIZE_FILES)
        assets.update({STANDARDIZE_FILES[k]: np.asarray(data.standardize[k], np.float64)
                       for k in STANDARDIZE_FILES})
    if data.tokenizer is not None:
        extra["tokenizer"], files = data.tokenizer.carried()
        assets.update(files)
    return extra, assets


def load_dataset(name, *, d_in=16, d_out=1, n_train=1024, n_test=256, seed=0) -> Dataset:
    """By name (see DATASETS). Synthetic sets take their sizes from d_in/d_out (the model's
    first and last dims); digits is always 64 features, 10 classes."""
    if name == "synthetic-regression":
        return synthetic_regression(n_train, n_test, d_in, d_out, seed)
    if name == "synthetic-classification":
        return synthetic_classification(n_train, n_test, d_in, d_out, seed)
    if name == "digits":
        return digits(seed)
    raise ValueError(f"unknown dataset {name!r}; choose one of {list(DATASETS)}")


class DistributedBatcher:
    """This rank's rows of each (micro-)batch, reshuffled every epoch from the seed.

    Batches are drawn without replacement from a permutation of the training rows; a last
    partial batch is dropped (DataLoader's drop_last), so every step sees `batch` rows.
    `position(step)` maps a global step to (epoch, batch index), so a resumed run continues
    from the same rows. `documents`: None, or the rows' document ids (N, T), whose rows
    `micro_documents` takes as `micro_batches` takes x's and t's.
    """

    def __init__(self, x, t, batch, dp_size=1, dp_rank=0, seed=0, accumulate=1, shuffle=True,
                 documents=None):
        n = len(x)
        if len(t) != n or (documents is not None and len(documents) != n):
            raise ValueError(f"inputs have {n} rows but targets have {len(t)}"
                             + ("" if documents is None else f", documents {len(documents)}"))
        for what, v in (("batch", batch), ("accumulate", accumulate), ("dp_size", dp_size)):
            check_number(what, v, low=1, integer=True)
        if batch % (accumulate * dp_size):
            raise ValueError(f"global batch {batch} must divide by accumulate {accumulate} x "
                             f"{dp_size} data-parallel ranks = {accumulate * dp_size}")
        if batch > n:
            raise ValueError(f"global batch {batch} is larger than the {n} training rows")
        if not 0 <= dp_rank < dp_size:
            raise ValueError(f"dp_rank {dp_rank} not in [0, {dp_size})")
        self.x, self.t, self.documents = x, t, documents
        self.n, self.batch, self.accumulate = n, int(batch), int(accumulate)
        self.dp_size, self.dp_rank = int(dp_size), int(dp_rank)
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.steps_per_epoch = n // batch
        self.micro_batch = batch // accumulate                  # global rows per micro-step
        self.local_rows = self.micro_batch // dp_size           # this rank's rows per micro-step
        self._perm_epoch, self._perm = None, None

    @classmethod
    def for_engine(cls, engine, x, t, batch, seed=0, accumulate=1, shuffle=True,
                   documents=None):
        return cls(x, t, batch, engine.data_parallel_size, engine.data_parallel_rank, seed,
                   accumulate, shuffle, documents)

    def permutation(self, epoch: int) -> np.ndarray:
        """The order of the training rows in `epoch` (the same on every rank)."""
        if self._perm_epoch != epoch:
            if self.shuffle:
                self._perm = np.random.default_rng([self.seed, 3, int(epoch)]).permutation(self.n)
            else:
                self._perm = np.arange(self.n)
            self._perm_epoch = epoch
        return self._perm

    def position(self, step: int) -> tuple:
        """(epoch, batch index within the epoch) of global step `step`."""
        return divmod(int(step), self.steps_per_epoch)

    def global_indices(self, epoch: int, index: int) -> np.ndarray:
        """Row indices of the whole global batch `index` of `epoch`."""
        return self.permutation(epoch)[index * self.batch:(index + 1) * self.batch]

    def local_indices(self, epoch: int, index: int, micro: int = 0) -> np.ndarray:
        """This rank's row indices of micro-batch `micro` of global batch `index`."""
        g = self.global_indices(epoch, index)
        mb = g[micro * self.micro_batch:(micro + 1) * self.micro_batch]
        r, b = self.dp_rank, self.local_rows
        return mb[r * b:(r + 1) * b]

    def micro_batches(self, step: int) -> list:
        """[(x_local, t_local)] for the `accumulate` micro-steps of global step `step`; only
        these rows are copied out of the data set."""
        epoch, index = self.position(step)
        out = []
        for micro in range(self.accumulate):
            idx = self.local_indices(epoch, index, micro)
            out.append((self.x[idx], self.t[idx]))
        return out

    def micro_documents(self, step: int) -> list:
        """The document ids of micro_batches(step)'s rows, one array per micro-step (None
        each when the rows are not packed)."""
        epoch, index = self.position(step)
        if self.documents is None:
            return [None] * self.accumulate
        return [self.documents[self.local_indices(epoch, index, micro)]
                for micro in range(self.accumulate)]


def eval_chunks(n_rows: int, chunk: int, dp_size: int, dp_rank: int):
    """Cover rows 0..n_rows-1 in chunks of `chunk` global rows (a multiple of dp_size; the last
    chunk is padded by repeating rows from the start). Yields (this rank's row indices, number
    of real rows in the chunk), so every chunk has the shape the engine trained with."""
    if chunk % dp_size:
        raise ValueError(f"eval chunk {chunk} must divide by {dp_size} data-parallel ranks")
    b = chunk // dp_size
    for start in range(0, n_rows, chunk):
        idx = np.arange(start, start + chunk) % n_rows
        yield idx[dp_rank * b:(dp_rank + 1) * b], min(chunk, n_rows - start)


__all__ = ["DATASETS", "Dataset", "DistributedBatcher", "STANDARDIZE_FILES", "carried", "digits",
           "eval_chunks", "load_dataset", "standardized", "synthetic_classification",
           "synthetic_regression"]

"""Token files and real tokenizers (train/tokens.py, train/tokenizer.py): a BPE tokenizer is
trained here on a few KB of text with the `tokenizers` library; the file written by
write_tokens holds exactly the tokens and split the in-memory path cuts; each rank reads only
the windows of its own rows; the same global batch gives the same losses on every layout.

    pytest -m "not mpi" tests/train/test_tokens.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/train/test_tokens.py
"""
import json
import os
import shutil
import tempfile

import numpy as np
import pytest

import mpishard as ms
from mpishard.train.data import DistributedBatcher
from mpishard.train.optim import AdamW
from mpishard.train.text import corpus_files, documents, split_point, stdlib_files, text_dataset
from mpishard.train.tokenizer import (ByteTokenizer, HFTokenizer, encode_corpus, same_tokenizer,
                                      token_dtype)
from mpishard.train.tokens import (TokenFile, read_header, token_dataset,
                                   tokenized_text_dataset, write_tokens)
from mpishard.train.trainer import Trainer

from conftest import RTOL64, assert_close, group_comm, world

tokenizers = pytest.importorskip("tokenizers")

VOCAB = 320                       # divides by tp = 1, 2, 4
EOS = "<|endoftext|>"


# -- helpers (tests/cli/test_tokenize.py uses them too) -----------------------------------------
def write_corpus(directory, n_files=5, size=2500):
    """n_files text files of `size` bytes cut from the standard library's source (one with
    non-ASCII text), sorted by name; returns the directory."""
    os.makedirs(directory, exist_ok=True)
    for i, path in enumerate(stdlib_files()[:n_files]):
        with open(path, "rb") as f:
            text = f.read(size)
        if i == 1:
            text = "# naïve café, 東京 ✓\n".encode() + text
        with open(os.path.join(directory, f"doc{i}.txt"), "wb") as f:
            f.write(text)
    return str(directory)


def train_bpe(corpus_dir, vocab=VOCAB):
    """A byte-level BPE tokenizer (GPT-2's scheme) trained on the corpus, with EOS as its
    special token id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train(corpus_files(corpus_dir), trainer)
    assert tok.get_vocab_size() == vocab
    return tok


def shared_dir(comm):
    """A temporary directory rank 0 of `comm` makes, known to every rank."""
    path = tempfile.mkdtemp(prefix="mpishard-tokens-") if comm.Get_rank() == 0 else None
    return comm.bcast(path, root=0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def bpe(corpus):
    return HFTokenizer(train_bpe(corpus), "test-bpe")


# -- the tokenizers ----------------------------------------------------------------------------
def test_documents_are_encoded_alone_with_eos_after_each(corpus, bpe):
    raw = list(documents(corpus_files(corpus)))
    ids = encode_corpus(bpe, iter(raw))
    assert bpe.vocab_size == VOCAB and bpe.eos_id == 0 and ids.dtype == np.uint16
    want = []
    for doc in raw:
        want += bpe.tokenizer.encode(doc.decode("utf-8")).ids + [0]
    assert ids.tolist() == want
    ends = np.flatnonzero(ids == 0)
    assert len(ends) == len(raw) and ends[-1] == len(ids) - 1
    assert bpe.tokenizer.decode(ids[:ends[0]].tolist()) == raw[0].decode()
    b = ByteTokenizer()
    assert b.eos_id is None and encode_corpus(b, iter(raw)).tobytes() == b"".join(raw)


def test_identity_and_dtypes(corpus, bpe):
    again = HFTokenizer(tokenizers.Tokenizer.from_str(bpe.tokenizer.to_str()), "elsewhere")
    other = HFTokenizer(train_bpe(corpus, vocab=300), "test-bpe")
    assert same_tokenizer(bpe.identity(), again.identity())
    assert not same_tokenizer(bpe.identity(), other.identity())
    assert not same_tokenizer(bpe.identity(), ByteTokenizer().identity())
    assert same_tokenizer(ByteTokenizer().identity(), {"name": "bytes", "sha256": None})
    assert HFTokenizer(bpe.tokenizer, "x", eos_token=EOS).eos_id == 0
    with pytest.raises(ValueError, match="eos_token '</s>' is not in its vocabulary"):
        HFTokenizer(bpe.tokenizer, "x", eos_token="</s>")
    assert token_dtype(65536) == np.uint16 and token_dtype(65537) == np.uint32


# -- the file against the in-memory path -------------------------------------------------------
@pytest.mark.parametrize("stride", [None, 3])
def test_token_file_holds_the_in_memory_tokens_and_split(tmp_path, corpus, bpe, stride):
    header = write_tokens(str(tmp_path / "tok"), bpe, corpus, val_fraction=0.1)
    want = encode_corpus(bpe, documents(corpus_files(corpus)))
    cut = split_point(len(want), 0.1)
    train = np.fromfile(tmp_path / "tok" / "train.bin", np.uint16)
    val = np.fromfile(tmp_path / "tok" / "val.bin", np.uint16)
    assert np.array_equal(np.concatenate([train, val]), want) and len(train) == cut
    assert header == read_header(str(tmp_path / "tok"))
    assert header["train"]["count"] == cut and header["val"]["count"] == len(want) - cut
    assert header["dtype"] == "uint16" and header["vocab_size"] == VOCAB
    assert header["eos_id"] == 0 and header["max_id"] == int(want.max())
    assert header["tokenizer"] == dict(bpe.identity(), files=["tokenizer.json"])
    assert (tmp_path / "tok" / "tokenizer.json").read_text() == bpe.tokenizer.to_str()
    assert header["corpus"]["files"] == 5
    a = token_dataset(f"tokens:{tmp_path / 'tok'}", 16, stride)
    b = tokenized_text_dataset(16, bpe, corpus, val_fraction=0.1, train_stride=stride)
    assert isinstance(a.x_train.tokens, TokenFile) and a.n_classes == b.n_classes == VOCAB
    for got, exp in ((a.x_train, b.x_train), (a.t_train, b.t_train), (a.x_test, b.x_test),
                     (a.t_test, b.t_test)):
        assert got.shape == exp.shape and np.array_equal(got[:], exp[:])
    assert a.corpus["sha256"] == b.corpus["sha256"]
    assert a.unit == b.unit == "token"          # the loss is per token: bits/token, not byte


def test_byte_token_file_equals_the_byte_corpus(tmp_path, corpus):
    write_tokens(str(tmp_path / "tok"), ByteTokenizer(), corpus, max_bytes=9000,
                 val_fraction=0.05)
    a = token_dataset(f"tokens:{tmp_path / 'tok'}", 32)
    b = text_dataset(32, corpus, max_bytes=9000)
    assert a.corpus["sha256"] == b.corpus["sha256"] and a.corpus["bytes"] == 9000
    assert a.unit == b.unit == "byte"
    for got, exp in ((a.x_train, b.x_train), (a.t_train, b.t_train), (a.t_test, b.t_test)):
        assert got.shape == exp.shape and np.array_equal(got[:], exp[:])


class WideTokenizer:
    """Ids past 65536: the file must be uint32."""

    vocab_size, eos_id, name = 70_000, 69_999, "wide"

    def identity(self):
        return {"name": self.name, "sha256": "0" * 64}

    def encode(self, docs):
        return [np.frombuffer(d, np.uint8).astype(np.int64) * 271 for d in docs]


def test_a_large_vocabulary_is_stored_as_uint32(tmp_path, corpus):
    h = write_tokens(str(tmp_path / "w"), WideTokenizer(), corpus, val_fraction=0.2)
    assert h["dtype"] == "uint32" and h["max_id"] == 69_999
    d = token_dataset(f"tokens:{tmp_path / 'w'}", 8)
    first = np.frombuffer(next(documents(corpus_files(corpus)))[:8], np.uint8)
    first = first.astype(np.int64) * 271
    assert d.x_train[[0]][0].tolist() == first.tolist() and d.n_classes == 70_000
    assert d.x_train[:].max() > 65536


def _broken(directory, **change):
    header_path = os.path.join(directory, "tokens.json")
    with open(header_path) as f:
        header = json.load(f)
    header.update(change)
    with open(header_path, "w") as f:
        json.dump(header, f)


@pytest.mark.parametrize("change,message", [
    ({"format": "other"}, "is not an mpishard-tokens header"),
    ({"version": 3}, "has version 3; this mpishard reads versions 1, 2"),
    ({"dtype": "uint32"}, "dtype uint32 does not hold a vocabulary of 320"),
    ({"max_id": 320}, "largest id 320 is outside the vocabulary of 320"),
    ({"train": {"file": "train.bin", "count": 10**6}}, "train.bin should hold 1000000 uint16"),
    ({"val": {"file": "nope.bin", "count": 3}}, "nope.bin should hold 3 uint16 tokens .6 "
                                                "bytes., it is missing"),
    ({"vocab_size": None}, "lacks or garbles"),
])
def test_a_bad_token_directory_is_one_clear_error(tmp_path, corpus, bpe, change, message):
    write_tokens(str(tmp_path), bpe, corpus)
    _broken(str(tmp_path), **change)
    with pytest.raises(ValueError, match=message):
        token_dataset(f"tokens:{tmp_path}", 16)


def test_missing_and_foreign_directories(tmp_path, corpus, bpe):
    with pytest.raises(ValueError, match="tokens.json not found"):
        token_dataset(f"tokens:{tmp_path}", 16)
    with pytest.raises(ValueError, match="is not a directory"):
        token_dataset(f"tokens:{tmp_path / 'nope'}", 16)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a token directory"):
        write_tokens(str(tmp_path), bpe, corpus)
    write_tokens(str(tmp_path / "t"), bpe, corpus)
    write_tokens(str(tmp_path / "t"), ByteTokenizer(), corpus)       # a token dir: replaced
    assert read_header(str(tmp_path / "t"))["tokenizer"] == {"name": "bytes", "sha256": None,
                                                             "files": []}
    assert sorted(os.listdir(tmp_path / "t")) == ["tokens.json", "train.bin", "val.bin"]
    with pytest.raises(ValueError, match="seq_len=900 does not fit the val split"):
        token_dataset(f"tokens:{tmp_path / 't'}", 900)


# -- each rank reads only its rows -------------------------------------------------------------
class Recorder:
    """A TokenFile that records every token index read."""

    def __init__(self, inner):
        self.inner, self.read = inner, []

    def __len__(self):
        return len(self.inner)

    def __getitem__(self, idx):
        self.read.append(np.asarray(idx).ravel())
        return self.inner[idx]


def rank_reads(data, batch, dp, rank, step, seed=7):
    """The token indices rank `rank` of `dp` reads for `step`, and its rows' windows."""
    for w in (data.x_train, data.t_train):
        w.tokens = Recorder(w.tokens.inner if isinstance(w.tokens, Recorder) else w.tokens)
    b = DistributedBatcher(data.x_train, data.t_train, batch, dp, rank, seed)
    (x, t), = b.micro_batches(step)
    read = np.concatenate(data.x_train.tokens.read + data.t_train.tokens.read)
    rows = b.local_indices(*b.position(step))
    s, S = data.x_train.stride, data.seq_len
    want = np.unique((rows[:, None] * s + np.arange(S + 1)).ravel())
    return x, t, np.unique(read), want


def test_each_rank_reads_only_the_windows_of_its_rows(tmp_path, corpus, bpe):
    write_tokens(str(tmp_path), bpe, corpus, val_fraction=0.1)
    data = token_dataset(f"tokens:{tmp_path}", 16)
    full_x, full_t, _, _ = rank_reads(data, 8, 1, 0, step=3)
    got_x = []
    for rank in range(4):
        x, t, read, want = rank_reads(data, 8, 4, rank, step=3)
        assert np.array_equal(read, want), f"rank {rank} read tokens outside its rows"
        assert len(read) <= 2 * (16 + 1) < len(data.x_train.tokens) // 50
        got_x.append(x)
        assert np.array_equal(t[:, :-1], x[:, 1:])
    assert np.array_equal(np.concatenate(got_x), full_x)      # the ranks' rows: the batch


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs /proc/self/maps")
def test_nothing_of_the_file_stays_mapped(tmp_path, corpus, bpe):
    """After a batch is read, train.bin is not in the process' mappings: only the copies of
    the rows read are resident, so a rank's memory does not grow with the file."""
    write_tokens(str(tmp_path), bpe, corpus)
    data = token_dataset(f"tokens:{tmp_path}", 16)
    x = data.x_train[np.array([3, 1])]
    with open("/proc/self/maps") as f:
        maps = f.read()
    assert x.shape == (2, 16) and str(tmp_path / "train.bin") not in maps


# -- the same global batch on every layout (MPI) -----------------------------------------------
def lm_trainer(data, layout, comm, steps=6):
    model = ms.GPT(vocab_size=data.n_classes, seq_len=16, d_model=32, n_heads=4, n_layers=2)
    e = ms.SingleDevice(model, dtype=np.float64) if layout == "single" else \
        ms.make_engine(model, layout, dtype=np.float64, comm=comm)
    e.load_checkpoint(model.init(seed=2))
    return Trainer(e, AdamW(e, lr=3e-3), data, batch=8, steps=steps, clip=1.0,
                   eval_every=3, progress=False, log_every=0, seed=5)


@pytest.mark.mpi(min_size=1)
def test_token_file_trains_like_the_in_memory_tokens_on_every_layout():
    """tokens:DIR and --text with the same tokenizer: identical losses on one layout; every
    layout of this world size equals the single-device run (float64, rtol 1e-9)."""
    comm = world()
    n = comm.Get_size()
    root = shared_dir(comm)
    corpus_dir, path = os.path.join(root, "corpus"), os.path.join(root, "tokenizer.json")
    try:
        if comm.Get_rank() == 0:                 # one tokenizer, trained once, for every rank
            train_bpe(write_corpus(corpus_dir)).save(path)
            write_tokens(os.path.join(root, "tok"), HFTokenizer(
                tokenizers.Tokenizer.from_file(path), "bpe"), corpus_dir, None, 0.1)
        comm.Barrier()
        tok = HFTokenizer(tokenizers.Tokenizer.from_file(path), "bpe")
        memory = tokenized_text_dataset(16, tok, corpus_dir, val_fraction=0.1)
        ref = lm_trainer(memory, "single", None).fit()
        layouts = [f"dp={n}"] + ([f"tp={n}"] if n > 1 and 4 % n == 0 else []) + \
            ([f"dp=2,tp={n // 2}"] if n >= 4 and n % 2 == 0 else [])
        for layout in layouts:
            file_data = token_dataset(f"tokens:{os.path.join(root, 'tok')}", 16)
            got = lm_trainer(file_data, layout, comm).fit()
            mem = lm_trainer(memory, layout, comm).fit()
            assert got["loss_history"] == mem["loss_history"], layout
            assert got["test_loss"] == mem["test_loss"], layout
            assert_close(got["loss_history"], ref["loss_history"], RTOL64, what=layout)
            assert_close(got["test_loss"], ref["test_loss"], RTOL64, what=layout)
            worst = max(abs(g - w) / abs(w) for g, w in zip(got["loss_history"],
                                                             ref["loss_history"]))
            print(f"{layout}: losses {np.round(got['loss_history'], 4).tolist()}, val "
                  f"{got['test_loss']:.6f}; worst relative difference to single {worst:.1e}")
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


@pytest.mark.mpi(min_size=2)
def test_under_mpi_each_rank_reads_its_own_rows():
    """dp=2 on a 2-rank group: each rank's reads are exactly the windows of its rows, and the
    two ranks' reads together are the windows of the global batch."""
    comm = group_comm(2)
    root = shared_dir(comm)
    try:
        if comm.Get_rank() == 0:
            write_tokens(os.path.join(root, "tok"), ByteTokenizer(),
                         write_corpus(os.path.join(root, "c")), None, 0.1)
        comm.Barrier()
        data = token_dataset(f"tokens:{os.path.join(root, 'tok')}", 16)
        with ms.make_engine(ms.GPT(256, 16, 16, 2, 1), "dp=2", comm=comm) as e:
            _, _, read, want = rank_reads(data, 8, e.data_parallel_size,
                                          e.data_parallel_rank, step=2)
        assert np.array_equal(read, want) and len(read) <= 4 * 17
        _, _, _, whole = rank_reads(data, 8, 1, 0, step=2)
        both = comm.allgather(read.tolist())
        assert sorted(set(both[0]) | set(both[1])) == whole.tolist()
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)

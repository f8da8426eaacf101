"""A checkpoint's index.json is untrusted input: the files it names are plain names inside the
checkpoint's directory, and the shapes, offsets, dtypes and sizes it and the .npy headers give
are checked against the bytes on disk before anything is allocated or read.

Each case edits a good single-device checkpoint so that everything else still matches (the
secret outside the directory is a copy of the real block, with the same sha256): without the
check, the load would succeed and read the secret as a weight.
"""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint import CheckpointError
from mpishard.checkpoint.format import read_asset

W = "layer_0/weights"


@pytest.fixture
def good(tmp_path):
    model = ms.MLP([6, 8, 3], activation="tanh")
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(model.init(seed=1))
    ms.checkpoint.save(tmp_path / "good", engine)
    return tmp_path / "good"


def _edit(good, name, fn):
    """A copy of checkpoint `good` named `name` with fn(directory, index, W's chunk) applied."""
    d = good.parent / name
    shutil.copytree(good, d)
    index = json.loads((d / "index.json").read_text())
    fn(d, index, index["tensors"][W]["chunks"][0])
    (d / "index.json").write_text(json.dumps(index))
    return d


def _point_at(index, chunk, name):
    """Make W's chunk (and its files entry) name `name` instead of its own file."""
    index["files"][name] = index["files"].pop(chunk["file"])
    chunk["file"] = name


def _secret(d):
    """A copy of W's block outside the checkpoint directory: its sha256 and size match."""
    block = d / json.loads((d / "index.json").read_text())["tensors"][W]["chunks"][0]["file"]
    secret = d.parent / "elsewhere" / "secret.npy"
    secret.parent.mkdir(exist_ok=True)
    shutil.copy(block, secret)
    return secret


def test_the_untouched_checkpoint_loads(good):
    assert np.asarray(ms.checkpoint.load(good)[W]).shape == (6, 8)


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_a_chunk_file_outside_the_directory_is_refused(good, how):
    def fn(d, index, chunk):
        secret = _secret(d)
        _point_at(index, chunk, {"relative": "../elsewhere/secret.npy",
                                 "absolute": str(secret)}[how])

    d = _edit(good, how, fn)
    name = json.loads((d / "index.json").read_text())["tensors"][W]["chunks"][0]["file"]
    with pytest.raises(CheckpointError, match=(
            rf"checkpoint {d}: index.json: chunk '{W}' file '{name}' is not a plain file name "
            rf"inside {d} \(it has a path separator\)")):
        ms.checkpoint.load(d)


def test_a_chunk_file_linked_into_the_directory_is_read(good):
    """The rule is on the name: a plain name that is a symlink the directory's owner placed
    there (as a hub cache or a shared store links its files) is read wherever it leads."""
    def fn(d, index, chunk):
        secret = _secret(d)
        os.remove(d / chunk["file"])
        os.symlink(os.path.relpath(secret, d), d / chunk["file"])

    d = _edit(good, "linked", fn)
    want = np.asarray(ms.checkpoint.load(good)[W])
    assert np.array_equal(np.asarray(ms.checkpoint.load(d)[W]), want)


def test_a_files_entry_outside_the_directory_is_refused(good):
    """A name in `files` that no chunk uses is refused too: nothing outside is even stat'ed."""
    def fn(d, index, chunk):
        _secret(d)
        index["files"]["../elsewhere/secret.npy"] = dict(index["files"][chunk["file"]])

    d = _edit(good, "files", fn)
    with pytest.raises(CheckpointError, match=r"index.json: files entry "
                                              r"'../elsewhere/secret.npy' is not a plain"):
        ms.checkpoint.load(d)


def _rewrite_header(path, shape):
    """Replace the .npy header of `path` with one claiming `shape` (the data bytes kept)."""
    a = np.load(path)
    header = {"descr": np.lib.format.dtype_to_descr(a.dtype), "fortran_order": False,
              "shape": tuple(shape)}
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(f, header)
        f.write(a.tobytes())
    data = path.read_bytes()
    return {"sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data)}


@pytest.mark.parametrize("rows", [600, 10**12])
def test_a_block_header_claiming_more_than_the_file_holds_is_refused(good, rows):
    """The index and the header agree on a shape the file's bytes do not hold (600 rows: a read
    past the end of the file; 10**12 rows: an 64 TB allocation): refused when the checkpoint
    is opened, naming the file and both sizes."""
    def fn(d, index, chunk):
        index["files"][chunk["file"]] = _rewrite_header(d / chunk["file"], (rows, 8))
        index["tensors"][W]["shape"] = [rows, 8]

    d = _edit(good, f"rows{rows}", fn)
    fname = json.loads((d / "index.json").read_text())["tensors"][W]["chunks"][0]["file"]
    with pytest.raises(CheckpointError, match=rf"{fname}'s header says \({rows}, 8\) float64 "
                                              rf"\({rows * 64} bytes\), the file holds 384 "
                                              rf"bytes of data"):
        ms.checkpoint.load(d)


@pytest.mark.parametrize("field,value,message", [
    ("offset", [1, 0], r"chunk \S+ of shape \(6, 8\) at offset \(1, 0\) does not fit "
                       rf"{W} of shape \(6, 8\)"),
    ("offset", [0, 10**15], r"at offset \(0, 1000000000000000\) does not fit"),
    ("offset", [-1, 0], rf"the offset of {W}'s chunk \S+ must be a list of integers >= 0"),
    ("shape", [10**12, 8], rf"the chunks of {W} hold 48 elements, its shape "
                           r"\(1000000000000, 8\) needs 8000000000000"),
    ("shape", [6, -8], rf"{W}'s shape must be a list of integers >= 0, got \[6, -8\]"),
    ("dtype", "O", rf"index.json: '{W}' dtype 'O' is not a number type"),
    ("dtype", "<U8", rf"index.json: '{W}' dtype '<U8' is not a number type"),
    ("bytes", -1, r"index.json: bytes of '\S+' must be an integer >= 0, got -1"),
])
def test_index_numbers_past_the_array_or_the_file_are_refused(good, field, value, message):
    def fn(d, index, chunk):
        if field == "offset":
            chunk["offset"] = value
        elif field == "bytes":
            index["files"][chunk["file"]]["bytes"] = value
        else:
            index["tensors"][W][field] = value

    with pytest.raises(CheckpointError, match=message):
        ms.checkpoint.load(_edit(good, f"{field}{value}", fn))


def test_an_asset_read_through_a_symlink_in_the_directory_is_read(good):
    """A checkpoint's assets (a carried tokenizer, standardisation arrays) are read through the
    same helper: a plain name that is a link the directory holds is read where it leads, and
    still checked against the sha256 the index records."""
    ckpt = ms.checkpoint.load(good)
    secret = _secret(good)
    os.symlink(secret, good / "tokenizer.json")
    ckpt.index["files"]["tokenizer.json"] = {"sha256": hashlib.sha256(secret.read_bytes())
                                             .hexdigest(), "bytes": secret.stat().st_size}
    assert read_asset(ckpt, "tokenizer.json") == secret.read_bytes()
    ckpt.index["files"]["tokenizer.json"]["sha256"] = "0" * 64
    with pytest.raises(CheckpointError, match=r"tokenizer.json is corrupt"):
        read_asset(ckpt, "tokenizer.json")

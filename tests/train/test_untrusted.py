"""A name read from a file is a plain file name inside its directory, and header numbers are
checked before anything is allocated: train/untrusted.py, and tokens.json read through it.

The token directories are written by `write_tokens` with a byte tokenizer, then one field of
tokens.json is changed: a name leading out of the directory (`../elsewhere/secret.bin`, an
absolute path) is refused with the field named, and never read as tokens. The rule is about the
name: a symlink the directory's owner placed in it is read wherever it leads (a Hugging Face
hub cache is made of such links).
"""
import json
import os

import numpy as np
import pytest

from mpishard.train.tokenizer import ByteTokenizer
from mpishard.train.tokens import token_dataset, write_tokens
from mpishard.train.untrusted import file_in, numeric_dtype, whole_number, whole_numbers


@pytest.fixture
def place(tmp_path):
    """DIR (holding a.npy) and, beside it, elsewhere/secret.npy."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "a.npy").write_bytes(b"a")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "secret.npy").write_bytes(b"secret")
    return tmp_path


def test_a_plain_name_inside_the_directory_is_its_path(place):
    d = str(place / "dir")
    assert file_in(d, "a.npy", "f") == os.path.join(d, "a.npy")
    assert file_in(d, "not-yet.npy", "f") == os.path.join(d, "not-yet.npy")   # may not exist
    os.symlink("a.npy", place / "dir" / "alias.npy")            # a symlink that stays inside
    assert file_in(d, "alias.npy", "f") == os.path.join(d, "alias.npy")
    os.symlink(place / "dir", place / "linked")                 # the directory itself a link
    assert file_in(place / "linked", "a.npy", "f") == os.path.join(place / "linked", "a.npy")


@pytest.mark.parametrize("name,reason", [
    ("../elsewhere/secret.npy", "it has a path separator"),
    ("/etc/passwd", "it has a path separator"),
    ("sub/a.npy", "it has a path separator"),
    ("..", "a directory"),
    (".", "a directory"),
    ("", "empty"),
    ("a\0.npy", "it has a NUL"),
    (7, "int, not a string"),
    (None, "NoneType, not a string"),
])
def test_anything_else_is_refused_naming_the_field(place, name, reason):
    d = str(place / "dir")
    with pytest.raises(ValueError) as e:
        file_in(d, name, "index.json: chunk 'layer_0/weights' file")
    assert str(e.value) == (f"index.json: chunk 'layer_0/weights' file {name!r} is not a plain "
                            f"file name inside {d} ({reason})")


def test_a_symlink_in_the_directory_is_its_path_wherever_it_leads(place):
    """The check is on the name, not on where the directory's own links lead: a link to a file
    elsewhere (the hub cache's `snapshots/<rev>/x -> ../../blobs/<sha>`) is accepted."""
    d = str(place / "dir")
    os.symlink(place / "elsewhere" / "secret.npy", place / "dir" / "b.npy")
    os.symlink("../elsewhere/secret.npy", place / "dir" / "c.npy")
    assert file_in(d, "b.npy", "field") == os.path.join(d, "b.npy")
    assert file_in(d, "c.npy", "field") == os.path.join(d, "c.npy")
    assert open(file_in(d, "c.npy", "field"), "rb").read() == b"secret"


def test_the_error_class_is_the_callers():
    class Mine(ValueError):
        pass
    with pytest.raises(Mine, match="x '..'"):
        file_in(".", "..", "x", Mine)


def test_numbers_and_dtypes_from_a_header():
    assert whole_numbers([0, 3], "shape") == (0, 3)
    assert whole_number(-1, "max_id", low=-1) == -1
    for bad in ([2.0], [True], ["2"], [-1], (1, 2), None):
        with pytest.raises(ValueError, match="shape must be a list of integers >= 0, got"):
            whole_numbers(bad, "shape")
    for bad in (2.0, True, "2", -2, None):
        with pytest.raises(ValueError, match="count must be an integer >= -1"):
            whole_number(bad, "count", low=-1)
    assert numeric_dtype("<f4", "dtype") == np.float32 and numeric_dtype("?", "d") == np.bool_
    for bad, why in (("O", "not a number type"), ("<U3", "not a number type"),
                     ("V8", "not a number type"), ([("a", "<f4")], "not a number type"),
                     ("float99", "not a dtype"), (["x"], "not a dtype")):
        with pytest.raises(ValueError, match=f"index.json 'w' dtype .* is {why}"):
            numeric_dtype(bad, "index.json 'w' dtype")


# -- tokens.json -------------------------------------------------------------------------------
@pytest.fixture
def tokens_dir(tmp_path):
    """A token directory (byte tokenizer) and a secret beside it that must never be read."""
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "doc.txt").write_bytes(b"hello tokens, " * 50)
    write_tokens(str(tmp_path / "t"), ByteTokenizer(), str(tmp_path / "corpus"))
    (tmp_path / "elsewhere").mkdir()
    np.arange(400, dtype=np.uint16).tofile(tmp_path / "elsewhere" / "secret.bin")
    return tmp_path


def _change(directory, split, **fields):
    path = os.path.join(directory, "tokens.json")
    with open(path) as f:
        header = json.load(f)
    header[split].update(fields)
    with open(path, "w") as f:
        json.dump(header, f)


@pytest.mark.parametrize("name", ["../elsewhere/secret.bin", "ABSOLUTE", ""])
def test_tokens_json_names_no_file_outside_its_directory(tokens_dir, name):
    t = str(tokens_dir / "t")
    secret = str(tokens_dir / "elsewhere" / "secret.bin")
    if name == "ABSOLUTE":
        name = secret
    _change(t, "val", file=name, count=400)          # the secret's own size: it would be read
    with pytest.raises(ValueError, match=rf"dataset tokens:{t}: tokens.json field val.file "
                                         rf"'{name}' is not a plain file name inside {t}"):
        token_dataset(f"tokens:{t}", 8)


def test_a_token_file_linked_into_its_directory_is_read(tokens_dir):
    """val.bin as a link to a file of tokens elsewhere (as a hub cache or a shared store links
    its files): the name is plain, so its tokens are read."""
    t = str(tokens_dir / "t")
    os.remove(os.path.join(t, "val.bin"))
    os.symlink(tokens_dir / "elsewhere" / "secret.bin", os.path.join(t, "val.bin"))
    _change(t, "val", count=400)
    data = token_dataset(f"tokens:{t}", 8)
    assert data.corpus["val_tokens"] == 400
    assert np.array_equal(np.asarray(data.x_test)[1], np.arange(8, 16))


@pytest.mark.parametrize("files,message", [
    (["../elsewhere/secret.bin"], r"field tokenizer.files \['../elsewhere/secret.bin'\] is not a "
                                  r"list of some of \['tokenizer.json'"),
    (["tokens.json"], r"field tokenizer.files \['tokens.json'\] is not a list"),
    (["tokenizer_config.json"], r"is not a list of .* with tokenizer.json"),
    ("tokenizer.json", r"field tokenizer.files 'tokenizer.json' is not a list"),
    (["tokenizer.json"], r"field tokenizer.files: tokenizer.json is missing from"),
])
def test_tokens_json_names_only_tokenizer_files_it_holds(tokens_dir, files, message):
    """tokenizer.files names the tokenizer's own files inside DIR and nothing else: not a
    path, not the header or the tokens (a checkpoint would carry them as a tokenizer)."""
    t = str(tokens_dir / "t")
    _change(t, "tokenizer", files=files)
    with pytest.raises(ValueError, match=message):
        token_dataset(f"tokens:{t}", 8)


@pytest.mark.parametrize("count,message", [
    (10**12, r"tokens.json field train.count: train.bin should hold 1000000000000 uint16 "
             r"tokens \(2000000000000 bytes\), it has \d+ bytes"),
    (-5, "train.count must be an integer >= 0, got -5"),
    (12.0, "train.count must be an integer >= 0, got 12.0"),
    ("12", "train.count must be an integer >= 0, got '12'"),
])
def test_a_count_past_the_end_of_its_file_is_refused(tokens_dir, count, message):
    """A count is checked against the file's bytes (no window reaches past its end), and is a
    whole number: 12.0 or '12' is refused, not converted by int()."""
    t = str(tokens_dir / "t")
    _change(t, "train", count=count)
    with pytest.raises(ValueError, match=message):
        token_dataset(f"tokens:{t}", 8)


def _rewrite_header(t: str, **fields) -> None:
    """tokens.json of directory `t` with `fields` set at its top level."""
    path = os.path.join(t, "tokens.json")
    with open(path) as f:
        header = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(header, **fields), f)


def test_a_vocabulary_past_32_bit_ids_is_refused_naming_the_file(tokens_dir):
    t = str(tokens_dir / "t")
    _rewrite_header(t, vocab_size=2**40)
    with pytest.raises(ValueError, match=rf"dataset tokens:{t}: tokens.json lacks or garbles a "
                                         rf"field: a vocabulary of {2**40} ids does not fit"):
        token_dataset(f"tokens:{t}", 8)


def test_an_eos_id_outside_the_vocabulary_is_refused(tokens_dir):
    t = str(tokens_dir / "t")
    for eos in (256, -1, 3.0):
        _rewrite_header(t, eos_id=eos)
        with pytest.raises(ValueError, match=rf"tokens.json field eos_id={eos!r} is not an id "
                                             rf"below vocab_size \d+"):
            token_dataset(f"tokens:{t}", 8)

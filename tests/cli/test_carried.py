"""What a checkpoint carries of its data, and the commands that use it: the tokenizer of a
train --tokenizer / tokens:DIR run (its files and sha256, which `generate --checkpoint` uses
by default; bytes refused for a vocabulary that is not bytes') and digits' standardisation
(the mean and std as .npy files, which `infer` applies to raw features).

    pytest -m "not mpi" tests/cli/test_carried.py
    mpiexec -n 4 python -m mpi4py -m pytest --with-mpi -m mpi tests/cli/test_carried.py
"""
import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import mpishard as ms
from mpishard import cli
from mpishard.cli.generate import Text, carried_eos
from mpishard.train.data import STANDARDIZE_FILES, digits
from mpishard.train.tokenizer import ByteTokenizer

from conftest import assert_close, world
from test_tokens import EOS, VOCAB, shared_dir, train_bpe, write_corpus

RUN = ["--batch", "8", "--no-progress", "--log-every", "0", "--log-level", "WARNING"]
GPT = ["--model", "gpt", "--gpt", "d_model=32,n_heads=2,n_layers=1,seq_len=16", "--steps", "2"]
PROMPT = "def add(a, b):"
CARRIED = ["chat_template.jinja", "special_tokens_map.json", "tokenizer.json",
           "tokenizer_config.json"]


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """A corpus and a BPE tokenizer directory: tokenizer.json, tokenizer_config.json,
    special_tokens_map.json and a chat template, and a file that is none of those."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("carried")
    write_corpus(str(root / "corpus"))
    (root / "tok").mkdir()
    train_bpe(str(root / "corpus")).save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    (root / "tok" / "special_tokens_map.json").write_text(json.dumps({"eos_token": EOS}))
    (root / "tok" / "chat_template.jinja").write_text("{% for m in messages %}{{ m.content }}"
                                                      "{% endfor %}")
    (root / "tok" / "notes.txt").write_text("not a tokenizer file")
    return root


def train(root, ckpt, *data):
    assert cli.main(["train", *GPT, *RUN, "--checkpoint-dir", str(ckpt), *data]) == 0


def sha(path) -> str:
    return hashlib.sha256(open(path, "rb").read()).hexdigest()


def greedy_text(ckpt, tok, prompt, n, eos=None) -> str:
    """What generate must print: the checkpoint's greedy continuation of `prompt` under the
    tokenizer `tok` (ended at an id in `eos`), decoded by it."""
    model = ms.checkpoint.load(ckpt).model()
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(ms.checkpoint.load(ckpt))
    ids = tok.encode(prompt).ids
    new = engine.generate([ids], n, temperature=0.0, eos=eos)[0]
    return prompt + Text(tok).whole(new, ids) + "\n"


def test_generate_uses_the_tokenizer_the_checkpoint_carries(root, tmp_path, capsys):
    """train --tokenizer DIR: the checkpoint holds DIR's tokenizer.json and
    tokenizer_config.json (their sha256 in the index) and the tokenizer's record; generate
    --checkpoint encodes and decodes with it (bytes crashed on ids past 255) and ends a
    completion at its end-of-text id by default."""
    ckpt = tmp_path / "ck"
    train(root, ckpt, "--text", str(root / "corpus"), "--tokenizer", str(root / "tok"))
    saved = ms.checkpoint.load(ckpt)
    assert saved.model().vocab_size == VOCAB
    record = saved.extra["tokenizer"]
    tok = ms.hf.tokenizer(root / "tok")
    assert record["sha256"] == hashlib.sha256(tok.to_str().encode()).hexdigest()
    assert record["files"] == CARRIED
    assert not (ckpt / "notes.txt").exists()
    assert record["eos_id"] == tok.token_to_id(EOS)
    for name in record["files"]:
        assert saved.index["files"][name]["sha256"] == sha(root / "tok" / name)
        assert sha(ckpt / name) == sha(root / "tok" / name)
    assert carried_eos(saved) == [record["eos_id"]]
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(ckpt), "--prompt", PROMPT,
                     "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy_text(ckpt, tok, PROMPT, 12, [record["eos_id"]])


def test_bytes_are_refused_where_the_ids_are_not_bytes(root, tmp_path, capsys):
    """--tokenizer bytes on the 320-id model: one error line naming both vocabularies; a
    damaged carried tokenizer.json is refused by its sha256; a byte-level model (vocab 256)
    still generates with bytes by default."""
    ckpt = tmp_path / "ck"
    train(root, ckpt, "--text", str(root / "corpus"), "--tokenizer", str(root / "tok"))
    capsys.readouterr()
    gen = ["generate", "--checkpoint", str(ckpt), "--prompt", "x", "--max-new-tokens", "2"]
    assert cli.main([*gen, "--tokenizer", "bytes"]) == 2
    err = capsys.readouterr().err
    assert "--tokenizer bytes: the model's vocabulary has 320 ids, bytes have 256" in err
    with open(ckpt / "tokenizer.json", "r+b") as f:        # same size, other bytes
        first = f.read(1)
        f.seek(0)
        f.write(b"[" if first != b"[" else b"{")
    assert cli.main(gen) == 2
    assert "tokenizer.json is corrupt" in capsys.readouterr().err
    byte_ckpt = tmp_path / "bytes"
    train(root, byte_ckpt, "--text", str(root / "corpus"))
    assert ms.checkpoint.load(byte_ckpt).extra["tokenizer"]["name"] == "bytes"
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(byte_ckpt), "--prompt", "d",
                     "--max-new-tokens", "3", "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("d")


def test_a_bytes_checkpoint_whose_model_samples_no_byte_is_one_error_line(tmp_path, capsys):
    """A checkpoint trained on bytes whose model has 300 ids (a fine-tune of a larger
    vocabulary on bytes) that samples id 299: generate says which id and vocabulary, no
    traceback, streamed or not."""
    model = ms.GPT(vocab_size=300, seq_len=16, d_model=16, n_heads=2, n_layers=1)
    params = model.init(seed=0)
    params["ln_f/scale"][:] = 0.0            # the final norm's output: its shift, all ones
    params["ln_f/shift"][:] = 1.0
    params["head/weights"][:] = 0.0
    params["head/weights"][:, 299] = 1.0     # so every step's logits pick id 299
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    ms.checkpoint.save(str(tmp_path / "ck"), engine,
                       extra={"tokenizer": ByteTokenizer().carried()[0]})
    gen = ["generate", "--checkpoint", str(tmp_path / "ck"), "--max-new-tokens", "2",
           "--temperature", "0", "--prompt", "ab"]
    for argv in (gen, [*gen, "--prompt", "cd"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "the model sampled id 299, which is no byte" in err and "300 ids" in err, err
        assert "Traceback" not in err and err.count("\n") == 1


def test_a_token_directory_carries_its_tokenizer_into_the_checkpoint(root, tmp_path, capsys):
    """tokenize writes the tokenizer's files beside the tokens and names them in tokens.json;
    train --dataset tokens:DIR without --tokenizer carries those (the tokenizer's own
    directory is gone by then), and generate --checkpoint encodes and decodes with them."""
    tok_dir = tmp_path / "tok"
    shutil.copytree(root / "tok", tok_dir)
    ids = tmp_path / "ids"
    assert cli.main(["tokenize", "--tokenizer", str(tok_dir), "--text", str(root / "corpus"),
                     "--out", str(ids)]) == 0
    assert json.loads((ids / "tokens.json").read_text())["tokenizer"]["files"] == CARRIED
    assert all(sha(ids / n) == sha(tok_dir / n) for n in CARRIED)
    assert not (ids / "notes.txt").exists()
    shutil.rmtree(tok_dir)
    train(root, tmp_path / "ck", "--dataset", f"tokens:{ids}")
    record = ms.checkpoint.load(tmp_path / "ck").extra["tokenizer"]
    assert record["files"] == CARRIED
    assert all(sha(tmp_path / "ck" / n) == sha(root / "tok" / n) for n in CARRIED)
    capsys.readouterr()
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "ck"), "--prompt", PROMPT,
                     "--max-new-tokens", "12", "--temperature", "0"]) == 0
    assert capsys.readouterr().out == greedy_text(tmp_path / "ck", ms.hf.tokenizer(root / "tok"),
                                                  PROMPT, 12, [record["eos_id"]])


def _header(ids, change):
    header = json.loads((ids / "tokens.json").read_text())
    change(header["tokenizer"])
    (ids / "tokens.json").write_text(json.dumps(header))


def test_the_tokenizer_path_in_tokens_json_is_never_followed(root, tmp_path, capsys):
    """tokens.json's tokenizer.name is shown, never read. An older token directory (no
    tokenizer files) whose name is a readable tokenizer with the recorded sha256: the
    checkpoint records the identity only, a warning says generate will need --tokenizer, and
    generate asks for it. A current one whose name points at another tokenizer: the files the
    directory holds are carried, nothing of the other."""
    ids = tmp_path / "ids"
    assert cli.main(["tokenize", "--tokenizer", str(root / "tok"), "--text",
                     str(root / "corpus"), "--out", str(ids)]) == 0
    for n in CARRIED:
        os.remove(ids / n)
    _header(ids, lambda t: (t.pop("files"), t.update(name=str(root / "tok"))))
    capsys.readouterr()
    train(root, tmp_path / "old", "--dataset", f"tokens:{ids}")
    assert "holds no tokenizer files" in capsys.readouterr().err
    old = ms.checkpoint.load(tmp_path / "old").extra["tokenizer"]
    assert old["files"] == [] and old["sha256"] == sha256_of(root / "tok")
    assert not (tmp_path / "old" / "tokenizer.json").exists()
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "old"), "--prompt", "x"]) == 2
    assert "does not carry its files; give --tokenizer DIR" in capsys.readouterr().err
    assert cli.main(["generate", "--checkpoint", str(tmp_path / "old"), "--prompt", PROMPT,
                     "--tokenizer", str(root / "tok"), "--max-new-tokens", "3"]) == 0

    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer.json").write_text(ms.hf.tokenizer(root / "tok").to_str())
    (other / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS, "x": 1}))
    assert cli.main(["tokenize", "--tokenizer", str(root / "tok" / "tokenizer.json"), "--text",
                     str(root / "corpus"), "--out", str(ids)]) == 0
    _header(ids, lambda t: t.update(name=str(other)))
    train(root, tmp_path / "ck", "--dataset", f"tokens:{ids}")
    record = ms.checkpoint.load(tmp_path / "ck").extra["tokenizer"]
    assert record["files"] == CARRIED and record["name"] == str(other)
    assert all(sha(tmp_path / "ck" / n) == sha(root / "tok" / n) for n in CARRIED)


def test_a_token_directory_tokenizer_not_the_recorded_one_stops_the_run(root, tmp_path,
                                                                          capsys):
    """The tokenizer.json beside the tokens is checked against tokens.json's sha256: another
    tokenizer there stops train with one line naming both hashes."""
    ids = tmp_path / "ids"
    assert cli.main(["tokenize", "--tokenizer", str(root / "tok"), "--text",
                     str(root / "corpus"), "--out", str(ids)]) == 0
    want = json.loads((ids / "tokens.json").read_text())["tokenizer"]["sha256"]
    (ids / "tokenizer.json").write_text(train_bpe(str(root / "corpus"), vocab=300).to_str())
    capsys.readouterr()
    assert cli.main(["train", *GPT, *RUN, "--dataset", f"tokens:{ids}"]) == 2
    err = capsys.readouterr().err
    assert f"--dataset tokens:{ids}: its tokenizer.json has sha256 " in err
    assert f"tokens.json records {want[:16]}..." in err and err.count("\n") == 1


def sha256_of(tok_dir) -> str:
    return hashlib.sha256(ms.hf.tokenizer(tok_dir).to_str().encode()).hexdigest()


@pytest.mark.mpi(min_size=1)
def test_every_rank_saves_and_generates_with_the_carried_tokenizer(capsys):
    """On the whole world (dp over every rank, asynchronous saves every step): the checkpoint
    rank 0 writes carries the tokenizer; generate --checkpoint on every rank prints on rank 0
    one device's greedy text; --tokenizer bytes is the same error on every rank."""
    pytest.importorskip("tokenizers")
    comm = world()
    root = shared_dir(comm)
    corpus, tok_dir, ckpt = (os.path.join(root, n) for n in ("corpus", "tok", "ck"))
    if comm.Get_rank() == 0:
        write_corpus(corpus)
        os.makedirs(tok_dir)
        train_bpe(corpus).save(os.path.join(tok_dir, "tokenizer.json"))
    comm.Barrier()
    try:
        assert cli.main(["train", *GPT, *RUN, "--dtype", "float64", "--text", corpus,
                         "--tokenizer", tok_dir, "--checkpoint-dir", ckpt,
                         "--checkpoint-every", "1", "--checkpoint-async"]) == 0
        assert ms.checkpoint.load(ckpt).extra["tokenizer"]["files"] == ["tokenizer.json"]
        capsys.readouterr()
        assert cli.main(["generate", "--checkpoint", ckpt, "--prompt", PROMPT,
                         "--max-new-tokens", "6", "--temperature", "0"]) == 0
        out = capsys.readouterr().out
        tok = ms.hf.tokenizer(tok_dir)
        assert out == (greedy_text(ckpt, tok, PROMPT, 6) if comm.Get_rank() == 0 else "")
        assert cli.main(["generate", "--checkpoint", ckpt, "--prompt", "x",
                         "--tokenizer", "bytes"]) == 2
        err = capsys.readouterr().err                   # rank 0 prints the one line
        assert comm.Get_rank() > 0 or "vocabulary has 320 ids, bytes have 256" in err
    finally:
        comm.Barrier()
        if comm.Get_rank() == 0:
            shutil.rmtree(root, ignore_errors=True)


def raw_digits(seed=0):
    """The raw (unstandardised) test features and labels of train's digits split."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    x, y = load_digits(return_X_y=True)
    _, x_test, _, y_test = train_test_split(x.astype(np.float64), y.astype(np.int64),
                                            test_size=0.2, random_state=seed, stratify=y)
    return x_test, y_test


def test_infer_standardises_raw_digits_as_training_did(tmp_path, capsys):
    """A digits checkpoint keeps the training split's mean and std (two .npy files, in the
    index with their sha256); infer on the raw features gives the trainer's own test
    accuracy and outputs, and says it standardised; --no-standardize feeds them as they are."""
    pytest.importorskip("sklearn")
    ckpt, metrics = tmp_path / "ck", tmp_path / "m.json"
    assert cli.main(["train", "--dataset", "digits", "--steps", "20", "--batch", "64",
                     "--dtype", "float64", "--no-progress", "--log-level", "WARNING",
                     "--checkpoint-dir", str(ckpt), "--metrics-json", str(metrics)]) == 0
    saved = ms.checkpoint.load(ckpt)
    assert saved.extra["standardize"] == STANDARDIZE_FILES
    data = digits(0)
    for key, name in STANDARDIZE_FILES.items():
        assert name in saved.index["files"]
        assert np.array_equal(np.load(ckpt / name, allow_pickle=False), data.standardize[key])
    x, y = raw_digits()
    np.save(tmp_path / "x.npy", x)
    capsys.readouterr()
    assert cli.main(["infer", "--checkpoint", str(ckpt), "--input", str(tmp_path / "x.npy"),
                     "--output", str(tmp_path / "y.npy"), "--batch", "100"]) == 0
    assert "the input standardised with the training split's mean and std" in \
        capsys.readouterr().out
    out = np.load(tmp_path / "y.npy")
    want = json.load(open(metrics))["test_accuracy"]
    assert (out.argmax(axis=1) == y).mean() == want
    engine = ms.SingleDevice(saved.model())
    engine.load_checkpoint(saved)
    assert_close(out, np.asarray(engine.predict(data.x_test)), rtol=1e-12,
                 what="infer on raw features vs predict on the trainer's standardised ones")
    assert cli.main(["infer", "--checkpoint", str(ckpt), "--input", str(tmp_path / "x.npy"),
                     "--output", str(tmp_path / "raw.npy"), "--no-standardize"]) == 0
    assert not np.array_equal(np.load(tmp_path / "raw.npy"), out)

"""`export` writes a complete Hugging Face directory: the weights (sharded with an index past
--max-shard-size, as save_pretrained does), config.json, generation_config.json and the
tokenizer the checkpoint carries, so transformers' AutoTokenizer and AutoModelForCausalLM
take it whole. A BPE tokenizer is trained here with the `tokenizers` library (no download).

    pytest tests/hf/test_hf_export_complete.py
"""
import json
import os
import shutil

import numpy as np
import pytest
import torch

import mpishard as ms
from mpishard import cli
from conftest import assert_close
from hf_models import gpt2, hf_logits, tokens
from test_tokens import EOS, VOCAB, train_bpe, write_corpus

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

TEXT = "def add(a, b):\n    return naïve + café  # 東京\n"
GPT = ["--model", "gpt", "--gpt", "d_model=32,n_heads=2,n_layers=2,seq_len=16", "--steps", "2",
       "--batch", "8", "--dtype", "float64", "--no-progress", "--log-level", "WARNING"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(root, checkpoint) of a GPT trained 2 steps with --tokenizer DIR, where DIR holds a
    BPE's tokenizer.json and a tokenizer_config.json naming its eos token."""
    root = tmp_path_factory.mktemp("export")
    write_corpus(str(root / "corpus"))
    (root / "tok").mkdir()
    train_bpe(str(root / "corpus")).save(str(root / "tok" / "tokenizer.json"))
    (root / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": EOS}))
    assert cli.main(["train", *GPT, "--text", str(root / "corpus"), "--tokenizer",
                     str(root / "tok"), "--checkpoint-dir", str(root / "ck")]) == 0
    return root, root / "ck"


def test_autotokenizer_reads_the_exported_tokenizer(trained, tmp_path):
    """AutoTokenizer on the export is the training tokenizer (320 ids, the same ids for a
    text, eos named); config.json and generation_config.json carry its eos id (an
    export without the tokenizer's files gives AutoTokenizer one of length 1)."""
    root, ckpt = trained
    out = tmp_path / "out"
    assert cli.main(["export", "--checkpoint", str(ckpt), "--hf", str(out)]) == 0
    want = ms.hf.tokenizer(root / "tok")
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == VOCAB == want.get_vocab_size()
    assert tok(TEXT)["input_ids"] == want.encode(TEXT).ids
    assert tok.decode(want.encode(TEXT).ids) == TEXT
    eos = want.token_to_id(EOS)
    assert tok.eos_token == EOS and tok.eos_token_id == eos
    assert json.load(open(out / "config.json"))["eos_token_id"] == eos
    assert json.load(open(out / "generation_config.json")) == {"_from_model_config": True,
                                                                "eos_token_id": eos}
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (root / "tok" / name).read_bytes()
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert model.generation_config.eos_token_id == eos


def test_a_tokenizer_without_its_config_gets_one_transformers_reads(trained, tmp_path):
    """export --tokenizer FILE (a tokenizer.json alone in its directory): the export adds a
    tokenizer_config.json naming the fast tokenizer class and the eos token."""
    root, ckpt = trained
    out, bare = tmp_path / "out", tmp_path / "bare"
    bare.mkdir()
    (bare / "tok.json").write_bytes((root / "tok" / "tokenizer.json").read_bytes())
    assert cli.main(["export", "--checkpoint", str(ckpt), "--hf", str(out), "--tokenizer",
                     str(bare / "tok.json")]) == 0
    cfg = json.load(open(out / "tokenizer_config.json"))
    assert cfg["tokenizer_class"] == "PreTrainedTokenizerFast" and cfg["eos_token"] == EOS
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == VOCAB and tok(TEXT)["input_ids"] == ms.hf.tokenizer(
        root / "tok").encode(TEXT).ids


def test_a_large_model_exports_in_shards_with_an_index(trained, tmp_path, capsys):
    """--max-shard-size 20KB: several model-0000i-of-0000n.safetensors named by
    model.safetensors.index.json (total_size the tensors' bytes), as save_pretrained cuts
    them; transformers and ms.hf.load read it back with the one-file export's logits and
    weights; exporting again in one file removes the shards and the index."""
    root, ckpt = trained
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    assert cli.main(["export", "--checkpoint", str(ckpt), "--hf", str(one), "--dtype",
                     "float64"]) == 0
    assert cli.main(["export", "--checkpoint", str(ckpt), "--hf", str(sharded), "--dtype",
                     "float64", "--max-shard-size", "20KB"]) == 0
    index = json.load(open(sharded / "model.safetensors.index.json"))
    files = sorted(set(index["weight_map"].values()))
    n = len(files)
    assert n > 2 and files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    assert not (sharded / "model.safetensors").exists()
    from safetensors.numpy import load_file
    whole = load_file(one / "model.safetensors")
    assert index["metadata"]["total_size"] == sum(a.nbytes for a in whole.values())
    assert sorted(index["weight_map"]) == sorted(whole)
    for f in files:
        part = load_file(sharded / f)
        assert sum(a.nbytes for a in part.values()) <= 20_000 or len(part) == 1
        assert all(np.array_equal(part[k], whole[k]) and index["weight_map"][k] == f
                   for k in part)
    x = tokens(VOCAB, T=16)
    a, b = (transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float64).eval()
            for d in (one, sharded))
    assert np.array_equal(hf_logits(a, x), hf_logits(b, x))
    model, params = ms.hf.load(sharded)
    saved = ms.checkpoint.load(ckpt)
    assert repr(model) == repr(saved.model())
    assert all(np.array_equal(params[k], np.asarray(saved[k])) for k in saved)
    assert_close(hf_logits(b, x), np.asarray(_ours(saved, x)), what="sharded export vs ours")
    assert cli.main(["export", "--checkpoint", str(ckpt), "--hf", str(sharded)]) == 0
    left = sorted(f for f in os.listdir(sharded) if "safetensors" in f)
    assert left == ["model.safetensors"]
    capsys.readouterr()
    assert cli.main(["export", "--checkpoint", str(ckpt), "--hf", str(tmp_path / "x"),
                     "--max-shard-size", "5XB"]) == 2
    assert "--max-shard-size" in capsys.readouterr().err


def test_import_carries_the_directory_tokenizer(trained, tmp_path, capsys):
    """import --hf DIR keeps DIR's tokenizer files: generate --checkpoint prints what
    generate --hf DIR prints, and the export's AutoTokenizer is DIR's tokenizer."""
    root, _ = trained
    d, _ = gpt2(tmp_path / "src", vocab_size=VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(root / "tok" / name, d)
    ckpt, out = str(tmp_path / "ck"), str(tmp_path / "out")
    assert cli.main(["import", "--hf", d, "--checkpoint", ckpt]) == 0
    assert ms.checkpoint.load(ckpt).extra["tokenizer"]["files"] == ["tokenizer.json",
                                                                    "tokenizer_config.json"]
    capsys.readouterr()
    gen = ["--prompt", "def add(", "--max-new-tokens", "6", "--temperature", "0", "--dtype",
           "float64"]
    assert cli.main(["generate", "--hf", d, *gen]) == 0
    want = capsys.readouterr().out
    assert cli.main(["generate", "--checkpoint", ckpt, *gen]) == 0
    assert capsys.readouterr().out == want
    assert cli.main(["export", "--checkpoint", ckpt, "--hf", out]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    assert len(tok) == VOCAB and tok(TEXT)["input_ids"] == ms.hf.tokenizer(d).encode(TEXT).ids


def _ours(ckpt, x):
    engine = ms.SingleDevice(ckpt.model())
    engine.load_checkpoint(ckpt)
    return engine.predict(x)

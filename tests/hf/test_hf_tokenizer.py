"""ms.hf.tokenizer: a model directory's tokenizer.json as a tokenizers.Tokenizer (a byte-level
BPE trained here, no download), None without one, ValueError for a damaged file."""
import pytest

import mpishard as ms

tokenizers = pytest.importorskip("tokenizers")

TEXT = ["def add(a, b):\n    return a + b\n", "class Model:\n    pass\n"] * 50


def trained(directory):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(TEXT, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(directory / "tokenizer.json"))
    return tok


def test_the_directory_tokenizer_encodes_like_the_one_saved(tmp_path):
    want = trained(tmp_path)
    tok = ms.hf.tokenizer(tmp_path)
    assert isinstance(tok, tokenizers.Tokenizer) and tok.get_vocab_size() == want.get_vocab_size()
    text = "def add(model, b):\n    return model\n"
    ids = tok.encode(text).ids
    assert ids == want.encode(text).ids and len(ids) < len(text)
    assert tok.decode(ids) == text


def test_no_tokenizer_json_gives_none_and_a_damaged_one_an_error(tmp_path):
    assert ms.hf.tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read the tokenizer"):
        ms.hf.tokenizer(tmp_path)

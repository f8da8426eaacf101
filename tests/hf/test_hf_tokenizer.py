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


def test_a_completion_keeps_the_space_a_sentencepiece_tokenizer_strips_at_a_start():
    """generate's Text decodes new ids as the continuation of their prompt: a Metaspace
    tokenizer (Llama-2, Mistral) decodes "▁Paris" alone as "Paris", after the prompt as
    " Paris"; whole and the streamed decode agree."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from mpishard.cli.generate import Text

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
    tok.train_from_iterator(["The capital of France is Paris. Rome is in Italy."] * 10,
                            trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>"]))
    prompt = tok.encode("The capital of France is").ids
    new = tok.encode("The capital of France is Paris.").ids[len(prompt):]
    assert tok.decode(new) == "Paris."                  # what printing new ids alone gives
    text = Text(tok)
    assert text.whole(new, prompt) == " Paris."
    text.reset(prompt)
    streamed = "".join(text.decode(new[:i + 1]) for i in range(len(new)))
    assert streamed + text.decode(new, final=True) == " Paris."

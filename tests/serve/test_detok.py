"""serve.detok: incremental decoding equals the whole decode of the completion as it continues
its prompt, for byte-level BPE (GPT-2 style), sentencepiece-style Metaspace BPE and bytes,
with multi-byte characters split over tokens; stop strings match across pieces and are cut."""
from __future__ import annotations

import random

import pytest

from mpishard.serve.detok import Detokenizer, StopMatcher, check_stop, encode

tokenizers = pytest.importorskip("tokenizers")

CORPUS = ["the cat sat on the mat, héllo wörld", "naïve café über straße", "日本語のテキスト",
          "emoji 😀 and 🎉 party", "Paris is the capital of France.", "a b c d e f g"] * 30
TEXTS = ["the cat sat", " on the mat 😀🎉", "日本語 naïve", "Paris! über 🎉 straße", "zq 😀x",
         "ÿ€ unseen ☃ chars ∑"]


def byte_level():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def metaspace():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Sequence([
        decoders.ByteFallback(), decoders.Metaspace()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=500, special_tokens=["<unk>"] + bytes_))
    return tok


def whole(tok, prompt: list, ids: list) -> str:
    """The reference: the text of prompt + completion less the text of the prompt."""
    if tok is None:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
    head, text = tok.decode(prompt), tok.decode(prompt + ids)
    assert text.startswith(head)
    return text[len(head):]


def stream(tok, prompt: list, ids: list) -> list:
    detok = Detokenizer(tok, prompt)
    return [detok.add(i) for i in ids] + [detok.flush()]


@pytest.mark.parametrize("make", [byte_level, metaspace, lambda: None],
                         ids=["byte_level", "metaspace", "bytes"])
def test_pieces_join_to_the_whole_decode(make):
    tok = make()
    rng = random.Random(0)
    split = 0
    for a in TEXTS:
        for b in TEXTS:
            prompt, ids = encode(tok, a), encode(tok, " " + b, special=False)
            if tok is not None:     # the completion's ids as the model would sample them
                ids = tok.encode(a + " " + b).ids[len(prompt):] or ids
            pieces = stream(tok, prompt, ids)
            assert "".join(pieces) == whole(tok, prompt, ids), (a, b, pieces)
            assert not any("\ufffd" in p for p in pieces), pieces
            split += sum(p == "" for p in pieces[:-1])
        # random id runs (no text behind them) still join to the whole decode
        vocab = 256 if tok is None else tok.get_vocab_size()
        ids = [rng.randrange(vocab) for _ in range(12)]
        prompt = encode(tok, a)
        assert "".join(stream(tok, prompt, ids)) == whole(tok, prompt, ids)
    assert split > 0, "no multi-byte character was split over tokens: the test proves nothing"


def test_metaspace_keeps_the_leading_space():
    tok = metaspace()
    prompt = tok.encode("Paris is the capital of").ids
    ids = tok.encode("Paris is the capital of France.").ids[len(prompt):]
    assert tok.decode(ids) == "France."                   # alone, the space is stripped
    assert "".join(stream(tok, prompt, ids)) == " France."


def test_split_character_waits_for_its_last_byte():
    tok = byte_level()
    prompt = tok.encode("emoji").ids
    ids = tok.encode("emoji 🐙").ids[len(prompt):]         # 🐙 is not in the corpus: 4 bytes
    pieces = stream(tok, prompt, ids)
    assert len(ids) >= 3 and pieces[:-1].count("") == len(ids) - 1, pieces
    assert pieces[len(ids) - 1] == " 🐙" and "".join(pieces) == " 🐙"
    assert stream(None, [], list("é!".encode())) == ["", "é", "!", ""]
    assert "".join(stream(None, [], list("é".encode())[:1])) == "\ufffd"  # cut short


def feed_all(stops, pieces):
    matcher, out = StopMatcher(stops), []
    for p in pieces:
        text, matched = matcher.feed(p)
        out.append(text)
        if matched:
            return "".join(out), True
    return "".join(out) + matcher.flush(), False


@pytest.mark.parametrize("stops,pieces,want", [
    (["END"], ["abc E", "N", "D more"], ("abc ", True)),
    (["\n\n"], ["one\n", "\ntwo"], ("one", True)),
    (["zb", "y"], ["a", "xy", "zb"], ("ax", True)),         # the first occurrence wins
    (["xyz", "yzq"], ["axy", "z"], ("a", True)),
    (["END"], ["abc E", "N", "d"], ("abc ENd", False)),     # a held prefix that was no stop
    (["日本"], ["ok 日", "本語"], ("ok ", True)),
    (["aab"], ["a", "a", "a", "b"], ("a", True)),
    ([], ["a", "b"], ("ab", False)),
])
def test_stop_strings_across_pieces(stops, pieces, want):
    assert feed_all(stops, pieces) == want
    assert feed_all(stops, ["".join(pieces)]) == want       # the same as all at once


def test_stop_holds_back_only_a_possible_prefix():
    matcher = StopMatcher(["END"])
    assert matcher.feed("abc") == ("abc", False)
    assert matcher.feed("xE") == ("x", False)
    assert matcher.feed("Nx") == ("ENx", False)


def test_check_stop():
    assert check_stop(None) == [] and check_stop("a") == ["a"] and check_stop(["a", "b"])
    for bad in (3, ["a", 3], [""], {"a": 1}):
        with pytest.raises(ValueError):
            check_stop(bad)

"""train.chat_template without transformers: where the template is found, how jinja2 renders
it (transformers' environment), and the assistant mask on a ChatML template with the byte
tokenizer, which is exactly the bytes of the assistant turns. The same functions against
transformers itself: tests/hf/test_chat_template_hf.py."""
import json
import sys

import numpy as np
import pytest

from mpishard.train.chat_template import chat_template_for, check_messages, encode_chat, \
    find_chat_template, load_chat_template, render_chat, template_tokens
from mpishard.train.tokenizer import ByteTokenizer

pytest.importorskip("jinja2")

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CHATML_GEN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
              "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>"
              "{% endgeneration %}{{ '\\n' }}{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}"
              "{% endfor %}")
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Où est Tōkyō?"},
            {"role": "assistant", "content": "日本 🙂"},
            {"role": "user", "content": "and Paris?"},
            {"role": "assistant", "content": "France."}]


def files_of(**named) -> dict:
    """{file name: bytes}: a keyword's underscores stand for dots."""
    return {name.replace("_json", ".json").replace("_jinja", ".jinja"): (
        value if isinstance(value, bytes) else json.dumps(value).encode())
        for name, value in named.items()}


def test_the_jinja_file_comes_first_then_the_config_key_then_the_legacy_json():
    jinja = {"chat_template.jinja": b"J"}
    config = {"tokenizer_config.json": json.dumps({"chat_template": "C"}).encode()}
    legacy = {"chat_template.json": json.dumps({"chat_template": "L"}).encode()}
    assert find_chat_template({**jinja, **config, **legacy}) == "J"
    assert find_chat_template({**config, **legacy}) == "C"
    assert find_chat_template(legacy) == "L"
    assert find_chat_template({"tokenizer.json": b"{}"}) is None
    assert find_chat_template({"tokenizer_config.json": b'{"eos_token": "</s>"}'}) is None
    named = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    assert find_chat_template(files_of(tokenizer_config_json={"chat_template": named})) == "D"
    with pytest.raises(ValueError, match="none named 'default'"):
        find_chat_template(files_of(tokenizer_config_json={"chat_template": named[:1]}))
    with pytest.raises(ValueError, match="neither a string"):
        find_chat_template(files_of(tokenizer_config_json={"chat_template": 3}))


def test_an_override_file_is_its_text_or_a_json_files_key(tmp_path):
    (tmp_path / "t.jinja").write_text(CHATML, encoding="utf-8")
    assert load_chat_template(tmp_path / "t.jinja") == CHATML
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": CHATML}))
    assert load_chat_template(str(tmp_path / "t.json")) == CHATML
    (tmp_path / "none.json").write_text("{}")
    with pytest.raises(ValueError, match="no chat_template key"):
        load_chat_template(tmp_path / "none.json")
    assert chat_template_for(ByteTokenizer(), tmp_path / "t.jinja") == CHATML
    with pytest.raises(ValueError, match="no chat template.*--chat-template FILE"):
        chat_template_for(ByteTokenizer())


def test_special_tokens_are_read_as_transformers_reads_them():
    config = {"bos_token": "<s>", "eos_token": {"content": "</s>", "lstrip": False},
              "pad_token": None, "image_token": "<img>", "extra_special_tokens": {"x_token": "<x>"}}
    legacy = {"bos_token": "<B>", "unk_token": "<unk>"}
    both = files_of(tokenizer_config_json=config, special_tokens_map_json=legacy)
    # without added_tokens_decoder the legacy special_tokens_map.json overrides the config
    assert template_tokens(both) == {"bos_token": "<B>", "eos_token": "</s>", "unk_token": "<unk>",
                                     "image_token": "<img>", "x_token": "<x>"}
    modern = files_of(tokenizer_config_json=dict(config, added_tokens_decoder={}),
                      special_tokens_map_json=legacy)
    assert template_tokens(modern) == {"bos_token": "<s>", "eos_token": "</s>",
                                       "image_token": "<img>", "x_token": "<x>"}
    assert template_tokens({}) == {}


def test_rendering_is_transformers_environment():
    messages = [{"role": "user", "content": "café <b>"}, {"role": "assistant", "content": "ok"}]
    blocks = ("{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.content }}|\n"
              "    {% endif %}\n{% endfor %}")
    assert render_chat(blocks, messages) == "café <b>|\n"            # trim and lstrip blocks
    assert render_chat("{{ messages[0] | tojson }}", messages) == \
        '{"role": "user", "content": "café <b>"}'                     # no ASCII or HTML escapes
    assert render_chat("{{ messages[0] | tojson(indent=1) }}", messages[:1]).count("\n") == 3
    loop = ("{% for m in messages %}{% if loop.index0 == 1 %}{% break %}{% endif %}{{ m.role }}"
            "{% endfor %}")
    assert render_chat(loop, messages) == "user"                     # loopcontrols
    ns = ("{% set n = namespace(k=0) %}{% for m in messages %}{% set n.k = n.k + 1 %}"
          "{% endfor %}{{ n.k }}")
    assert render_chat(ns, messages) == "2"
    assert render_chat("{{ bos_token }}{% if add_generation_prompt %}>{% endif %}", messages,
                       True, {"bos_token": "<s>"}) == "<s>>"
    assert render_chat("{{ dict(a=1)['a'] }}{{ strftime_now('%Y')|length }}", messages) == "14"
    assert render_chat("{{ messages[0].name is defined }}",
                       [{"role": "user", "content": "x", "name": None}]) == "False"


@pytest.mark.parametrize("template,message", [
    ("{{ raise_exception('System role not supported') }}", "System role not supported"),
    ("{{ messages.__class__.__mro__ }}", "unsafe"),
    ("{% set n = namespace(_x=1) %}", "underscore"),
    ("{% for m in messages %}", "endfor"),
    ("{{ nothing.here }}", "undefined"),
])
def test_a_template_that_fails_is_a_value_error_with_its_message(template, message):
    with pytest.raises(ValueError, match=message):
        render_chat(template, MESSAGES)


@pytest.mark.parametrize("messages,message", [
    ([], "non-empty list"), ("hello", "got str"), ([["user", "hi"]], "message 0 is a list"),
    ([{"role": "user"}], "'content' must be a string \\(missing\\)"),
    ([{"role": "user", "content": "a"}, {"role": 1, "content": "b"}], "message 1: 'role'"),
    ([{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "\\(list\\)"),
])
def test_messages_must_be_role_and_content_strings(messages, message):
    with pytest.raises(ValueError, match=message):
        check_messages(messages)
    with pytest.raises(ValueError, match=message):
        encode_chat(ByteTokenizer(), CHATML, messages)


def expected_chatml(messages):
    """(bytes, mask) of the ChatML conversation built by hand: 1 on each assistant turn's
    content and its "<|im_end|>\\n"."""
    text, mask = b"", []
    for m in messages:
        head = f"<|im_start|>{m['role']}\n".encode()
        turn = f"{m['content']}<|im_end|>\n".encode()
        text += head + turn
        mask += [0] * len(head) + [int(m["role"] == "assistant")] * len(turn)
    return text, np.array(mask, np.uint8)


@pytest.mark.parametrize("n", [2, 3, 5])
def test_the_byte_mask_is_exactly_the_assistant_turns(n):
    text, want = expected_chatml(MESSAGES[:n])
    ids, mask = encode_chat(ByteTokenizer(), CHATML, MESSAGES[:n])
    assert ids.dtype == np.int64 and mask.dtype == np.uint8
    assert bytes(ids.astype(np.uint8)) == text
    np.testing.assert_array_equal(mask, want)
    print(n, "messages:", len(ids), "bytes,", int(mask.sum()), "counted")
    assert mask.sum() == sum(len(f"{m['content']}<|im_end|>\n".encode())
                             for m in MESSAGES[:n] if m["role"] == "assistant")


def test_generation_blocks_mark_what_they_enclose():
    ids, mask = encode_chat(ByteTokenizer(), CHATML_GEN, MESSAGES)
    text, _ = expected_chatml(MESSAGES)
    assert bytes(ids.astype(np.uint8)) == text
    assert bytes(ids[mask == 1].astype(np.uint8)).decode() == "日本 🙂<|im_end|>France.<|im_end|>"


def test_a_template_whose_turns_do_not_nest_is_refused():
    """A template that drops earlier answers (as reasoning templates drop earlier thoughts)."""
    drops = ("{% for m in messages %}{{ m.role }}: {% if m.role == 'assistant' and not loop.last"
             " %}...{% else %}{{ m.content }}{% endif %}{{ '\\n' }}{% endfor %}"
             "{% if add_generation_prompt %}assistant: {% endif %}")
    ids, mask = encode_chat(ByteTokenizer(), drops, MESSAGES[:3])    # one answer, the last
    assert bytes(ids[mask == 1].astype(np.uint8)).decode() == "日本 🙂\n"
    with pytest.raises(ValueError, match="message 2 .assistant. differently.*generation"):
        encode_chat(ByteTokenizer(), drops, MESSAGES)
    with pytest.raises(ValueError, match="no chat template.*--chat-template"):
        encode_chat(ByteTokenizer(), None, MESSAGES)


def test_without_jinja2_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ImportError, match=r"pip install 'mpishard\[sft\]'"):
        render_chat(CHATML + " ", MESSAGES)

"""train.chat_template against transformers: the ids of encode_chat equal
`apply_chat_template(tokenize=True)`, its assistant mask equals `return_assistant_tokens_mask`
on templates with {% generation %} blocks (and the nested-prefix mask of the same template
without them marks the same tokens), and the template found among a directory's files is
the one `AutoTokenizer.from_pretrained` loads. The tokenizer is a byte-level BPE trained here
with the chat special tokens, saved by transformers (no download)."""
import json

import numpy as np
import pytest

from mpishard.train.chat_template import encode_chat, find_chat_template, render_chat, \
    template_tokens
from mpishard.train.tokenizer import HFTokenizer, read_tokenizer_files

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
CORPUS = ["You are a helpful assistant. What is the capital of France? Paris is the capital.",
          "def add(a, b):\n    return a + b\n", "naïve café, 日本語のテキスト, emoji 🙂 ok",
          "The user asks and the assistant answers in a short sentence.\n\n"] * 30

# Meta-Llama-3-8B-Instruct's template, verbatim
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# the same rendering, the assistant turns inside {% generation %}
LLAMA3_GEN = ("{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + "
              "message['role'] + '<|end_header_id|>\n\n' }}{% if message['role'] == 'assistant' "
              "%}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
              "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
              "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n'"
              " }}{% endif %}")
# Qwen2-7B-Instruct's template, verbatim (a default system message when there is none)
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
QWEN2_GEN = ("{%- if messages[0]['role'] != 'system' %}{{- '<|im_start|>system\nYou are a helpful "
             "assistant.<|im_end|>\n' }}{%- endif %}\n{%- for message in messages %}\n"
             "    {{- '<|im_start|>' + message.role + '\n' }}\n"
             "    {%- if message.role == 'assistant' %}\n"
             "      {%- generation %}{{- message.content + '<|im_end|>\n' }}{%- endgeneration %}\n"
             "    {%- else %}\n        {{- message.content + '<|im_end|>\n' }}\n    {%- endif %}\n"
             "{%- endfor %}\n{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}"
             "{%- endif %}\n")
# Qwen2.5-Instruct's template without its tool-call branches ({%- and tojson, namespace)
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}{%- endif %}
    {%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
    {{- '<|im_end|>\\n' }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. '
            + 'You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(turns=0) %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first)
           or (message.role == "assistant") %}
        {%- set ns.turns = ns.turns + 1 %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"},
     {"role": "assistant", "content": "Paris is the capital."}],
    [{"role": "system", "content": "You answer in one word."},
     {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris"},
     {"role": "user", "content": "And of Japan? 日本"},
     {"role": "assistant", "content": "東京 (Tokyo) 🙂 "}],
    [{"role": "user", "content": "  naïve café  "},
     {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
     {"role": "user", "content": "thanks"}],
]


def saved(directory, template, bos_in_post_processor=False):
    """A byte-level BPE with the chat special tokens, saved by transformers with `template`;
    (the transformers tokenizer loaded back, our HFTokenizer of the same directory)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos_in_post_processor:   # as Llama 3's tokenizer.json: encode() puts a BOS first
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)])
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    fast.chat_template = template
    fast.save_pretrained(directory)
    files = read_tokenizer_files(directory)
    ours = HFTokenizer(tokenizers.Tokenizer.from_file(str(directory / "tokenizer.json")),
                       "test", files=files)
    return transformers.AutoTokenizer.from_pretrained(directory), ours


def reference(tok, messages, mask=False):
    out = tok.apply_chat_template(messages, tokenize=True, return_assistant_tokens_mask=mask)
    ids = np.asarray(out["input_ids"], np.int64)
    return (ids, np.asarray(out["assistant_masks"], np.uint8)) if mask else ids


@pytest.mark.parametrize("template,bos_pp", [(LLAMA3, True), (LLAMA3_GEN, False),
                                             (QWEN2, False), (QWEN2_GEN, False), (QWEN25, False)],
                         ids=["llama3", "llama3-generation", "qwen2", "qwen2-generation",
                              "qwen2.5"])
def test_ids_equal_apply_chat_template(tmp_path, template, bos_pp):
    tok, ours = saved(tmp_path, template, bos_in_post_processor=bos_pp)
    found = find_chat_template(ours.files)
    assert found == tok.chat_template == template
    special = template_tokens(ours.files)
    for messages in CONVERSATIONS:
        text = tok.apply_chat_template(messages, tokenize=False)
        assert render_chat(found, messages, special_tokens=special) == text
        assert render_chat(found, messages, True, special) == \
            tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids, mask = encode_chat(ours, found, messages)
        want = reference(tok, messages)
        print(template[:20], len(ids), "tokens", int(mask.sum()), "counted")
        assert ids.dtype == np.int64 and mask.dtype == np.uint8 and len(mask) == len(ids)
        np.testing.assert_array_equal(ids, want)
        bos = tok.convert_tokens_to_ids("<|begin_of_text|>")
        assert (ids == bos).sum() == (ids[0] == bos) == (template in (LLAMA3, LLAMA3_GEN))
        assert 0 < mask.sum() < len(mask)


@pytest.mark.parametrize("plain,marked", [(LLAMA3, LLAMA3_GEN), (QWEN2, QWEN2_GEN)],
                         ids=["llama3", "qwen2"])
def test_masks_equal_return_assistant_tokens_mask(tmp_path, plain, marked):
    """A {% generation %} template's mask is transformers'; the same template without the
    blocks gives the same mask by nested prefixes."""
    tok, ours = saved(tmp_path, marked)
    for messages in CONVERSATIONS:
        want_ids, want_mask = reference(tok, messages, mask=True)
        assert want_mask.sum() > 0
        for template in (marked, plain):
            ids, mask = encode_chat(ours, template, messages)
            np.testing.assert_array_equal(ids, want_ids)
            np.testing.assert_array_equal(mask, want_mask)
        counted = tok.decode(want_ids[want_mask == 1].tolist())
        for m in messages:
            assert (m["content"].strip() in counted) == (m["role"] == "assistant")


def test_the_template_found_is_the_one_transformers_loads(tmp_path):
    """chat_template.jinja first, else tokenizer_config.json's key (a string, or a list of
    named templates whose "default" is used), as AutoTokenizer.from_pretrained reads them."""
    saved(tmp_path, QWEN2)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    assert "chat_template" not in config

    def check():
        loaded = transformers.AutoTokenizer.from_pretrained(tmp_path).chat_template
        loaded = loaded["default"] if isinstance(loaded, dict) else loaded
        assert find_chat_template(read_tokenizer_files(tmp_path)) == loaded
        return loaded

    assert check() == QWEN2                                     # the .jinja file
    config_path.write_text(json.dumps(dict(config, chat_template=LLAMA3)))
    assert check() == QWEN2                                     # the file beats the key
    (tmp_path / "chat_template.jinja").unlink()
    assert check() == LLAMA3                                    # the key
    config_path.write_text(json.dumps(dict(config, chat_template=[
        {"name": "tool_use", "template": QWEN2}, {"name": "default", "template": LLAMA3}])))
    assert check() == LLAMA3                                    # the list's default

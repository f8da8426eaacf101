"""A --chat-template travels with the model: `tokenize --chat-template FILE` (or `train
--dataset jsonl:... --chat-template FILE`), a training step, `export`, and transformers'
AutoTokenizer of the export has that template, not the one the model directory came with
(its tokenizer was saved with ChatML; the override is Llama 3's), and renders the same ids.

    pytest -q tests/hf/test_chat_template_carried.py
"""
import json

import pytest

from mpishard import cli
from test_chat_template_hf import LLAMA3
from test_sft_end_to_end import conversations, llama_with_chat_tokenizer

transformers = pytest.importorskip("transformers")
RUN = ["--seq-len", "64", "--batch", "4", "--steps", "1", "--no-progress", "--log-level",
       "WARNING", "--layout", "dp=1"]


def exported_template(tmp_path, name, train_data):
    ckpt, export = tmp_path / f"{name}-ckpt", tmp_path / f"{name}-hf"
    assert cli.main(["train", "--init-from-hf", str(tmp_path / "llama"), *train_data, *RUN,
                     "--checkpoint-dir", str(ckpt)]) == 0
    assert cli.main(["export", "--checkpoint", str(ckpt), "--hf", str(export)]) == 0
    return transformers.AutoTokenizer.from_pretrained(export)


def test_the_chat_template_flag_reaches_the_export(tmp_path):
    model_dir = llama_with_chat_tokenizer(tmp_path / "llama")
    assert transformers.AutoTokenizer.from_pretrained(model_dir).chat_template != LLAMA3
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations(40)))
    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3)
    tokens = tmp_path / "chat-tok"
    assert cli.main(["tokenize", "--tokenizer", model_dir, "--dataset", f"jsonl:{chat}",
                     "--chat-template", str(template), "--out", str(tokens)]) == 0
    messages = conversations(1, seed=1)[0]["messages"]
    expected = transformers.AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        messages, chat_template=LLAMA3, tokenize=True)
    for name, data in (("tokens", ["--dataset", f"tokens:{tokens}"]),
                       ("memory", ["--dataset", f"jsonl:{chat}", "--chat-template",
                                   str(template)])):
        tok = exported_template(tmp_path, name, data)
        assert tok.chat_template == LLAMA3, name
        assert tok.apply_chat_template(messages, tokenize=True) == expected

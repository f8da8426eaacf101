"""`generate --chat MESSAGE`: the prompt is the one-turn user conversation rendered with the
tokenizer's chat template and its generation prompt, its ids equal to `transformers`'
apply_chat_template(add_generation_prompt=True) for ChatML, Qwen2 (a default system turn) and
Llama 3 (a bos_token in the template and a tokenizer that adds a BOS itself: encoded without
special tokens, so one BOS); `--chat-template FILE` stands in for a tokenizer without one
(tests/cli/test_generate_prompts.py: bytes, which have no template, are refused).

    pytest -q tests/hf/test_generate_chat.py
"""
import json

import pytest
from mpi4py import MPI

from mpishard import cli
from mpishard.cli import build_parser
from mpishard.cli.generate import prepare_generator
from mpishard.cli.usage import UsageError

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("jinja2")

from test_chat_template_hf import LLAMA3, QWEN2, saved             # noqa: E402
from test_sft_end_to_end import CHATML                             # noqa: E402

MESSAGES = ["What is the capital of France?", "naïve café 🙂"]
TEMPLATES = {"chatml": (CHATML, False), "qwen2": (QWEN2, False), "llama3": (LLAMA3, True)}


def model_dir(directory, template, bos=False):
    """A tokenizer saved with `template` (None: none) and a tiny Llama of its vocabulary."""
    fast, _ = saved(directory, template, bos_in_post_processor=bos)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(directory)
    return fast


def prompt_ids(directory, *argv):
    args = build_parser().parse_args(["generate", "--hf", str(directory), *argv])
    return prepare_generator(args, MPI.COMM_SELF)[2]


def transformers_ids(fast, message, template=None):
    ids = fast.apply_chat_template([{"role": "user", "content": message}], chat_template=template,
                                   add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.mark.parametrize("kind", sorted(TEMPLATES))
def test_chat_prompts_equal_apply_chat_template(tmp_path, kind):
    template, bos = TEMPLATES[kind]
    fast = model_dir(tmp_path, template, bos)
    (tmp_path / "lines.txt").write_text("The user asks\nand the assistant answers\n")
    got = prompt_ids(tmp_path, "--prompts", str(tmp_path / "lines.txt"), "--chat",
                     MESSAGES[0], "--prompt", "Hello", "--chat", MESSAGES[1])
    want = [fast("Hello")["input_ids"], *(transformers_ids(fast, m) for m in MESSAGES),
            fast("The user asks")["input_ids"], fast("and the assistant answers")["input_ids"]]
    assert got == want                                  # --prompt, --chat, then --prompts
    if bos:
        assert [ids.count(fast.bos_token_id) for ids in got[1:3]] == [1, 1]


def test_chat_template_file_stands_in_for_a_tokenizer_without_one(tmp_path):
    fast = model_dir(tmp_path, None)
    with pytest.raises(UsageError, match="--chat: .* has no chat template.*--chat-template"):
        prompt_ids(tmp_path, "--chat", MESSAGES[0])
    (tmp_path / "t.jinja").write_text(QWEN2)
    (tmp_path / "t.json").write_text(json.dumps({"chat_template": QWEN2}))
    want = [transformers_ids(fast, MESSAGES[0], QWEN2)]
    for name in ("t.jinja", "t.json"):
        assert prompt_ids(tmp_path, "--chat", MESSAGES[0], "--chat-template",
                          str(tmp_path / name)) == want


def test_generate_chat_prints_and_continues_the_rendered_prompt(tmp_path, capfd):
    """generate --chat streams the rendered prompt and its completion, with the ids that
    --prompt-file of the same rendered text gives (ChatML's tokenizer adds no special token)."""
    fast = model_dir(tmp_path, CHATML)
    rendered = fast.apply_chat_template([{"role": "user", "content": MESSAGES[0]}],
                                        add_generation_prompt=True, tokenize=False)
    (tmp_path / "prompt.txt").write_text(rendered)
    ids = []
    for flag in (["--chat", MESSAGES[0]], ["--prompt-file", str(tmp_path / "prompt.txt")]):
        capfd.readouterr()
        out = tmp_path / "ids.json"
        assert cli.main(["generate", "--hf", str(tmp_path), *flag, "--temperature", "0",
                         "--max-new-tokens", "3", "--metrics-json", str(out)]) == 0
        assert capfd.readouterr().out.startswith(rendered)
        ids.append(json.loads(out.read_text())["ids"])
    assert ids[0] == ids[1] and len(ids[0][0]) >= 1

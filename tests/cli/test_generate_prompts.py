"""`generate --prompt-file FILE`: the file's whole content, byte for byte, is one prompt, so a
chat prompt keeps the newline after the assistant's header that `--prompt "$(cat FILE)"`
loses to the shell.

    pytest -q tests/cli/test_generate_prompts.py
"""
import json

import pytest
from mpi4py import MPI

from mpishard import cli
from mpishard.cli import build_parser
from mpishard.cli.generate import prepare_generator, read_prompts
from mpishard.cli.usage import UsageError

GPT = ["--model", "gpt:d_model=32,n_heads=2,n_layers=1,seq_len=16,tied=1", "--corpus-bytes",
       "20000", "--batch", "4", "--no-progress", "--log-every", "0"]
CHAT = "<|im_start|>user\r\nhi<|im_end|>\n<|im_start|>assistant\n\n"   # CR and last newlines


def parsed(*argv):
    return build_parser().parse_args(["generate", "--checkpoint", "ckpt", *argv])


def test_a_prompt_file_is_one_prompt_byte_for_byte(tmp_path):
    chat, other, lines = tmp_path / "chat.txt", tmp_path / "other.txt", tmp_path / "lines.txt"
    chat.write_bytes(CHAT.encode())
    other.write_bytes("café\n".encode())
    lines.write_text("one\n\ntwo\n")
    assert read_prompts(parsed("--prompt-file", str(chat))) == [CHAT]
    got = read_prompts(parsed("--prompts", str(lines), "--prompt-file", str(chat), "--prompt",
                              "p", "--prompt-file", str(other)))
    assert got == ["p", CHAT, "café\n", "one", "two"]   # --prompt, files in order, then lines


@pytest.mark.parametrize("content, message", [
    (None, "--prompt-file {}: [Errno 2] No such file"),
    (b"", "--prompt-file {} is empty"),
    (b"\xff\xfe", "--prompt-file {}: 'utf-8' codec can't decode"),
])
def test_a_prompt_file_that_does_not_read_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "prompt.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(UsageError) as err:
        read_prompts(parsed("--prompt-file", str(path)))
    assert str(err.value).startswith(message.format(path))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A GPT trained one step on bytes (vocabulary 256)."""
    ckpt = tmp_path_factory.mktemp("gen") / "ckpt"
    assert cli.main(["train", *GPT, "--steps", "1", "--checkpoint-dir", str(ckpt)]) == 0
    return ckpt


def test_generate_continues_the_files_whole_content(tmp_path, checkpoint, capfd):
    """The prompt ids are the file's bytes, the trailing newline included, and generate
    continues them exactly as `--prompt` given the same text does (a shell's $(cat) would
    not: it strips the newline, and the ids differ)."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_bytes(b"def f(x):\n")
    args = parsed("--prompt-file", str(prompt))
    args.checkpoint = str(checkpoint)
    prompts = prepare_generator(args, MPI.COMM_SELF)[2]
    assert prompts == [list(b"def f(x):\n")]
    ids = {}
    for name, flag in (("file", ["--prompt-file", str(prompt)]), ("text", ["--prompt",
                                                                             "def f(x):\n"])):
        out = tmp_path / f"{name}.json"
        capfd.readouterr()
        assert cli.main(["generate", "--checkpoint", str(checkpoint), *flag, "--temperature",
                         "0", "--max-new-tokens", "4", "--metrics-json", str(out)]) == 0
        assert capfd.readouterr().out.startswith("def f(x):\n")
        ids[name] = json.loads(out.read_text())["ids"]
    assert ids["file"] == ids["text"] and len(ids["file"][0]) == 4


def test_chat_on_bytes_is_refused(checkpoint):
    """--chat renders a chat template: bytes have none."""
    args = parsed("--chat", "hi")
    args.checkpoint = str(checkpoint)
    with pytest.raises(UsageError, match="--chat needs a tokenizer with a chat template"):
        prepare_generator(args, MPI.COMM_SELF)

"""A fine-tune's export, served with its chat template: docs/fine-tuning.md's walk from a JSONL
file to a served model, small. A random-init `transformers` Llama with a ChatML tokenizer
(tests/hf/test_sft_end_to_end.py's: the template in tokenizer_config.json, no download), a
generated JSONL of 60 conversations, `tokenize`, `train --init-from-hf DIR --dataset tokens:OUT
--pack` for 3 steps on tp=2, `export`, then `serve --hf EXPORT --layout tp=2` and one chat
completion through the official openai client.

Checks: the reply comes; the prompt the server encoded (vLLM's return_token_ids) is
`apply_chat_template(add_generation_prompt=True)` of the export's tokenizer, which carries the
template, and usage.prompt_tokens counts it; the greedy reply's ids are `generate --hf EXPORT
--chat MESSAGE`'s (float64 on both, so the layouts' round-off cannot flip an argmax).

Serial: the test starts its own jobs, one at a time, on at most 2 ranks.

    pytest -q tests/serve/test_serve_fine_tune.py
"""
import importlib
import json
import sys
from importlib.util import find_spec
from pathlib import Path

import pytest

from conftest import ROOT, run_mpi, run_python
from serve_job import ServeJob

NEEDS = ("torch", "transformers", "tokenizers", "datasets", "jinja2", "uvicorn", "openai")
# checked without importing: the MPI runs of tests/serve (-m mpi) collect this module on
# every rank, and torch with transformers would cost each of them seconds
pytestmark = pytest.mark.skipif(any(find_spec(m) is None for m in NEEDS),
                                reason=f"needs {', '.join(NEEDS)}")
HF_TESTS = str(Path(__file__).resolve().parents[1] / "hf")     # the SFT test's helpers
JOB_TIMEOUT_S = 180
MESSAGES = [{"role": "user", "content": "reverse: red cat dog"}]
NEW_TOKENS = 8


def sft_helpers():
    """tests/hf/test_sft_end_to_end.py, imported from its directory."""
    if HF_TESTS not in sys.path:
        sys.path.append(HF_TESTS)
    return importlib.import_module("test_sft_end_to_end")


def fine_tuned_export(tmp_path) -> Path:
    """tokenize, train 3 packed steps on tp=2 and export: the exported directory."""
    sft = sft_helpers()
    check_ok, conversations = sft.check_ok, sft.conversations
    model_dir = sft.llama_with_chat_tokenizer(tmp_path / "llama")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations(60)))
    tokens, ckpt, export = tmp_path / "chat-tok", tmp_path / "ckpt", tmp_path / "llama-sft"
    check_ok(run_python(["-m", "mpishard", "tokenize", "--tokenizer", model_dir, "--dataset",
                         f"jsonl:{chat}", "--out", tokens], cwd=ROOT, capture_output=True,
                        text=True, timeout=JOB_TIMEOUT_S), "tokenize")
    check_ok(run_mpi(2, "-m", "mpishard", "train", "--init-from-hf", model_dir, "--dataset",
                     f"tokens:{tokens}", "--pack", "--seq-len", sft.SEQ, "--layout", "tp=2",
                     "--batch", 4, "--steps", 3, "--lr", "3e-3", "--warmup", 1,
                     "--no-progress", "--seed", 0, "--checkpoint-dir", ckpt,
                     timeout=JOB_TIMEOUT_S), "train")
    check_ok(run_python(["-m", "mpishard", "export", "--checkpoint", ckpt, "--hf", export],
                        cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S),
             "export")
    return export


def test_a_fine_tunes_export_is_served_with_its_chat_template(tmp_path):
    import openai
    import transformers

    sft = sft_helpers()
    export = fine_tuned_export(tmp_path)
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    assert tokenizer.chat_template == sft.CHATML              # the export carries the template
    rendered = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                             tokenize=True)
    want_prompt = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)

    metrics = tmp_path / "generate.json"
    proc = run_mpi(1, "-m", "mpishard", "generate", "--hf", export, "--chat",
                   MESSAGES[0]["content"], "--max-new-tokens", NEW_TOKENS, "--temperature", 0,
                   "--dtype", "float64", "--metrics-json", metrics, timeout=JOB_TIMEOUT_S)
    sft.check_ok(proc, "generate")
    [want_ids] = json.loads(metrics.read_text())["ids"]

    job = ServeJob(2, ["--hf", export, "--layout", "tp=2", "--dtype", "float64",
                       "--max-batch", "2"], timeout=JOB_TIMEOUT_S)
    try:
        client = openai.OpenAI(base_url=f"{job.url}/v1", api_key="unused", max_retries=0,
                               timeout=60)
        reply = client.chat.completions.create(
            model="llama-sft", messages=MESSAGES, max_tokens=NEW_TOKENS, temperature=0,
            extra_body={"return_token_ids": True})
    finally:
        rc, out = job.stop()
    assert rc == 0 and not job.left, (rc, job.left, out[-3000:])
    choice = reply.choices[0]
    extra = choice.model_extra or {}
    print(f"prompt {want_prompt}\nreply {choice.message.content!r} {extra.get('token_ids')} "
          f"({choice.finish_reason}); generate --chat: {want_ids} {proc.stdout!r}")
    assert choice.message.role == "assistant" and choice.finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens == len(extra["token_ids"]) >= 1
    assert extra["prompt_token_ids"] == want_prompt          # rendered as transformers does
    assert reply.usage.prompt_tokens == len(want_prompt)
    assert extra["token_ids"] == want_ids                    # the reply generate --chat gives

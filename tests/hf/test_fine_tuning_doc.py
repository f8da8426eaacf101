"""docs/fine-tuning.md's Python block runs as written: beside a `./llama` (a random-init
`transformers` LlamaForCausalLM with a ChatML tokenizer, no download) and a `chat.jsonl` of 300
generated conversations, on 2 ranks, it reads the records, packs them, fine-tunes and prints
the final training and validation losses once.

    pytest -q tests/hf/test_fine_tuning_doc.py
"""
import json
import math
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, mpiexec_cmd

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")
pytest.importorskip("jinja2")

from test_chat_template_hf import saved                          # noqa: E402
from test_sft_end_to_end import CHATML, conversations            # noqa: E402

PAGE = ROOT / "docs" / "fine-tuning.md"
SHOWN = re.compile(r"^loss (\S+), validation (\S+)$")


def llama_beside(directory):
    """./llama in `directory`: the ChatML tokenizer and a tiny Llama of 512 positions (the
    block's rows hold 128 tokens)."""
    fast, _ = saved(directory / "llama", CHATML)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(directory / "llama")


def test_the_python_block_runs_as_written(tmp_path):
    blocks = re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.MULTILINE | re.DOTALL)
    assert len(blocks) == 1
    llama_beside(tmp_path)
    with open(tmp_path / "chat.jsonl", "w") as f:
        f.writelines(json.dumps(c) + "\n" for c in conversations(300))
    (tmp_path / "finetune.py").write_text(blocks[0])
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([*mpiexec_cmd(2), sys.executable, "-m", "mpi4py", "finetune.py"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    print(proc.stdout, proc.stderr[-3000:])
    assert proc.returncode == 0
    shown = [m.groups() for m in map(SHOWN.match, proc.stdout.splitlines()) if m]
    assert len(shown) == 1 and all(math.isfinite(float(v)) for v in shown[0]), proc.stdout

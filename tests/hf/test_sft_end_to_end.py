"""A supervised fine-tune on chat data, end to end (a serial test that starts its own jobs):
a random-init `transformers` LlamaForCausalLM with a ChatML tokenizer (test_chat_template_hf's
byte-level BPE, its chat template in tokenizer_config.json; no download), a generated JSONL of
300 conversations in which the assistant says the user's words backwards, `mpishard
tokenize`, then `train --init-from-hf DIR --dataset tokens:OUT --pack` under dp=2,tp=2 on 4
ranks, `export`, and `generate --hf` on the export.

Checks: step 0's loss is transformers' loss on the same batch, computed one example at a time
(each packed example alone, from position 0) over the assistant tokens only, so packing,
positions, attention inside each example and the answer-only mean hold through the whole
pipeline; `--dataset jsonl:` encoded in memory with the --init-from-hf directory's tokenizer
gives the same batch as the token directory; the loss on the assistant tokens falls clearly
(training and validation); the export loads in transformers, and generate on it runs.

    pytest -q -s tests/hf/test_sft_end_to_end.py
"""
import json

import numpy as np
import pytest

from conftest import ROOT, run_mpi, run_python
from mpishard.cli.train import parse_train_args, prepare_training
from mpishard.train.data import DistributedBatcher
from test_chat_template_hf import saved

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")
pytest.importorskip("datasets")
pytest.importorskip("jinja2")

WORDS = "red green blue cat dog sun moon tree".split()
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + "
          "message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt "
          "%}{{ '<|im_start|>assistant\n' }}{% endif %}")
LAYOUT, RANKS = "dp=2,tp=2", 4
SEQ, BATCH, STEPS = 64, 8, 40
JOB_TIMEOUT_S = 300
# float32 against float32: transformers and the engine each round to float32 (2 small layers,
# 64-wide dot products, a vocabulary of about 100), in different orders (tp splits heads,
# MLP and vocabulary); measured 2e-7 relative. A wrong mask or a target across two examples
# moves the loss by far more; attention leaking into the row's earlier examples, with
# positions running on, by 5e-4 (the random-init model attends almost uniformly).
RTOL_F32 = 1e-5


def conversations(n=300, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        words = list(rng.choice(WORDS, rng.integers(2, 5)))
        out.append({"messages": [{"role": "user", "content": "reverse: " + " ".join(words)},
                                 {"role": "assistant", "content": " ".join(words[::-1])}]})
    return out


def llama_with_chat_tokenizer(directory):
    """test_chat_template_hf's byte-level BPE with the chat special tokens, saved by
    transformers with the ChatML template, and a random-init float32 LlamaForCausalLM of its
    vocabulary beside it."""
    fast, _ = saved(directory, CHATML)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        rope_theta=10000.0, eos_token_id=fast.eos_token_id, tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).float().save_pretrained(directory)
    return str(directory)


class FourRanks:
    def Get_size(self):
        return RANKS


def first_batch(argv):
    """Step 0's global batch as the trainer draws it: (x, t, documents)."""
    args = parse_train_args(argv)
    data = prepare_training(args, FourRanks())[-1]
    rows = DistributedBatcher(data.x_train, data.t_train, args.batch,
                              seed=args.seed).global_indices(0, 0)
    return (np.asarray(data.x_train[rows]), np.asarray(data.t_train[rows]),
            np.asarray(data.d_train[rows]))


def transformers_loss(model_dir, x, t, documents):
    """The mean cross-entropy over the counted targets, each packed example (each document
    id of a row) run alone."""
    model = transformers.LlamaForCausalLM.from_pretrained(model_dir).float().eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for row, labels, ids in zip(x, t, documents):
            for doc in np.unique(ids[ids >= 0]):
                keep = ids == doc
                logits = model(torch.as_tensor(row[keep][None])).logits[0]
                target = torch.as_tensor(labels[keep])
                total += float(torch.nn.functional.cross_entropy(
                    logits.double(), target, ignore_index=-100, reduction="sum"))
                count += int((target != -100).sum())
    return total / count


def check_ok(proc, what):
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n" \
                                 f"{proc.stderr[-5000:]}"


def test_chat_fine_tune_packed_export_and_generate(tmp_path):
    model_dir = llama_with_chat_tokenizer(tmp_path / "llama")
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(c) + "\n" for c in conversations()))
    tokens = tmp_path / "chat-tok"
    proc = run_python(["-m", "mpishard", "tokenize", "--tokenizer", model_dir, "--dataset",
                       f"jsonl:{chat}", "--out", tokens, "--val-fraction", "0.1"],
                      cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT_S)
    check_ok(proc, "tokenize")

    argv = ["--init-from-hf", model_dir, "--dataset", f"tokens:{tokens}", "--pack",
            "--seq-len", str(SEQ), "--layout", LAYOUT, "--batch", str(BATCH), "--steps",
            str(STEPS), "--lr", "3e-3", "--warmup", "5", "--eval-every", "20", "--log-every",
            "10", "--no-progress", "--seed", "0", "--timeout", "180",
            "--checkpoint-dir", str(tmp_path / "ckpt"),
            "--metrics-json", str(tmp_path / "train.json")]
    x, t, documents = first_batch(argv)
    assert x.shape == (BATCH, SEQ) and (documents > 0).any()    # several examples per row
    at = argv.index("--dataset") + 1                  # the records encoded in memory instead:
    in_memory = argv[:at] + [f"jsonl:{chat}", "--val-fraction", "0.1"] + argv[at + 1:]
    for got, want in zip(first_batch(in_memory), (x, t, documents)):   # the same batch
        np.testing.assert_array_equal(got, want)
    proc = run_mpi(RANKS, "-m", "mpishard", "train", *argv, timeout=JOB_TIMEOUT_S)
    check_ok(proc, "train")
    assert "% real tokens" in proc.stderr and "counted targets" in proc.stderr
    metrics = json.loads((tmp_path / "train.json").read_text())
    losses = metrics["loss_history"]
    want = transformers_loss(model_dir, x, t, documents)
    print(f"step 0: loss {losses[0]:.7g} (transformers, example by example: {want:.7g}); "
          f"last steps {losses[-5:]}; evaluations {metrics['eval_history']}")
    assert losses[0] == pytest.approx(want, rel=RTOL_F32)
    unpacked = transformers_loss(model_dir, x, t, np.where(documents >= 0, 0, -1))
    assert abs(unpacked / want - 1) > 10 * RTOL_F32     # the rows' examples do not mix
    assert np.mean(losses[-5:]) < 0.5 * losses[0]                  # the answers are learnt
    first_eval = metrics["eval_history"][0]["test_loss"]
    assert metrics["test_loss"] < first_eval < losses[0]

    export = tmp_path / "export"
    proc = run_python(["-m", "mpishard", "export", "--checkpoint", tmp_path / "ckpt", "--hf",
                       export], cwd=ROOT, capture_output=True, text=True,
                      timeout=JOB_TIMEOUT_S)
    check_ok(proc, "export")
    transformers.AutoModelForCausalLM.from_pretrained(str(export))
    prompt = "<|im_start|>user\nreverse: red cat dog<|im_end|>\n<|im_start|>assistant\n"
    proc = run_mpi(1, "-m", "mpishard", "generate", "--hf", export, "--prompt", prompt,
                   "--max-new-tokens", "8", "--temperature", "0", timeout=JOB_TIMEOUT_S)
    check_ok(proc, "generate")
    print(f"generate: {proc.stdout!r}")
    assert proc.stdout.strip()

"""Greedy engine.generate equals transformers' greedy `generate`, token for token: a batch of
prompts of different lengths, left-padded for transformers (attention_mask and pad_token_id
set), random-init float64 GPT2LMHeadModel (tied, odd vocabulary) and LlamaForCausalLM (GQA,
untied), read by ms.hf; serially and under MPI at 2 and 4 ranks on dp, fsdp, tp, pp and tp+pp.
`generate --hf DIR` prints the same completions, with a tokenizer trained in the test.

Run: `pytest -q tests/hf/test_generate_hf.py` and
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/hf/test_generate_hf.py` for
N in 2, 4 (a k-rank layout runs on `group_comm(k)`).
"""
import pytest
import torch
from mpi4py import MPI

import mpishard as ms
from conftest import group_comm, run_mpi
from hf_models import gpt2, llama

pytest.importorskip("transformers")

PROMPTS = [[5, 17, 42, 8, 96, 3], [60, 2], [11, 12, 13, 14], [88]]
NEW = 9                                    # 6 + 9 <= n_positions 16
EOS = 1                                    # the models' eos_token_id
BUILD = {"gpt2": gpt2, "llama": llama}


def transformers_greedy(ref, prompts, new=NEW, pad=0):
    """transformers' generate, left padding: each row's ids after its prompt, cut after eos."""
    width = max(map(len, prompts))
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = ref.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False,
                           pad_token_id=pad, eos_token_id=EOS, num_beams=1)
    rows = []
    for row in out[:, width:].tolist():
        rows.append(row[:row.index(EOS) + 1] if EOS in row else row)
    return rows


def check(tmp_path, kind, layout="single", comm=None):
    d, ref = BUILD[kind](tmp_path / f"r{0 if comm is None else comm.Get_rank()}")
    want = transformers_greedy(ref, PROMPTS)
    assert any(len(r) == NEW for r in want), "every row ended at once: a weak comparison"
    engine = ms.make_engine(ms.hf.read_model(d), layout,
                            comm=MPI.COMM_SELF if comm is None else comm)
    ms.hf.load_into(engine, d)
    got = engine.generate(PROMPTS, NEW, temperature=0, eos=EOS)
    assert got == want, f"{kind} {layout}: {got} != transformers' {want}"
    print(f"{kind} {layout}: {sum(map(len, got))} ids equal transformers'")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_greedy_equals_transformers_generate(tmp_path, kind):
    check(tmp_path, kind)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", ["dp=2", "fsdp=2", "tp=2", "pp=2"])
def test_greedy_equals_transformers_on_two_ranks(tmp_path, kind, layout):
    check(tmp_path, kind, layout, group_comm(2))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("layout", ["tp=2,pp=2", "dp=2,tp=2"])
def test_greedy_equals_transformers_on_four_ranks(tmp_path, kind, layout):
    check(tmp_path, kind, layout, group_comm(4))


def word_tokenizer(directory, vocab: int):
    """A WordLevel tokenizer.json of `vocab` ids (w0 .. w{vocab-2}, [UNK]) saved in directory."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {f"w{i}": i for i in range(vocab - 1)}
    words["[UNK]"] = vocab - 1
    tok = Tokenizer(models.WordLevel(words, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(directory / "tokenizer.json"))
    return tok


def test_the_cli_prints_transformers_completions(tmp_path):
    d, ref = gpt2(tmp_path / "gpt2")
    tok = word_tokenizer(tmp_path / "gpt2", 97)
    texts = [" ".join(f"w{i}" for i in p) for p in PROMPTS]
    assert [tok.encode(t).ids for t in texts] == PROMPTS
    # each completion decoded as the continuation of its prompt's ids (cli.generate.Text):
    # this decoder-less tokenizer joins words with a space, the prompt's last one included
    want = [t + " " + tok.decode(ids) for t, ids in zip(texts, transformers_greedy(ref, PROMPTS))]
    (tmp_path / "prompts.txt").write_text("\n".join(texts[1:]) + "\n")
    args = ["-m", "mpishard", "generate", "--hf", d, "--prompt", texts[0], "--prompts",
            str(tmp_path / "prompts.txt"), "--max-new-tokens", str(NEW), "--temperature", "0",
            "--dtype", "float64"]
    for n, layout in ((1, "single"), (2, "tp=2")):
        r = run_mpi(n, *args, "--layout", layout, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]
        shown = r.stdout.split("--- prompt ")[1:]
        assert [s.split(" ---\n", 1)[1].rstrip("\n") for s in shown] == want, r.stdout
    one = run_mpi(1, *args[:7], "--max-new-tokens", str(NEW), "--temperature", "0",
                  "--dtype", "float64", timeout=300)                 # one prompt: streamed
    assert one.returncode == 0 and one.stdout == want[0] + "\n", one.stdout
    empty = run_mpi(1, *args[:5], "--prompt", "\n", timeout=300)
    assert empty.returncode == 2 and "prompt 0 encodes to no tokens" in empty.stderr

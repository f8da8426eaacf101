"""`import` and `export` (serial tests that start their own jobs): a bfloat16 GPT-2 and a
float64 Llama go in on 2 ranks (each reading its fsdp or tp slices) and come back out as the
same bytes and config; transformers loads the export; bad input is one usage line."""
import json
import os

import ml_dtypes
import numpy as np
import pytest
import torch
from safetensors.numpy import load_file

import mpishard as ms
from conftest import ROOT, run_mpi, run_python
from hf_models import gpt2, hf_logits, llama, tokens

transformers = pytest.importorskip("transformers")


def export(ckpt, out, *extra):
    return run_python(["-m", "mpishard", "export", "--checkpoint", ckpt, "--hf", out, *extra],
                      cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("build,dtype,layout", [
    (gpt2, torch.bfloat16, None), (llama, torch.float64, "tp=2")])
def test_import_then_export_gives_back_the_same_files(tmp_path, build, dtype, layout):
    d, _ = build(tmp_path / "src", dtype=dtype)
    ckpt, out = tmp_path / "ckpt", tmp_path / "out"
    args = ["-m", "mpishard", "import", "--hf", d, "--checkpoint", ckpt]
    proc = run_mpi(2, *args, *(["--layout", layout] if layout else []))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"into {ckpt}" in proc.stdout
    loaded = ms.checkpoint.load(ckpt)
    model, params = ms.hf.load(d)
    assert loaded.layout == (layout or "fsdp=2") and repr(loaded.model()) == repr(model)
    assert all(np.array_equal(np.asarray(loaded[k]).astype(np.float64),
                              params[k].astype(np.float64)) for k in params)
    proc = export(ckpt, out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    src, got = (load_file(os.path.join(p, "model.safetensors")) for p in (d, out))
    assert got.keys() == src.keys()
    assert all(got[k].dtype == src[k].dtype and np.array_equal(
        got[k].view(np.uint8), src[k].view(np.uint8)) for k in got)
    cfg = [json.load(open(os.path.join(p, "config.json"))) for p in (d, out)]
    assert all(cfg[1][k] == cfg[0][k] for k in ("eos_token_id", "bos_token_id", "vocab_size"))
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    again = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    x = tokens(97)
    assert np.array_equal(hf_logits(back, x), hf_logits(again, x))


def test_export_dtype_and_errors(tmp_path):
    model = ms.GPT(vocab_size=29, seq_len=8, d_model=16, n_heads=2, n_layers=1)
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(model.init(seed=4))
    ms.checkpoint.save(tmp_path / "ckpt", engine)
    proc = export(tmp_path / "ckpt", tmp_path / "out", "--dtype", "bfloat16")
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = load_file(tmp_path / "out" / "model.safetensors")["transformer.wte.weight"]
    want = model.init(seed=4)["embed/tokens"].astype(ml_dtypes.bfloat16)
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))
    mlp = ms.MLP(dims=[4, 3])
    engine = ms.SingleDevice(mlp)
    engine.load_checkpoint(mlp.init())
    ms.checkpoint.save(tmp_path / "mlp", engine)
    proc = export(tmp_path / "mlp", tmp_path / "x")
    assert proc.returncode == 2 and "holds MLP; only a language model" in proc.stderr
    proc = run_mpi(2, "-m", "mpishard", "export", "--checkpoint", tmp_path / "ckpt", "--hf",
                   tmp_path / "two")                   # two ranks would write the same files
    assert proc.returncode == 2 and "export runs as one process" in proc.stderr
    assert not (tmp_path / "two").exists()
    proc = run_python(["-m", "mpishard", "import", "--hf", tmp_path / "nowhere",
                       "--checkpoint", tmp_path / "c"], cwd=ROOT, capture_output=True,
                      text=True, timeout=120)
    assert proc.returncode == 2 and "--hf" in proc.stderr and "not a directory" in proc.stderr


def test_export_takes_the_source_of_a_fine_tuned_checkpoint(tmp_path):
    """A checkpoint without an import record (as a fine-tune writes) exports with --source's
    dtype and config fields; a --source of another model is refused."""
    d, _ = gpt2(tmp_path / "src", dtype=torch.bfloat16)
    model = ms.hf.read_model(d)
    engine = ms.SingleDevice(model, dtype=np.float32)
    ms.hf.load_into(engine, d)
    ms.checkpoint.save(tmp_path / "ckpt", engine)           # no extra["hf"]
    proc = export(tmp_path / "ckpt", tmp_path / "plain")
    assert proc.returncode == 0, proc.stderr[-3000:]
    plain = json.load(open(tmp_path / "plain" / "config.json"))
    assert plain["dtype"] == "float32" and plain["eos_token_id"] is None
    proc = export(tmp_path / "ckpt", tmp_path / "out", "--source", d)
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert (cfg["dtype"], cfg["eos_token_id"], cfg["bos_token_id"]) == ("bfloat16", 1, 0)
    src, got = (load_file(os.path.join(p, "model.safetensors")) for p in (d, tmp_path / "out"))
    assert all(np.array_equal(got[k].view(np.uint8), src[k].view(np.uint8)) for k in src)
    other, _ = gpt2(tmp_path / "other", n_layer=1)
    proc = export(tmp_path / "ckpt", tmp_path / "x", "--source", other)
    assert proc.returncode == 2 and "--source" in proc.stderr and "n_layers=1" in proc.stderr


@pytest.mark.mpi(min_size=2)
def test_a_directory_one_rank_lacks_is_one_usage_error_on_every_rank(tmp_path):
    """generate --hf and import --hf with rank 1 unable to read the directory (a node-local
    copy missing): every rank raises rank 1's UsageError, none is left inside make_engine."""
    from mpishard.cli import build_parser
    from mpishard.cli.generate import build_generator
    from mpishard.cli.hf_import import build_importer
    from mpishard.cli.usage import UsageError, agreed
    from conftest import group_comm

    comm = group_comm(2)
    d, _ = gpt2(tmp_path / f"r{comm.Get_rank()}", vocab_size=256)    # bytes' vocabulary
    path = d if comm.Get_rank() == 0 else str(tmp_path / "nowhere")
    argv = {"generate": ["generate", "--hf", path, "--tokenizer", "bytes", "--prompt", "a",
                         "--layout", "tp=2"],
            "import": ["import", "--hf", path, "--checkpoint", str(tmp_path / "c"),
                       "--layout", "tp=2"]}
    for verb, build in (("generate", build_generator), ("import", build_importer)):
        args = build_parser().parse_args(argv[verb])
        with pytest.raises(UsageError, match="--hf .*nowhere.*(not a directory|does not "
                                             "exist)"):
            agreed(comm, lambda: build(args, comm))


def test_a_fine_tune_keeps_its_source_for_export(tmp_path):
    """train --init-from-hf DIR keeps DIR's config.json and dtype in its checkpoints'
    extra["hf"] (as import does): export needs no --source to write bfloat16 with DIR's token
    ids, and transformers loads the fine-tuned weights."""
    from mpishard import cli

    d, _ = gpt2(tmp_path / "src", dtype=torch.bfloat16, vocab_size=300)   # bytes' 256 fit
    (tmp_path / "notes.txt").write_text("the quick brown fox jumps over the lazy dog. " * 40)
    ckpt = tmp_path / "ckpt"
    assert cli.main(["train", "--init-from-hf", d, "--tokenizer", "bytes", "--text",
                     str(tmp_path / "notes.txt"), "--seq-len", "8", "--batch", "4", "--steps",
                     "2", "--no-progress", "--log-level", "WARNING", "--checkpoint-dir",
                     str(ckpt)]) == 0
    saved = ms.checkpoint.load(ckpt)
    assert saved.extra["hf"] == ms.hf.source(ms.hf.read_model(d)) and saved.step == 2
    proc = export(ckpt, tmp_path / "out")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert (cfg["dtype"], cfg["eos_token_id"], cfg["bos_token_id"]) == ("bfloat16", 1, 0)
    got = load_file(tmp_path / "out" / "model.safetensors")["transformer.wte.weight"]
    want = np.asarray(saved["embed/tokens"]).astype(ml_dtypes.bfloat16)
    src = load_file(os.path.join(d, "model.safetensors"))["transformer.wte.weight"]
    assert got.dtype == src.dtype and np.array_equal(got.view(np.uint16), want.view(np.uint16))
    assert not np.array_equal(got.view(np.uint16), src.view(np.uint16))      # it was trained
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert back.dtype == torch.bfloat16 and back.config.eos_token_id == 1

"""Every registered architecture with a Hugging Face form, against transformers: a new one is
tested by registering it (models.ARCHITECTURES, its spec's `hf_maps()`).

For each name map (GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, ...), a random-init
float64 transformers model is built from the map's `tiny_config()` (no download), its norms
pushed away from 1 and 0, and saved with save_pretrained; then
- ms.hf.load gives transformers' logits (rtol 1e-9) and greedy generation its ids;
- ms.hf.save writes a directory transformers loads back bit-exactly (same class, dtype,
  tensors and logits), and ms.hf.load reads the same spec and bits from it;
- on a subset of layouts (MPI at 1, 2 and 4 ranks; a k-rank layout runs on group_comm(k)),
  ms.hf.load_into gives single's loss, gathered gradients and logits (float64, rtol 1e-9).

Run: `pytest -q -m "not mpi" tests/hf/test_architectures.py` and
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/hf/test_architectures.py`
for N in 1, 2, 4.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm, single_reference
from mpishard.models import ARCHITECTURES

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hf_models import (_perturbed, assert_same_logits, float64_llama, hf_logits,  # noqa: E402
                       our_logits, tokens)

MAPS = [m for spec in ARCHITECTURES.values() for m in spec.hf_maps()]
NAMES = [m.ARCHITECTURE for m in MAPS]
LAYOUTS = [("single", 1), ("dp=2", 2), ("tp=2", 2), ("pp=2", 2), ("dp=2,tp=2", 4)]
PROMPTS = [[5, 17, 42, 8, 96, 3], [60, 2], [11, 12, 13, 14]]
NEW = 9                                   # 6 + 9 <= the tiny configs' 16 positions
BOS, EOS = 0, 1
CE = ms.losses.CrossEntropy()


def build(hf_map, directory, seed=0):
    """The tiny transformers model of `hf_map`, float64, its norm weights and every bias moved
    off 1 and 0 (a missing or swapped one cannot pass), saved under `directory`: (directory,
    model in eval mode). The same on every rank for a seed."""
    torch.manual_seed(seed)
    cfg = transformers.AutoConfig.for_model(hf_map.MODEL_TYPE, **hf_map.tiny_config(),
                                            bos_token_id=BOS, eos_token_id=EOS)
    ref = _perturbed(transformers.AutoModelForCausalLM.from_config(cfg), seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    assert type(ref).__name__ == hf_map.ARCHITECTURE
    ref.save_pretrained(str(directory))
    return str(directory), ref


def transformers_greedy(ref, prompts):
    """transformers' greedy generate, left padded: each row's new ids, cut after eos."""
    width = max(map(len, prompts))
    ids = torch.tensor([[BOS] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad(), float64_llama(ref):
        out = ref.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                           pad_token_id=BOS, eos_token_id=EOS, num_beams=1)
    return [row[:row.index(EOS) + 1] if EOS in row else row
            for row in out[:, width:].tolist()]


def test_every_registered_decoder_has_a_map():
    assert len(set(NAMES)) == len(NAMES) >= 3, NAMES


@pytest.mark.parametrize("hf_map", MAPS, ids=NAMES)
def test_load_gives_transformers_logits_and_greedy_ids(tmp_path, hf_map):
    d, ref = build(hf_map, tmp_path)
    model, params = ms.hf.load(d)
    assert repr(ms.hf.read_model(d)) == repr(model)
    assert model.hf_map() is hf_map
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x),
                 what=f"{hf_map.ARCHITECTURE} logits vs transformers")
    want = transformers_greedy(ref, PROMPTS)
    assert any(len(r) == NEW for r in want), "every row ended at once: a weak comparison"
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    got = engine.generate(PROMPTS, NEW, temperature=0, eos=EOS)
    assert got == want, f"{hf_map.ARCHITECTURE}: greedy {got} != transformers' {want}"


@pytest.mark.parametrize("hf_map", MAPS, ids=NAMES)
def test_save_is_what_transformers_loads_back_bit_exactly(tmp_path, hf_map):
    d, ref = build(hf_map, tmp_path / "src")
    model, params = ms.hf.load(d)
    out = ms.hf.save(tmp_path / "out", model, params)
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(ref) and back.dtype == torch.float64
    want, got = ref.state_dict(), back.state_dict()
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want), hf_map.ARCHITECTURE
    x = tokens(ref)
    assert_same_logits(hf_logits(back, x), hf_logits(ref, x))     # (hf_models: why not bits)
    again, params2 = ms.hf.load(out)
    assert repr(again) == repr(model) and params2.keys() == params.keys()
    assert all(np.array_equal(params2[k], params[k]) for k in params)


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout,n", LAYOUTS)
@pytest.mark.parametrize("hf_map", MAPS, ids=NAMES)
def test_layouts_equal_single(tmp_path, hf_map, layout, n):
    """load_into on `layout`: single's loss, gradients and logits after one train_step."""
    comm = group_comm(n)
    d, ref = build(hf_map, tmp_path / f"r{comm.Get_rank()}")
    model, params = ms.hf.load(d)
    x, t = tokens(ref, rows=4, T=8), tokens(ref, rows=4, T=8, seed=6)
    single, loss, grads = single_reference(model, params, x, t, CE)
    engine = ms.make_engine(ms.hf.read_model(d), layout, comm=comm)
    ms.hf.load_into(engine, d)
    what = f"{hf_map.ARCHITECTURE} {layout}"
    x_local = engine.shard_batch(x)
    value, g = engine.train_step(x_local, engine.shard_batch(t), CE)
    assert_close(value, loss, what=f"{what} loss")
    assert_dicts_close(engine.gather_grads(g), grads, what=f"{what} grads")
    assert_close(engine.gather_batch(engine.predict(x_local)), single.predict(x),
                 what=f"{what} logits")
    engine.close()

"""ms.hf with Mixtral: a random-init float64 MixtralForCausalLM (GQA, odd vocabulary, E=4
experts, top-2, perturbed norms) read by ms.hf in both layouts transformers 5.x reads (the
per-expert w1/w2/w3 files it writes and its fused gate_up_proj/down_proj): logits equal
transformers' at rtol 1e-9, serially and under MPI on ep=2, dp=2,ep=2 and ep=2,tp=2 (each rank
reading only its slices, its experts included); greedy generate equals transformers' for
prompts of different lengths (single, ep=2, dp=2,ep=2, ep=2,tp=2); save -> from_pretrained
gives the same logits bit for bit; the load-balancing loss equals transformers'
(output_router_logits=True); refused fields.

Run: `pytest -q tests/hf/test_hf_mixtral.py` and
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/hf/test_hf_mixtral.py` for
N in 2, 4. transformers runs a float64 Mixtral's rotary angles, RMSNorm's upcast and router
softmax in float32 and sums the auxiliary loss in float32: hf_models.float64_llama runs them in
float64 (the same math), with the eager experts (grouped_mm takes no float64).
"""
import numpy as np
import pytest
import torch
from mpi4py import MPI

import mpishard as ms
from conftest import assert_close, assert_dicts_close, group_comm
from hf_models import check_save_round_trip, edit_config, float64_llama, hf_logits, mixtral, \
    our_logits, tokens
from test_generate_hf import PROMPTS, transformers_greedy
from test_hf_layouts import check_layout

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_load_gives_transformers_logits(tmp_path, tied, fused):
    d, ref = mixtral(tmp_path, tied=tied, fused=fused)
    model, params = ms.hf.load(d)
    assert (model.n_experts, model.top_k, model.capacity_factor, model.n_kv_heads,
            model.router_aux_loss_coef, model.tied) == (4, 2, None, 2, 0.0, tied)
    assert params["block_1/moe/experts/gate/weights"].shape == (4, 32, 48)
    want = ref.model.layers[1].mlp.experts.gate_up_proj.detach().numpy()
    assert np.array_equal(params["block_1/moe/experts/up/weights"][3], want[3, 48:].T)
    x = tokens(ref)
    assert_close(our_logits(model, params, x), hf_logits(ref, x),
                 what=f"mixtral tied={tied} fused={fused}")


def test_both_layouts_read_the_same_bits(tmp_path):
    _, legacy = ms.hf.load(mixtral(tmp_path / "a")[0])
    _, fused = ms.hf.load(mixtral(tmp_path / "b", fused=True)[0])
    assert_dicts_close(fused, legacy, rtol=0, what="fused vs per-expert")


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("tied", [False, True])
def test_save_loads_in_transformers_bit_for_bit(tmp_path, tied, fused):
    """load (either layout) -> save (per-expert) -> from_pretrained: the same logits bit for
    bit; ms.hf.load of the saved directory: the same spec and bits."""
    cfg = check_save_round_trip(lambda d, tied: mixtral(d, tied, fused), tmp_path, tied)
    assert cfg["architectures"] == ["MixtralForCausalLM"] and cfg["model_type"] == "mixtral"
    assert (cfg["num_local_experts"], cfg["num_experts_per_tok"], cfg["output_router_logits"],
            cfg["router_aux_loss_coef"], cfg["tie_word_embeddings"]) == (4, 2, False, 0.001,
                                                                         tied)


def test_a_fresh_spec_saves_for_transformers(tmp_path):
    fresh = ms.Llama(vocab_size=31, seq_len=8, d_model=16, n_heads=4, n_layers=2, n_kv_heads=2,
                     d_ff=24, n_experts=4, top_k=2, router_aux_loss_coef=0.02)
    p = fresh.init(seed=2)
    out = ms.hf.save(tmp_path / "fresh", fresh, p, dtype="float64")
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    assert (back.config.output_router_logits, back.config.router_aux_loss_coef) == (True, 0.02)
    x = tokens(31, T=8)
    assert_close(hf_logits(back, x), our_logits(fresh, p, x), what="fresh mixtral")
    assert repr(ms.hf.read_model(out)) == repr(fresh)


def test_the_auxiliary_loss_equals_transformers(tmp_path):
    """transformers adds coef * load_balancing_loss_func(router logits) to the loss with
    output_router_logits: our train_step's loss with the file's coefficient equals the
    cross-entropy plus that, and with coefficient 0 the cross-entropy alone (rtol 1e-12).
    transformers' own float32 sum agrees with float64_mixtral's to float32 precision."""
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    coef = 0.25
    d, ref = mixtral(tmp_path, router_aux_loss_coef=coef, output_router_logits=True)
    model, params = ms.hf.load(d)
    assert model.router_aux_loss_coef == coef
    x = tokens(ref, rows=4, T=12)
    xin, t = x[:, :-1], x[:, 1:]
    with torch.no_grad(), float64_llama(ref):
        out = ref(torch.as_tensor(xin), output_router_logits=True)
    aux = float(out.aux_loss)
    with torch.no_grad():
        assert_close(float(load_balancing_loss_func(out.router_logits, 4, 2)), aux, rtol=1e-5,
                     what="transformers' float32 aux")
    assert abs(aux - 2.0) > 1e-3                 # E sum(f p) = k for perfectly even routing
    ce = float(torch.nn.functional.cross_entropy(out.logits.reshape(-1, 97),
                                                 torch.as_tensor(t).reshape(-1)))
    for c, want in ((coef, ce + coef * aux), (0.0, ce)):
        engine = ms.SingleDevice(ms.Llama(**dict(spec_args(model), router_aux_loss_coef=c)))
        engine.load_checkpoint({k: np.asarray(v, np.float64) for k, v in params.items()})
        got, _ = engine.train_step(xin, t, ms.losses.CrossEntropy())
        assert_close(got, want, rtol=1e-12, what=f"loss, router_aux_loss_coef={c}")


def spec_args(model) -> dict:
    keys = ("vocab_size", "seq_len", "d_model", "n_heads", "n_layers", "n_kv_heads", "d_ff",
            "rope_theta", "norm_eps", "tied", "n_experts", "top_k", "capacity_factor",
            "router_aux_loss_coef")
    return {k: getattr(model, k) for k in keys}


def check_greedy(tmp_path, layout="single", comm=None):
    d, ref = mixtral(tmp_path / f"r{0 if comm is None else comm.Get_rank()}")
    with float64_llama(ref):
        want = transformers_greedy(ref, PROMPTS)
    assert any(len(r) == 9 for r in want), "every row ended at once: a weak comparison"
    engine = ms.make_engine(ms.hf.read_model(d), layout,
                            comm=MPI.COMM_SELF if comm is None else comm)
    ms.hf.load_into(engine, d)
    got = engine.generate(PROMPTS, 9, temperature=0, eos=1)
    assert got == want, f"mixtral {layout}: {got} != transformers' {want}"
    engine.close()


def test_greedy_equals_transformers_generate(tmp_path):
    check_greedy(tmp_path)


@pytest.mark.parametrize("fields,match", [
    ({"sliding_window": 4}, "sliding_window=4"),
    ({"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"head_dim": 16}, "head_dim=16"),
    ({"num_local_experts": None},              # MixtralConfig's default, 8: files hold 4
     r"tensors missing for Llama\(.*n_experts=8.*experts\.4\.w1\.weight"),
    ({"num_experts_per_tok": 5}, "top_k=5"),
])
def test_unsupported_config_fields_are_named(tmp_path, fields, match):
    d, _ = mixtral(tmp_path)
    edit_config(d, **fields)
    with pytest.raises(ValueError, match=match):
        ms.hf.load(d)


# -- MPI: every rank reads its slices (its experts under ep) ------------------------------------
LAYOUTS = [("single", 1), ("ep=2", 2), ("dp=2,ep=2", 4), ("ep=2,tp=2", 4)]


@pytest.mark.mpi(min_size=1)
@pytest.mark.parametrize("layout,n", LAYOUTS)
@pytest.mark.parametrize("fused", [False, True])
def test_load_into_every_layout(tmp_path, layout, n, fused):
    """transformers' logits at rtol 1e-9; each rank reads exactly the slices it holds (under
    ep its experts only) and gathers back the bits ms.hf.load reads."""
    check_layout(tmp_path, mixtral, layout, n, f"mixtral fused={fused}", fused=fused)


@pytest.mark.mpi(min_size=2)
def test_greedy_equals_transformers_on_ep2(tmp_path):
    check_greedy(tmp_path, "ep=2", group_comm(2))


@pytest.mark.mpi(min_size=4)
@pytest.mark.parametrize("layout", ["dp=2,ep=2", "ep=2,tp=2"])
def test_greedy_equals_transformers_on_four_ranks(tmp_path, layout):
    check_greedy(tmp_path, layout, group_comm(4))


def test_import_and_export_commands_round_trip(tmp_path):
    """`import --hf` -> a checkpoint -> `export --hf`: the per-expert file back bit for bit."""
    from safetensors.numpy import load_file

    from mpishard.cli import main

    d, _ = mixtral(tmp_path / "src", fused=True)
    assert main(["import", "--hf", d, "--checkpoint", str(tmp_path / "ck")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "ck"), "--hf",
                 str(tmp_path / "out")]) == 0
    _, want = ms.hf.load(d)
    model, got = ms.hf.load(tmp_path / "out")
    assert model.n_experts == 4
    assert_dicts_close(got, want, rtol=0, what="import -> export")
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in \
        load_file(str(tmp_path / "out" / "model.safetensors"))

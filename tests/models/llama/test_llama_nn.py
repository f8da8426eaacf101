"""Llama math, serial: each unit's backward against torch autograd in float64 (RMSNorm,
rotary with all three position forms, grouped-query attention with uniform and tp-replicated
kv grouping, RepeatKV, SwiGLU, FusedLinear projections, whole and split for zero bubble); the
whole stack against a torch reference written here from the contract text (forward, loss,
every gradient) and against transformers' LlamaForCausalLM built random-init in float64
(three float32 steps of its float64 model patched to float64: the rotary angles, RMSNorm's
upcast, and the eager softmax, avoided with sdpa attention); the spec's names, shapes, init,
errors and checkpoint spec.
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint.format import model_from_spec, model_spec
from mpishard.models.llama import attention as A
from mpishard.models.llama import units as L
from mpishard.nn.layers import LocalAccess
from test_gpt_nn import perturbed

torch = pytest.importorskip("torch")   # the hf extra; `make test-hf` runs this file

T64 = torch.float64
RTOL = 1e-12


def close(got, want, what, rtol=RTOL):
    got, want = np.asarray(got), np.asarray(want)
    assert got.shape == want.shape, f"{what}: {got.shape} != {want.shape}"
    diff, scale = float(np.abs(got - want).max()), max(float(np.abs(want).max()), 1e-300)
    print(f"{what}: max |diff| = {diff:.3e} (scale {scale:.3e})")
    assert diff <= rtol * scale, f"{what}: {diff:.3e} > {rtol} * {scale:.3e}"


class Store:
    def __init__(self, params):
        self.params = params
        self.grads = {k: np.zeros_like(v) for k, v in params.items()}


def check_unit(unit, x, torch_f, rng, store=None, what=""):
    """unit.forward(x) == torch_f(x, *params) and unit.backward(r) == autograd's dx (and the
    parameters' gradients in `store`)."""
    names = list(store.params) if store else []
    tx = torch.tensor(x, dtype=T64, requires_grad=True)
    tp = [torch.tensor(store.params[n], requires_grad=True) for n in names]
    ty = torch_f(tx, *tp)
    y = unit.forward(x)
    close(y, ty.detach().numpy(), f"{what} forward")
    r = rng.standard_normal(y.shape)
    ty.backward(torch.tensor(r))
    close(unit.backward(r), tx.grad.numpy(), f"{what} dx")
    for n, t in zip(names, tp):
        close(store.grads[n], t.grad.numpy(), f"{what} d{n}")


def t_rmsnorm(x, scale, eps=1e-5):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * scale


def test_rmsnorm_forward_and_gradients(rng):
    store = Store({"n/scale": rng.standard_normal(6)})
    unit = L.RMSNorm(LocalAccess(store), "n", 1e-5)
    check_unit(unit, rng.standard_normal((2, 3, 6)) * 3, t_rmsnorm, rng, store, "rmsnorm")


def t_rope(x, pos, dh, theta):
    """HF's apply_rotary_pos_emb on x (..., t, heads, dh) with angles in float64."""
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=T64) / dh)
    ang = torch.as_tensor(pos, dtype=T64)[..., None] * inv
    emb = torch.cat([ang, ang], -1)[..., None, :]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * emb.cos() + rot * emb.sin()


@pytest.mark.parametrize("form", ["slice", "chunks", "array"])
def test_rotary_turns_q_and_k_at_every_position_form(rng, form):
    b, t, nq, nkv, dh = 2, 4, 4, 2, 6
    where = {"slice": slice(3, 7), "chunks": (slice(0, 2), slice(6, 8)),
             "array": np.array([[0, 1, 2, 3], [5, 6, 7, 8]])}[form]
    pos = {"slice": np.arange(3, 7), "chunks": np.array([0, 1, 6, 7]),
           "array": where}[form]
    unit = A.Rotary(nq, nkv, dh, 500.0, token_positions=lambda n: where)

    def f(x):
        h = x.reshape(b, t, nq + 2 * nkv, dh)
        rot = t_rope(h[:, :, :nq + nkv], pos, dh, 500.0)
        return torch.cat([rot, h[:, :, nq + nkv:]], 2).reshape(x.shape)
    check_unit(unit, rng.standard_normal((b, t, (nq + 2 * nkv) * dh)), f, rng, what=form)


def t_gqa(a, nq, nkv, kv_heads):
    b, t, w = a.shape
    dh = w // (nq + 2 * nkv)
    h = a.reshape(b, t, nq + 2 * nkv, dh).transpose(1, 2)
    q, k, v = h[:, :nq], h[:, nq:nq + nkv][:, kv_heads], h[:, nq + nkv:][:, kv_heads]
    s = q @ k.transpose(-1, -2) / dh ** 0.5
    s = s.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    return (s.softmax(-1) @ v).transpose(1, 2).reshape(b, t, nq * dh)


@pytest.mark.parametrize("nq,nkv,kv_heads", [(4, 2, None), (4, 4, None), (4, 1, None),
                                             (3, 3, [1, 1, 2])])   # tp rank 1 of H=6, K=3
def test_grouped_query_attention_and_repeat_kv(rng, nq, nkv, kv_heads):
    heads = A.KVHeads(nq, nkv, kv_heads)
    index = list(heads.kv_heads)
    a = rng.standard_normal((2, 5, (nq + 2 * nkv) * 4))
    check_unit(A.GroupedQueryAttention(heads), a, lambda x: t_gqa(x, nq, nkv, index), rng,
               what=f"gqa {nq}/{nkv} {kv_heads}")

    def rep(x):
        h = x.reshape(2, 5, nq + 2 * nkv, 4)
        parts = [h[:, :, :nq], h[:, :, nq:nq + nkv][:, :, index], h[:, :, nq + nkv:][:, :, index]]
        return torch.cat(parts, 2).reshape(2, 5, 3 * nq * 4)
    check_unit(A.RepeatKV(heads), a, rep, rng, what="repeat_kv")


def test_swiglu_forward_and_gradients(rng):
    def f(a):
        g, u = a.chunk(2, -1)
        return torch.nn.functional.silu(g) * u
    check_unit(L.SwiGLU(), rng.standard_normal((2, 3, 10)) * 4, f, rng, what="swiglu")


@pytest.mark.parametrize("split", [False, True])
def test_fused_projections_concatenate_and_sum_dx(rng, split):
    store = Store({"a/weights": rng.standard_normal((5, 3)),
                   "b/weights": rng.standard_normal((5, 4))})
    unit = L.FusedLinear(LocalAccess(store), ["a/weights", "b/weights"])
    if split:                                    # zero bubble: dx now, the weights' later
        unit.backward = lambda dy: (unit.backward_input(dy), unit.backward_weights())[0]
    check_unit(unit, rng.standard_normal((2, 3, 5)), lambda x, a, b: torch.cat([x @ a, x @ b], -1),
               rng, store, "fused")


# -- the whole model -------------------------------------------------------------------------------
def make_llama(tied=False, n_kv_heads=2, **kw):
    args = dict(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=2,
                n_kv_heads=n_kv_heads, d_ff=24, rope_theta=300.0, norm_eps=1e-5, tied=tied)
    return ms.Llama(**dict(args, **kw))


def t_swiglu_mlp(x, w):
    return (torch.nn.functional.silu(x @ w["mlp/gate/weights"]) * (x @ w["mlp/up/weights"])
            ) @ w["mlp/down/weights"]


def torch_llama(model, p, tokens, mlp=t_swiglu_mlp):
    """The contract's math in torch ops (float64): logits (B, T, V); mlp(x, block i's
    params by their names after block_i/): the block's MLP (a Mixtral's sparse one)."""
    h = p["embed/tokens"][tokens]
    nq, nkv, dh = model.n_heads, model.n_kv_heads, model.d_head
    b, t = tokens.shape
    index = [i // (nq // nkv) for i in range(nq)]
    for i in range(model.n_layers):
        w = {k.split("/", 1)[1]: v for k, v in p.items() if k.startswith(f"block_{i}/")}
        x = t_rmsnorm(h, w["ln_1/scale"], model.norm_eps)
        q = (x @ w["attn/q/weights"]).reshape(b, t, nq, dh)
        k = (x @ w["attn/k/weights"]).reshape(b, t, nkv, dh)
        v = x @ w["attn/v/weights"]
        pos = np.arange(t)
        qk = torch.cat([t_rope(q, pos, dh, model.rope_theta), t_rope(k, pos, dh, model.rope_theta)],
                       2).reshape(b, t, -1)
        h = h + t_gqa(torch.cat([qk, v], -1), nq, nkv, index) @ w["attn/proj/weights"]
        x = t_rmsnorm(h, w["ln_2/scale"], model.norm_eps)
        h = h + mlp(x, w)
        del w
    x = t_rmsnorm(h, p["ln_f/scale"], model.norm_eps)
    return x @ (p["embed/tokens"].T if model.tied else p["head/weights"])


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("n_kv_heads", [1, 2, 4])
def test_single_engine_equals_the_torch_reference(rng, tied, n_kv_heads):
    model = make_llama(tied, n_kv_heads)
    check_single_engine(model, perturbed(model, 0, rng), rng, torch_llama)


def check_single_engine(model, params, rng, reference):
    """The single engine's logits, loss and every gradient equal reference(model, params,
    tokens)'s (torch, float64) on a (3, 7) batch of an odd length."""
    x, t = rng.integers(0, 13, (3, 7)), rng.integers(0, 13, (3, 7))
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    value, grads = engine.train_step(x, t, ms.losses.CrossEntropy())
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    logits = reference(model, tp, torch.tensor(x))
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 13), torch.tensor(t).reshape(-1))
    loss.backward()
    close(engine.predict(x), logits.detach().numpy(), "logits")
    close(value, loss.item(), "loss")
    for k in params:
        close(grads[k], tp[k].grad.numpy(), f"d {k}")


def hf_float64(hf, monkeypatch, theta, d_head):
    """A float64 HF Llama-family model's float32 steps in float64: the rotary angles and
    RMSNorm's upcast."""
    def rope64(x, position_ids):                 # HF's angles, in float64 instead of float32
        inv = 1.0 / theta ** (torch.arange(0, d_head, 2, dtype=T64) / d_head)
        emb = torch.cat([position_ids[..., None].to(T64) * inv] * 2, -1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)
    hf.model.rotary_emb.forward = rope64

    def rms64(self, x):                          # HF's RMSNorm casts its input to float32
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True)
                                              + self.variance_epsilon))
    monkeypatch.setattr(type(hf.model.norm), "forward", rms64)


@pytest.mark.parametrize("tied", [False, True])
def test_logits_equal_transformers_llama(rng, tied, monkeypatch):
    transformers = pytest.importorskip("transformers")
    model = make_llama(tied, 2)
    params = perturbed(model, 1, rng)
    config = transformers.LlamaConfig(
        vocab_size=13, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=8,
        rms_norm_eps=1e-5, rope_theta=300.0, tie_word_embeddings=tied,
        attention_bias=False, mlp_bias=False, hidden_act="silu")
    config._attn_implementation = "sdpa"   # eager takes its softmax in float32
    hf = transformers.LlamaForCausalLM(config).to(T64).eval()
    names = {"ln_1/scale": "input_layernorm.weight",
             "ln_2/scale": "post_attention_layernorm.weight",
             **{f"attn/{a}/weights": f"self_attn.{a}_proj.weight" for a in "qkv"},
             "attn/proj/weights": "self_attn.o_proj.weight",
             **{f"mlp/{a}/weights": f"mlp.{a}_proj.weight" for a in ("gate", "up", "down")}}
    state = {"model.embed_tokens.weight": params["embed/tokens"],
             "model.norm.weight": params["ln_f/scale"]}
    if not tied:
        state["lm_head.weight"] = params["head/weights"].T
    for i in range(2):
        for ours, theirs in names.items():
            v = params[f"block_{i}/{ours}"]
            state[f"model.layers.{i}.{theirs}"] = v if v.ndim == 1 else v.T
    hf.load_state_dict({k: torch.tensor(v) for k, v in state.items()}, strict=False)

    hf_float64(hf, monkeypatch, 300.0, 4)
    x = rng.integers(0, 13, (2, 8))
    with torch.no_grad():
        want = hf(torch.tensor(x)).logits.numpy()
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    close(engine.predict(x), want, f"vs transformers tied={tied}", rtol=1e-9)


# -- the spec --------------------------------------------------------------------------------------
def test_llama_param_names_shapes_init_and_spec_round_trip():
    model = make_llama(n_kv_heads=2)
    shapes = model.param_shapes()
    assert list(shapes)[:3] == ["embed/tokens", "block_0/ln_1/scale", "block_0/attn/q/weights"]
    assert shapes["block_1/attn/k/weights"] == (16, 8) and shapes["head/weights"] == (16, 13)
    assert shapes["block_0/attn/proj/weights"] == (16, 16) and "ln_f/scale" in shapes
    assert "head/weights" not in make_llama(tied=True).param_shapes()
    p = model.init(3)
    assert all((p[k] == 1).all() for k in shapes if k.endswith("/scale"))
    w = np.concatenate([p[k].ravel() for k in shapes if not k.endswith("/scale")])
    assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002
    np.testing.assert_array_equal(model.init(3)["head/weights"], p["head/weights"])
    again = model_from_spec(model_spec(model))
    assert repr(again) == repr(model) and again.kind == "llama"


@pytest.mark.parametrize("kw,match", [({"n_kv_heads": 3}, "n_kv_heads=3"),
                                      ({"n_heads": 3}, "does not divide"),
                                      ({"d_model": 24, "n_heads": 8}, "must be even"),
                                      ({"rope_theta": 0}, "rope_theta"),
                                      ({"tied": 1}, "tied")])
def test_llama_refuses_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        make_llama(**kw)

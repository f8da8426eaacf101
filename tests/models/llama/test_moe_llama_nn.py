"""Mixtral (ms.Llama with n_experts) math, serial: the sparse MoE unit's forward and backward
against torch autograd in float64 (router, softmax, top-k, renormalised weights, SwiGLU
experts, weighted sum; k = 1, 2 and E); capacity drops against a first-come reference
written here; the whole model on the single engine (logits, loss, every gradient) against a
torch reference of the contract's math and transformers' MixtralForCausalLM built random-init
in float64 (its float32 steps patched: rotary angles, RMSNorm's upcast, the router's
softmax); the spec's names, shapes, errors and checkpoint spec.
"""
import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint.format import model_from_spec, model_spec
from mpishard.nn.layers import LocalAccess
from mpishard.models.llama.moe_units import SparseMoE
from test_gpt_nn import perturbed
from test_llama_nn import (Store, T64, check_single_engine, check_unit, close, hf_float64,
                           torch_llama)

torch = pytest.importorskip("torch")   # the hf extra; `make test-hf` runs this file

F = torch.nn.functional


def make_mixtral(n_experts=4, top_k=2, **kw):
    args = dict(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=2, n_kv_heads=2,
                d_ff=12, rope_theta=300.0, norm_eps=1e-5, n_experts=n_experts, top_k=top_k)
    return ms.Llama(**dict(args, **kw))


def t_moe(x, router, gate, up, down, top_k, keep=None):
    """The contract's sparse MLP in torch ops: x (..., D) -> y; keep (n, k) bool: capacity."""
    rows = x.reshape(-1, x.shape[-1])
    p = F.softmax(rows @ router, -1)
    top, idx = torch.topk(p, top_k, -1)
    w = top / top.sum(-1, keepdim=True)
    y = torch.zeros_like(rows)
    for j in range(top_k):
        for e in range(router.shape[1]):
            sel = (idx[:, j] == e) & (torch.ones_like(idx[:, j], dtype=torch.bool)
                                      if keep is None else torch.as_tensor(keep[:, j]))
            out = (F.silu(rows[sel] @ gate[e]) * (rows[sel] @ up[e])) @ down[e]
            y = y.index_add(0, torch.nonzero(sel)[:, 0], w[sel, j, None] * out)
    return y.reshape(x.shape)


def first_come_keep(p, top_k, seq, capacity):
    """Capacity by hand: per sequence of `seq` rows, all first choices by position, then the
    second ones ...; an expert takes at most `capacity`."""
    idx = np.argsort(-p, axis=1, kind="stable")[:, :top_k]
    keep = np.zeros(idx.shape, bool)
    for s in range(0, len(p), seq):
        taken = {}
        for j in range(top_k):
            for t in range(s, s + seq):
                e = idx[t, j]
                taken[e] = taken.get(e, 0) + 1
                keep[t, j] = taken[e] <= capacity
    return keep


def moe_store(model, rng, index=0):
    shapes = model.mlp_param_shapes(index)
    return Store({k: rng.standard_normal(v) * 0.5 for k, v in shapes.items()})


@pytest.mark.parametrize("n_experts,top_k", [(4, 2), (3, 3), (6, 2), (5, 4)])
def test_sparse_moe_forward_and_gradients_equal_autograd(rng, n_experts, top_k):
    model = make_mixtral(n_experts, top_k)
    store = moe_store(model, rng)
    unit = SparseMoE(model, LocalAccess(store), 0)
    check_unit(unit, rng.standard_normal((2, 5, 16)),
               lambda x, r, g, u, d: t_moe(x, r, g, u, d, top_k), rng, store,
               f"moe E={n_experts} k={top_k}")
    assert not unit.tape


def test_top_1_weights_are_1_and_pass_the_router_no_gradient(rng):
    """k = 1 renormalises every weight to 1 (HF's Mixtral): the router's gradient is zero
    (torch's is round-off); the experts' and dx equal autograd."""
    model = make_mixtral(4, 1)
    store = moe_store(model, rng)
    unit = SparseMoE(model, LocalAccess(store), 0)
    x = torch.tensor(rng.standard_normal((2, 5, 16)), requires_grad=True)
    tp = [torch.tensor(v, requires_grad=True) for v in store.params.values()]
    ty = t_moe(x, *tp, 1)
    close(unit.forward(x.detach().numpy()), ty.detach().numpy(), "forward")
    r = rng.standard_normal(ty.shape)
    ty.backward(torch.tensor(r))
    close(unit.backward(r), x.grad.numpy(), "dx")
    for (name, g), t in zip(store.grads.items(), tp):
        if "router" in name:
            assert not g.any() and np.abs(t.grad.numpy()).max() < 1e-12 * np.abs(r).max()
        else:
            close(g, t.grad.numpy(), name)


def test_capacity_drops_first_come_per_sequence(rng):
    model = make_mixtral(4, 2, capacity_factor=0.5)     # capacity ceil(0.5 * 6 * 2 / 4) = 2
    store = moe_store(model, rng)
    x = rng.standard_normal((3, 6, 16))
    rows = x.reshape(-1, 16)
    p = torch.softmax(torch.tensor(rows) @ torch.tensor(store.params[
        "block_0/moe/router/weights"]), -1).numpy()
    keep = first_come_keep(p, 2, 6, 2)
    seen = []
    unit = SparseMoE(model, LocalAccess(store), 0,
                     record=lambda i, experts, kept, cap: seen.append((i, kept, cap)))
    assert (~keep).sum() > 0, "the case must drop something"
    check_unit(unit, x, lambda x, r, g, u, d: t_moe(x, r, g, u, d, 2, keep), rng, store,
               "moe capacity")
    assert seen[0][0] == 0 and seen[0][2] == 2
    np.testing.assert_array_equal(seen[0][1], keep)


# -- the whole model -------------------------------------------------------------------------------
def torch_mixtral(model, p, tokens):
    """The contract's Mixtral in torch ops (float64): the Llama's with the sparse MLP."""
    def moe(x, w):
        return t_moe(x, w["moe/router/weights"], w["moe/experts/gate/weights"],
                     w["moe/experts/up/weights"], w["moe/experts/down/weights"], model.top_k)
    return torch_llama(model, p, tokens, moe)


@pytest.mark.parametrize("tied,top_k", [(False, 2), (True, 3)])
def test_single_engine_equals_the_torch_reference(rng, tied, top_k):
    model = make_mixtral(4, top_k, tied=tied)
    check_single_engine(model, perturbed(model, 0, rng), rng, torch_mixtral)


def hf_state(params, n_layers, tied):
    """Our names -> transformers 5.x MixtralForCausalLM's (fused experts), by hand."""
    state = {"model.embed_tokens.weight": params["embed/tokens"],
             "model.norm.weight": params["ln_f/scale"]}
    if not tied:
        state["lm_head.weight"] = params["head/weights"].T
    names = {"ln_1/scale": "input_layernorm.weight",
             "ln_2/scale": "post_attention_layernorm.weight",
             **{f"attn/{a}/weights": f"self_attn.{a}_proj.weight" for a in "qkv"},
             "attn/proj/weights": "self_attn.o_proj.weight",
             "moe/router/weights": "mlp.gate.weight"}
    for i in range(n_layers):
        p, layer = f"block_{i}/moe/experts", f"model.layers.{i}"
        for ours, theirs in names.items():
            v = params[f"block_{i}/{ours}"]
            state[f"{layer}.{theirs}"] = v if v.ndim == 1 else v.T
        state[f"{layer}.mlp.experts.gate_up_proj"] = np.concatenate(
            [params[f"{p}/gate/weights"], params[f"{p}/up/weights"]], 2).transpose(0, 2, 1)
        state[f"{layer}.mlp.experts.down_proj"] = params[f"{p}/down/weights"].transpose(0, 2, 1)
    return state


def test_logits_equal_transformers_mixtral(rng, monkeypatch):
    transformers = pytest.importorskip("transformers")
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    model = make_mixtral(4, 2)
    params = perturbed(model, 1, rng)
    config = transformers.MixtralConfig(
        vocab_size=13, hidden_size=16, intermediate_size=12, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=4, max_position_embeddings=8,
        rms_norm_eps=1e-5, rope_theta=300.0, num_local_experts=4, num_experts_per_tok=2,
        tie_word_embeddings=False, hidden_act="silu")
    config._attn_implementation = "sdpa"   # eager takes its softmax in float32
    config._experts_implementation = "eager"   # grouped_mm refuses float64
    hf = transformers.MixtralForCausalLM(config).to(T64).eval()
    missing, unexpected = hf.load_state_dict(
        {k: torch.tensor(v) for k, v in hf_state(params, 2, False).items()}, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)

    hf_float64(hf, monkeypatch, 300.0, 4)

    def router64(self, h):                       # HF's router takes its softmax in float32
        h = h.reshape(-1, self.hidden_dim)
        logits = F.linear(h, self.weight)
        top, idx = torch.topk(F.softmax(logits, -1), self.top_k, -1)
        return logits, top / top.sum(-1, keepdim=True), idx
    monkeypatch.setattr(mixtral.MixtralTopKRouter, "forward", router64)
    x = rng.integers(0, 13, (2, 8))
    with torch.no_grad():
        want = hf(torch.tensor(x)).logits.numpy()
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    close(engine.predict(x), want, "vs transformers' Mixtral", rtol=1e-9)


# -- the spec --------------------------------------------------------------------------------------
def test_mixtral_names_shapes_and_spec_round_trip():
    model = make_mixtral(4, 2, capacity_factor=1.5, router_aux_loss_coef=0.02)
    shapes = model.param_shapes()
    assert shapes["block_1/moe/router/weights"] == (16, 4)
    assert shapes["block_0/moe/experts/gate/weights"] == (4, 16, 12)
    assert shapes["block_0/moe/experts/up/weights"] == (4, 16, 12)
    assert shapes["block_0/moe/experts/down/weights"] == (4, 12, 16)
    assert not any("/mlp/" in k for k in shapes)
    again = model_from_spec(model_spec(model))
    assert repr(again) == repr(model) and again.kind == "llama" and again.n_experts == 4
    assert "moe" not in repr(ms.Llama(13, 8, 16, 4, 2))
    alias = ms.Mixtral(13, 8, 16, 4, 2, n_experts=4, n_kv_heads=2, d_ff=12, rope_theta=300.0,
                       capacity_factor=1.5, router_aux_loss_coef=0.02)
    assert repr(alias) == repr(model) and isinstance(alias, ms.Llama)
    with pytest.raises(ValueError, match="needs n_experts"):
        ms.Mixtral(13, 8, 16, 4, 2, n_experts=None)


@pytest.mark.parametrize("kw,match", [({"top_k": 5}, "top_k=5"),
                                      ({"n_experts": 0}, "n_experts"),
                                      ({"capacity_factor": 0}, "capacity_factor"),
                                      ({"router_aux_loss_coef": -1}, "router_aux_loss_coef")])
def test_mixtral_refuses_bad_sizes(kw, match):
    with pytest.raises(ValueError, match=match):
        make_mixtral(**kw)


# -- the load-balancing loss -----------------------------------------------------------------------
def t_aux(router_logits, n_experts, top_k):
    """HF's load_balancing_loss_func (transformers 5.x, no mask) with float64 sums: the rows
    of every block concatenated; E sum_e (C_e / N) (P_e / N)."""
    counts, probs, rows = 0.0, 0.0, 0
    for logits in router_logits:
        p = F.softmax(logits, -1)
        _, idx = torch.topk(p, top_k, -1)
        counts = counts + F.one_hot(idx.reshape(-1), n_experts).to(T64).sum(0)
        probs, rows = probs + p.sum(0), rows + p.shape[0]
    return torch.sum(counts / rows * (probs / rows)) * n_experts


def test_aux_reference_is_transformers_load_balancing_loss(rng):
    mixtral = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    logits = tuple(torch.tensor(rng.standard_normal((10, 4))) for _ in range(3))
    want = mixtral.load_balancing_loss_func(logits, 4, 2).item()   # float32 sums
    close(t_aux(logits, 4, 2).item(), want, "aux vs HF", rtol=1e-6)


@pytest.mark.parametrize("top_k", [2, 1])
def test_single_engine_loss_with_aux_equals_torch(rng, top_k):
    """CE + c aux (HF's MixtralForCausalLM loss on our targets) and every gradient."""
    model = make_mixtral(4, top_k, router_aux_loss_coef=0.3)
    params = perturbed(model, 2, rng)
    x, t = rng.integers(0, 13, (3, 7)), rng.integers(0, 13, (3, 7))
    engine = ms.SingleDevice(model)
    engine.load_checkpoint(params)
    value, grads = engine.train_step(x, t, ms.losses.CrossEntropy(), grad_scale=0.5)
    tp = {k: torch.tensor(v, requires_grad=True) for k, v in params.items()}
    router_logits = []

    def moe(h, w):
        router_logits.append(h.reshape(-1, 16) @ w["moe/router/weights"])
        return t_moe(h, w["moe/router/weights"], w["moe/experts/gate/weights"],
                     w["moe/experts/up/weights"], w["moe/experts/down/weights"], top_k)
    logits = torch_llama(model, tp, torch.tensor(x), moe)
    loss = F.cross_entropy(logits.reshape(-1, 13), torch.tensor(t).reshape(-1)) \
        + 0.3 * t_aux(router_logits, 4, top_k)
    (0.5 * loss).backward()
    close(value, loss.item(), "loss + aux")
    for k in params:
        close(grads[k], tp[k].grad.numpy(), f"d {k}")
    plain_engine = ms.SingleDevice(make_mixtral(4, top_k))
    plain_engine.load_checkpoint(params)
    assert abs(plain_engine.train_step(x, t, ms.losses.CrossEntropy())[0] - value) > 1e-3


def test_forward_backward_outside_train_step_adds_no_aux(rng):
    """engine.forward/backward (a caller's own loss) carry no auxiliary loss, even after a
    train_step that had one: the gradients are the model's without it."""
    model = make_mixtral(4, 2, router_aux_loss_coef=0.3)
    params = perturbed(model, 3, rng)
    x, dy = rng.integers(0, 13, (2, 6)), rng.standard_normal((2, 6, 13))
    got, want = ms.SingleDevice(model), ms.SingleDevice(make_mixtral(4, 2))
    for engine in (got, want):
        engine.load_checkpoint(params)
    got.train_step(x, x, ms.losses.CrossEntropy())
    grads = [{k: v.copy() for k, v in (e.forward(x), e.backward(dy))[1].items()}
             for e in (got, want)]
    for k in params:
        close(grads[0][k], grads[1][k], f"d {k}", rtol=0)

"""GPT math, serial: finite-difference checks (float64 central differences at a few random
coordinates) of embedding, LayerNorm, causal attention (and its block/merge primitive),
sequence cross-entropy and the whole stack of GPT units; the forward against a plain numpy
reference written here from the contract text; the spec's names, shapes, init and errors.
"""
from types import SimpleNamespace

import numpy as np
import pytest

import mpishard as ms
from mpishard.checkpoint.format import model_from_spec, model_spec
from mpishard.nn import attention as att
from mpishard.nn import functional as nn
from mpishard.nn.layers import LocalAccess, Sequential
from mpishard.nn.losses import CrossEntropy
from mpishard.models.gpt.units import gpt_units

H = 1e-5          # central-difference step
FD_RTOL = 1e-7


def fd_check(f, a, analytic, rng, what, n=8):
    """Compare analytic dF/da with central differences of the scalar f() at n random
    coordinates of `a` (perturbed in place); prints the max difference."""
    flat = a.reshape(-1)
    idx = rng.choice(flat.size, size=min(n, flat.size), replace=False)
    numeric, got = [], []
    for i in idx:
        old = flat[i]
        flat[i] = old + H
        fp = f()
        flat[i] = old - H
        fm = f()
        flat[i] = old
        numeric.append((fp - fm) / (2 * H))
        got.append(analytic.reshape(-1)[i])
    numeric, got = np.array(numeric), np.array(got)
    scale = max(float(np.abs(numeric).max()), float(np.abs(analytic).max()), 1e-12)
    diff = float(np.abs(got - numeric).max())
    print(f"{what}: max |analytic - numeric| = {diff:.3e} (scale {scale:.3e})")
    assert diff <= FD_RTOL * scale + 1e-10, f"{what}: {diff:.3e} > {FD_RTOL} * {scale:.3e}"


# -- embedding, LayerNorm ------------------------------------------------------------------------
def test_embedding_gradient_scatter_adds_repeated_ids(rng):
    table = rng.standard_normal((7, 5))
    ids = np.array([[1, 3, 1], [6, 1, 0]])           # id 1 three times
    r = rng.standard_normal((2, 3, 5))
    g = nn.embedding_backward(r, ids, 7)
    fd_check(lambda: float((r * nn.embedding_forward(table, ids)).sum()), table, g, rng,
             "embedding d table", n=20)
    np.testing.assert_allclose(g[1], r[0, 0] + r[0, 2] + r[1, 1], rtol=1e-14)
    assert not g[[2, 4, 5]].any(), "unused rows get no gradient"


def test_layernorm_matches_pytorch_definition_and_gradients(rng):
    x = rng.standard_normal((2, 3, 6)) * 3 + 1
    scale, shift = rng.standard_normal(6), rng.standard_normal(6)
    y, saved = nn.layernorm_forward(x, scale, shift)
    mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)      # biased variance
    np.testing.assert_allclose(y, (x - mu) / np.sqrt(var + 1e-5) * scale + shift, rtol=1e-12)
    r = rng.standard_normal(y.shape)
    dx, dscale, dshift = nn.layernorm_backward(r, saved, scale)

    def f():
        return float((r * nn.layernorm_forward(x, scale, shift)[0]).sum())
    fd_check(f, x, dx, rng, "layernorm dx")
    fd_check(f, scale, dscale, rng, "layernorm dscale")
    fd_check(f, shift, dshift, rng, "layernorm dshift")


# -- attention -------------------------------------------------------------------------------------
def naive_causal_attention(q, k, v):
    """Per (batch, head): softmax of masked q k^T / sqrt(Dh), then @ v (plain loops)."""
    b, h, t, dh = q.shape
    out = np.zeros_like(q)
    for bi in range(b):
        for hi in range(h):
            s = q[bi, hi] @ k[bi, hi].T / np.sqrt(dh)
            s = np.where(np.tril(np.ones((t, t), bool)), s, -np.inf)
            p = np.exp(s - s.max(-1, keepdims=True))
            out[bi, hi] = (p / p.sum(-1, keepdims=True)) @ v[bi, hi]
    return out


def test_causal_attention_forward_and_gradients(rng):
    q, k, v = (rng.standard_normal((2, 3, 5, 4)) for _ in range(3))
    out, lse = att.causal_attention_forward(q, k, v)
    np.testing.assert_allclose(out, naive_causal_attention(q, k, v), rtol=1e-12, atol=1e-14)
    r = rng.standard_normal(out.shape)
    dq, dk, dv = att.causal_attention_backward(r, q, k, v, out, lse)

    def f():
        return float((r * att.causal_attention_forward(q, k, v)[0]).sum())
    for a, g, name in ((q, dq, "dq"), (k, dk, "dk"), (v, dv, "dv")):
        fd_check(f, a, g, rng, f"attention {name}", n=12)


def test_attention_is_stable_for_large_scores(rng):
    q, k, v = (rng.standard_normal((1, 1, 4, 2)) * 1e3 for _ in range(3))
    out, lse = att.causal_attention_forward(q, k, v)
    assert np.isfinite(out).all() and np.isfinite(lse).all()


@pytest.mark.parametrize("cut", [2, 3, 5])
def test_attention_blocks_merge_to_the_full_result(rng, cut):
    """Keys cut into two chunks: each block (with its causal offset), merged with the online
    softmax, equals full attention; the blocks' backward shares add up to the full gradients.
    A block whose keys all lie in a query's future gives that row lse -inf and weight 0."""
    t = 6
    q, k, v = (rng.standard_normal((2, 2, t, 3)) for _ in range(3))
    full, full_lse = att.causal_attention_forward(q, k, v)
    o1, l1 = att.attention_block(q, k[..., :cut, :], v[..., :cut, :], offset=0)
    o2, l2 = att.attention_block(q, k[..., cut:, :], v[..., cut:, :], offset=-cut)
    assert np.isneginf(l2[..., 0]).all(), "query 0 sees no key of the second chunk"
    out, lse = att.merge_blocks(o1, l1, o2, l2)
    np.testing.assert_allclose(out, full, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(lse, full_lse, rtol=1e-12)
    r = rng.standard_normal(full.shape)
    want = att.causal_attention_backward(r, q, k, v, full, full_lse)
    a = att.attention_block_backward(r, q, k[..., :cut, :], v[..., :cut, :], out, lse, 0)
    b = att.attention_block_backward(r, q, k[..., cut:, :], v[..., cut:, :], out, lse, -cut)
    np.testing.assert_allclose(a[0] + b[0], want[0], rtol=1e-11, atol=1e-13)
    np.testing.assert_allclose(np.concatenate([a[1], b[1]], axis=2), want[1], rtol=1e-11,
                               atol=1e-13)
    np.testing.assert_allclose(np.concatenate([a[2], b[2]], axis=2), want[2], rtol=1e-11,
                               atol=1e-13)


def test_heads_split_q_k_v_columns_in_order(rng):
    d, n_heads = 6, 3
    a = rng.standard_normal((2, 4, 3 * d))
    q, k, v = att.split_heads(a, n_heads)
    np.testing.assert_array_equal(q[1, 2, 3], a[1, 3, 4:6])              # head 2 of q
    np.testing.assert_array_equal(k[0, 1], a[0, :, d + 2:d + 4])          # head 1 of k
    np.testing.assert_array_equal(v[0, 0], a[0, :, 2 * d:2 * d + 2])      # head 0 of v
    np.testing.assert_array_equal(att.split_heads_backward(q, k, v), a)
    o = rng.standard_normal((2, 3, 4, 2))
    np.testing.assert_array_equal(att.merge_heads(o)[:, :, 2:4], o[:, 1])
    np.testing.assert_array_equal(att.merge_heads_backward(att.merge_heads(o), 3), o)


@pytest.mark.parametrize("spec", ["bhtd,bhsd->bhts", "bhts,bhsd->bhtd", "bhts,bhtd->bhsd"])
def test_batched_attention_einsums_hit_matmul(rng, spec):
    sizes = dict(b=2, h=3, t=4, s=5, d=6)
    ins = spec.split("->")[0].split(",")
    a = rng.standard_normal(tuple(sizes[c] for c in ins[0]))
    b = rng.standard_normal(tuple(sizes[c] for c in ins[1]))
    assert nn._matmul_plan(spec) is not None
    np.testing.assert_allclose(nn.einsum(spec, a, b), np.einsum(spec, a, b), rtol=1e-12)


# -- cross-entropy over sequences ------------------------------------------------------------------
def test_sequence_cross_entropy_is_the_token_mean(rng):
    y = rng.standard_normal((3, 4, 7))
    t = rng.integers(0, 7, (3, 4))
    ce = CrossEntropy()
    lp = y - y.max(-1, keepdims=True)
    lp = lp - np.log(np.exp(lp).sum(-1, keepdims=True))
    want = -np.mean([lp[b, i, t[b, i]] for b in range(3) for i in range(4)])
    value, dy = ce(y, t)
    assert abs(value - want) <= 1e-12 * abs(want)
    assert abs(value - ce(y.reshape(12, 7), t.reshape(12))[0]) <= 1e-14 * abs(want)
    fd_check(lambda: ce.value(y, t), y, dy, rng, "sequence cross-entropy dy", n=12)


@pytest.mark.parametrize("yshape,tshape", [((3, 4, 7), (3, 5)), ((3, 4, 7), (3,)),
                                           ((3, 7), (3, 4)), ((3, 4, 5, 7), (3, 4, 5))])
def test_sequence_cross_entropy_rejects_mismatched_shapes(yshape, tshape):
    with pytest.raises(ValueError, match="cross_entropy"):
        CrossEntropy().check(np.zeros(yshape), np.zeros(tshape, dtype=np.int64))


# -- the spec ------------------------------------------------------------------------------------
def test_gpt_param_names_shapes_and_order():
    g = ms.GPT(vocab_size=11, seq_len=8, d_model=12, n_heads=3, n_layers=2, d_ff=20)
    shapes = g.param_shapes()
    block = ["ln_1/scale", "ln_1/shift", "attn/qkv/weights", "attn/qkv/bias", "attn/proj/weights",
             "attn/proj/bias", "ln_2/scale", "ln_2/shift", "mlp/fc/weights", "mlp/fc/bias",
             "mlp/proj/weights", "mlp/proj/bias"]
    want = (["embed/tokens", "embed/positions"] + [f"block_{i}/{n}" for i in range(2)
                                                   for n in block]
            + ["ln_f/scale", "ln_f/shift", "head/weights"])
    assert list(shapes) == want
    assert shapes["embed/tokens"] == (11, 12) and shapes["embed/positions"] == (8, 12)
    assert shapes["block_1/attn/qkv/weights"] == (12, 36)
    assert shapes["block_0/mlp/fc/weights"] == (12, 20)
    assert shapes["block_0/mlp/proj/weights"] == (20, 12)
    assert shapes["head/weights"] == (12, 11)
    tied = ms.GPT(11, 8, 12, 3, 2, tied=True)
    assert "head/weights" not in tied.param_shapes() and tied.d_ff == 48


def test_gpt_init_is_gpt2s():
    g = ms.GPT(vocab_size=64, seq_len=32, d_model=64, n_heads=4, n_layers=8)
    p, q = g.init(seed=3), g.init(seed=3)
    assert all(np.array_equal(p[k], q[k]) and p[k].dtype == np.float64 for k in p)
    assert np.all(p["block_0/ln_1/scale"] == 1) and not p["ln_f/shift"].any()
    assert not p["block_3/attn/qkv/bias"].any() and not p["block_3/mlp/proj/bias"].any()
    for name, std in (("embed/tokens", 0.02), ("block_2/attn/qkv/weights", 0.02),
                      ("head/weights", 0.02), ("block_5/mlp/fc/weights", 0.02),
                      ("block_1/attn/proj/weights", 0.02 / 4),
                      ("block_7/mlp/proj/weights", 0.02 / 4)):
        got = float(p[name].std())
        print(f"{name}: std {got:.5f}, want {std:.5f}")
        assert abs(got - std) < 0.1 * std, name


@pytest.mark.parametrize("kwargs,match", [
    (dict(d_model=10, n_heads=3), "does not divide"),
    (dict(n_layers=0), "n_layers must be a positive integer"),
    (dict(vocab_size=2.5), "vocab_size"),
    (dict(seq_len=True), "seq_len"),
    (dict(d_ff=-1), "d_ff"),
])
def test_gpt_rejects_bad_sizes(kwargs, match):
    args = dict(vocab_size=11, seq_len=8, d_model=12, n_heads=3, n_layers=2) | kwargs
    with pytest.raises(ValueError, match=match):
        ms.GPT(**args)


def test_gpt_checks_params_inputs_and_round_trips_through_a_checkpoint_spec():
    g = ms.GPT(11, 8, 12, 3, 2, tied=True)
    p = g.init(0)
    g.check_params(p)
    with pytest.raises(ValueError, match="missing"):
        g.check_params({k: v for k, v in p.items() if k != "ln_f/scale"})
    with pytest.raises(ValueError, match="unexpected"):
        g.check_params(dict(p, **{"head/weights": np.zeros((12, 11))}))
    with pytest.raises(TypeError, match="integer token ids"):
        g.check_input(np.zeros((2, 3)))
    with pytest.raises(ValueError, match="seq_len=8"):
        g.check_input(np.zeros((2, 9), dtype=np.int64))
    with pytest.raises(ValueError, match=r"\[0, vocab_size=11\)"):
        g.check_input(np.full((2, 3), 11))
    assert g.output_shape((4, 5)) == (4, 5, 11)
    with pytest.raises(ValueError, match="leading dims"):
        g.output_shape((4,))
    again = model_from_spec(model_spec(g))
    assert repr(again) == repr(g)


# -- the units against a plain numpy GPT ----------------------------------------------------
def reference_gpt(p, tokens, n_layers, n_heads, tied):
    """The contract, read literally, in plain numpy."""
    def ln(x, prefix):
        mu, var = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - mu) / np.sqrt(var + 1e-5) * p[f"{prefix}/scale"] + p[f"{prefix}/shift"]

    def gelu(x):
        return 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))

    B, T = tokens.shape
    h = p["embed/tokens"][tokens] + p["embed/positions"][:T]
    D = h.shape[-1]
    dh = D // n_heads
    for i in range(n_layers):
        b = f"block_{i}"
        a = ln(h, f"{b}/ln_1") @ p[f"{b}/attn/qkv/weights"] + p[f"{b}/attn/qkv/bias"]
        heads = []
        for j in range(n_heads):
            q = a[:, :, j * dh:(j + 1) * dh]
            k = a[:, :, D + j * dh:D + (j + 1) * dh]
            v = a[:, :, 2 * D + j * dh:2 * D + (j + 1) * dh]
            out = np.zeros_like(q)
            for bi in range(B):
                for t in range(T):
                    s = k[bi, :t + 1] @ q[bi, t] / np.sqrt(dh)
                    w = np.exp(s - s.max())
                    out[bi, t] = (w / w.sum()) @ v[bi, :t + 1]
            heads.append(out)
        h = h + np.concatenate(heads, -1) @ p[f"{b}/attn/proj/weights"] + p[f"{b}/attn/proj/bias"]
        m = gelu(ln(h, f"{b}/ln_2") @ p[f"{b}/mlp/fc/weights"] + p[f"{b}/mlp/fc/bias"])
        h = h + m @ p[f"{b}/mlp/proj/weights"] + p[f"{b}/mlp/proj/bias"]
    head = p["embed/tokens"].T if tied else p["head/weights"]
    return ln(h, "ln_f") @ head


def local_stack(model, params):
    store = SimpleNamespace(params=params, grads={k: np.zeros_like(v) for k, v in params.items()})
    units = gpt_units(model, LocalAccess(store), range(model.n_layers), True, True)
    return Sequential(units), store


def perturbed(model, seed, rng):
    """init, with LN and biases moved off 1/0 so every parameter matters in the check."""
    p = model.init(seed)
    return {k: v + 0.1 * rng.standard_normal(v.shape) for k, v in p.items()}


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("T", [8, 5])
def test_gpt_units_match_a_plain_numpy_reference(rng, tied, T):
    model = ms.GPT(vocab_size=13, seq_len=8, d_model=12, n_heads=3, n_layers=2, tied=tied)
    params = perturbed(model, 0, rng)
    tokens = rng.integers(0, 13, (2, T))
    got = local_stack(model, params)[0].forward(tokens, record=False)
    want = reference_gpt(params, tokens, 2, 3, tied)
    diff = float(np.abs(got - want).max())
    print(f"GPT forward vs numpy reference: max |diff| = {diff:.3e}")
    assert got.shape == (2, T, 13)
    assert diff <= 1e-12 * float(np.abs(want).max())


@pytest.mark.parametrize("tied", [False, True])
def test_gpt_units_gradients_by_finite_differences(rng, tied):
    model = ms.GPT(vocab_size=11, seq_len=6, d_model=8, n_heads=2, n_layers=2, tied=tied)
    params = perturbed(model, 1, rng)
    tokens, targets = rng.integers(0, 11, (2, 5)), rng.integers(0, 11, (2, 5))
    stack, store = local_stack(model, params)
    ce = CrossEntropy()
    value, dy = ce(stack.forward(tokens), targets)
    assert stack.backward(dy) is None                      # tokens get no gradient

    def f():
        return ce.value(stack.forward(tokens, record=False), targets)
    for name in params:
        fd_check(f, params[name], store.grads[name], rng, f"GPT d {name}", n=4)


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 9])
def test_max_over_keys_is_numpys_max(rng, n):
    s = rng.standard_normal((2, 3, n, 4))
    np.testing.assert_array_equal(att._max_over_keys(s), s.max(axis=-2, keepdims=True))


def test_attention_writes_heads_where_merge_and_split_want_them(rng):
    """The forward's out is laid out as (B, T, H, Dh), so merge_heads is a view, not a copy;
    the backward writes dq, dk, dv into split_heads_grads' views of one (B, T, 3 D) array,
    equal to split_heads_backward of freshly returned gradients."""
    a = rng.standard_normal((2, 5, 3 * 8))
    q, k, v = att.split_heads(a, 2)
    out, lse = att.causal_attention_forward(q, k, v)
    assert np.shares_memory(att.merge_heads(out), out)
    r = rng.standard_normal(out.shape)
    want = att.split_heads_backward(*att.causal_attention_backward(r, q, k, v, out, lse))
    da, into = att.split_heads_grads(q)
    got = att.causal_attention_backward(r, q, k, v, out, lse, into=into)
    assert all(g is i for g, i in zip(got, into))
    np.testing.assert_allclose(da, want, rtol=1e-14, atol=1e-15)


def test_attention_backward_uses_the_kept_probabilities(rng, monkeypatch):
    """CausalSelfAttention keeps p from its forward: its backward computes no scores, and
    gives the gradients of the recomputing backward (float64, rtol 1e-12)."""
    from mpishard.nn.transformer import CausalSelfAttention
    a, dy = rng.standard_normal((2, 5, 3 * 8)), rng.standard_normal((2, 5, 8))
    q, k, v = att.split_heads(a, 2)
    out, lse = att.causal_attention_forward(q, k, v)
    want = att.split_heads_backward(*att.causal_attention_backward(
        att.merge_heads_backward(dy, 2), q, k, v, out, lse))
    unit = CausalSelfAttention(2)
    unit.forward(a)
    calls = []
    real = att._masked_scores_t
    monkeypatch.setattr(att, "_masked_scores_t", lambda *x: calls.append(1) or real(*x))
    got = unit.backward(dy)
    assert calls == []
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-14)

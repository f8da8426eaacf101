"""nn.py: finite-difference gradient checks (float64) for linear and every activation, closed
forms of the activations, and the BLAS routing of `einsum`. Serial (no MPI).

Each check builds a scalar L = sum(R * f(inputs)) with a random R, so dL/d(output) = R, feeds R
to the backward and compares every input gradient with central differences.
"""
import numpy as np
import pytest

from mpishard.nn import functional as nn

H = 1e-6          # central-difference step
FD_RTOL = 1e-7    # float64 central differences are good to ~1e-9 relative here


def numeric_grad(f, a, h=H):
    """dF/da by central differences, F a scalar function of the array `a` (perturbed in place)."""
    g = np.zeros_like(a)
    it = np.nditer(a, flags=["multi_index"])
    for _ in it:
        i = it.multi_index
        old = a[i]
        a[i] = old + h
        fp = f()
        a[i] = old - h
        fm = f()
        a[i] = old
        g[i] = (fp - fm) / (2 * h)
    return g


def check_grad(analytic, numeric, what):
    scale = max(float(np.abs(numeric).max()), 1e-12)
    diff = float(np.abs(analytic - numeric).max())
    print(f"{what}: max |analytic - numeric| = {diff:.3e} (scale {scale:.3e})")
    assert analytic.shape == numeric.shape, what
    assert diff <= FD_RTOL * scale + 1e-10, f"{what}: {diff:.3e} > {FD_RTOL} * {scale:.3e}"


# -- linear ------------------------------------------------------------------------------------
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [(5, 3, 4), (1, 1, 1), (7, 6, 2)])
def test_linear_gradients(rng, shape, bias):
    B, D, F = shape
    x = rng.standard_normal((B, D))
    w = rng.standard_normal((D, F))
    b = rng.standard_normal(F) if bias else None
    r = rng.standard_normal((B, F))

    def loss():
        return float((r * nn.linear_forward(x, w, None if b is None else b.copy())).sum())

    dx, dw, db = nn.linear_backward(r, x, w)
    check_grad(dx, numeric_grad(loss, x), "linear dx")
    check_grad(dw, numeric_grad(loss, w), "linear dw")
    if bias:
        check_grad(db, numeric_grad(loss, b), "linear db")
    # need_dx=False skips dx but leaves dw, db unchanged
    dx2, dw2, db2 = nn.linear_backward(r, x, w, need_dx=False)
    assert dx2 is None
    np.testing.assert_array_equal(dw2, dw)
    np.testing.assert_array_equal(db2, db)


def test_linear_forward_matches_definition(rng):
    x, w, b = rng.standard_normal((4, 3)), rng.standard_normal((3, 5)), rng.standard_normal(5)
    y = nn.linear_forward(x, w, b)
    want = np.array([[sum(x[i, k] * w[k, j] for k in range(3)) + b[j] for j in range(5)]
                     for i in range(4)])
    np.testing.assert_allclose(y, want, rtol=1e-12)
    assert not np.shares_memory(y, b)          # the in-place bias add never touches b


# -- activations -------------------------------------------------------------------------------
ACTS = ["relu", "gelu", "sigmoid", "tanh", "identity"]


def away_from_kink(rng, shape):
    """Values with |z| >= 0.1, so a finite difference never straddles relu's kink at 0."""
    z = rng.uniform(0.1, 3.0, shape)
    return z * rng.choice([-1.0, 1.0], shape)


@pytest.mark.parametrize("name", ACTS)
def test_activation_gradients(rng, name):
    z = away_from_kink(rng, (6, 5))
    r = rng.standard_normal(z.shape)

    def loss():
        return float((r * nn.activation_forward(name, z)[0]).sum())

    _, saved = nn.activation_forward(name, z)
    dz = nn.activation_backward(name, r, saved)
    check_grad(dz, numeric_grad(loss, z), f"{name} dz")


@pytest.mark.parametrize("name", ACTS)
def test_activation_forward_closed_form(rng, name):
    z = rng.standard_normal((5, 4)) * 3
    c = np.sqrt(2 / np.pi)
    want = {
        "relu": np.maximum(z, 0.0),
        "gelu": 0.5 * z * (1 + np.tanh(c * (z + 0.044715 * z ** 3))),   # torch approximate='tanh'
        "sigmoid": 1 / (1 + np.exp(-z)),
        "tanh": np.tanh(z),
        "identity": z,
    }[name]
    y, _ = nn.activation_forward(name, z)
    np.testing.assert_allclose(y, want, rtol=1e-12, atol=1e-15)


def test_relu_gradient_at_zero_is_zero():
    z = np.array([[-1.0, 0.0, 2.0]])
    _, saved = nn.activation_forward("relu", z)
    np.testing.assert_array_equal(nn.activation_backward("relu", np.ones_like(z), saved),
                                  [[0.0, 0.0, 1.0]])


def test_sigmoid_is_stable_for_large_inputs():
    z = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    with np.errstate(all="raise"):
        y, saved = nn.activation_forward("sigmoid", z)
        dz = nn.activation_backward("sigmoid", np.ones_like(z), saved)
    assert np.isfinite(y).all() and np.isfinite(dz).all()
    assert y[0] == 0.0 and y[2] == 0.5 and y[4] == 1.0


@pytest.mark.parametrize("name", ACTS)
def test_activation_keeps_float32(rng, name):
    z = rng.standard_normal((3, 4)).astype(np.float32)
    y, saved = nn.activation_forward(name, z)
    assert y.dtype == np.float32
    assert nn.activation_backward(name, np.ones_like(z), saved).dtype == np.float32


def test_unknown_activation_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown activation 'swish'.*relu"):
        nn.check_activation("swish")


# -- einsum routing ----------------------------------------------------------------------------
SPECS = ["bd,df->bf", "bf,df->bd", "bd,bf->df", "db,df->bf", "bd,fd->bf", "bd,df->fb",
         "ij,kj->ki", "ij,jk->ki"]


@pytest.mark.parametrize("spec", SPECS)
def test_einsum_matches_numpy(rng, spec):
    sizes = {c: n for c, n in zip(sorted(set(spec) - set(",->")), (3, 4, 5))}
    ins = spec.split("->")[0].split(",")
    a = rng.standard_normal(tuple(sizes[c] for c in ins[0]))
    b = rng.standard_normal(tuple(sizes[c] for c in ins[1]))
    assert nn._matmul_plan(spec) is not None, f"{spec} should be routed to matmul"
    np.testing.assert_allclose(nn.einsum(spec, a, b), np.einsum(spec, a, b), rtol=1e-12)


@pytest.mark.parametrize("spec", ["bd,d->b", "bij,jk->bik", "ii,ij->j", "ab,cd->abcd"])
def test_einsum_falls_back_for_non_matmul_specs(rng, spec):
    ins = spec.split("->")[0].split(",")
    a = rng.standard_normal((3,) * len(ins[0]))
    b = rng.standard_normal((3,) * len(ins[1]))
    assert nn._matmul_plan(spec) is None
    np.testing.assert_allclose(nn.einsum(spec, a, b), np.einsum(spec, a, b), rtol=1e-12)


def test_gelu_saves_one_array_for_its_backward(rng):
    """The tape holds dy/dz alone (the size of z), not z and tanh(...) (twice that)."""
    from mpishard.nn.activations import buffers
    z = rng.standard_normal((70000, 3))                  # spans several GELU_CHUNK chunks
    _, saved = nn.activation_forward("gelu", z)
    assert sum(b.nbytes for b in buffers(saved)) == z.nbytes


def test_gelu_chunks_agree_with_the_whole_array(rng, monkeypatch):
    """Chunking (GELU_CHUNK) changes nothing: the same bits as one pass over everything."""
    import mpishard.nn.pointwise as fn
    monkeypatch.setenv("MPISHARD_CPU_FUSED", "0")          # the numpy path, which chunks
    z, r = rng.standard_normal((7, 11)), rng.standard_normal((7, 11))
    y, d = fn.gelu_forward(z)
    monkeypatch.setattr(fn, "GELU_CHUNK", 5)
    y5, d5 = fn.gelu_forward(z)
    np.testing.assert_array_equal(y, y5)
    np.testing.assert_array_equal(fn.gelu_backward(r, d), fn.gelu_backward(r, d5))


def test_row_and_column_sums_are_numpys_sums(rng):
    """LayerNorm and the bias gradient sum with matrix-vector products: the same sums."""
    a = rng.standard_normal((3, 5, 7))
    np.testing.assert_allclose(nn.row_sums(a), a.sum(axis=-1, keepdims=True), rtol=1e-13)
    np.testing.assert_allclose(nn.column_sums(a[0]), a[0].sum(axis=0), rtol=1e-13)
    assert nn.row_sums(a.astype(np.float32)).dtype == np.float32

"""Packed rows in the Llama's attention units, serial, in float64: a row holding several
documents (nn/documents.py) gives, document by document, what each document gives run alone
from position 0, forward and backward.

    Rotary                 positions restart at each document (cos/sin per row); equal to
                           transformers' apply_rotary_pos_emb at the packed position_ids
    GroupedQueryAttention  a query sees only its own document's keys (uniform and
                           tp-replicated kv grouping)

Padding (document id -1) is a document of its own. The units read the ids from their
`documents` (a Documents, as documents.attach gives it) by microbatch; an unpacked microbatch
of the same Documents gives the plain causal answer.
"""
import numpy as np
import pytest

from mpishard.models.llama import attention as A
from mpishard.nn.documents import Documents, positions

RTOL = 1e-12
IDS = np.array([[0, 0, 0, 1, 1, 2, 2, 2, 2, -1],      # three documents, then padding
                [5, 5, 5, 5, 5, 5, 7, 7, 8, 8]])


def close(got, want, what):
    diff, scale = float(np.abs(got - want).max()), max(float(np.abs(want).max()), 1e-300)
    print(f"{what}: max |diff| = {diff:.3e} (scale {scale:.3e})")
    assert got.shape == want.shape and diff <= RTOL * scale, f"{what}: {diff:.3e}"


def runs(row):
    """(start, stop) of each document of a row of ids."""
    cuts = [0] + [i for i in range(1, len(row)) if row[i] != row[i - 1]] + [len(row)]
    return list(zip(cuts[:-1], cuts[1:]))


def packed(unit, mb=0):
    """unit reading IDS for microbatch mb (and nothing for the others)."""
    documents = Documents()
    documents.set(IDS, 1, mb)
    unit.documents = documents
    return unit


def check_alone(make, width, rng):
    """make() -> a unit; the packed unit's forward and backward, cut at each document, equal
    a fresh unit's on that document alone."""
    x = rng.standard_normal(IDS.shape + (width,))
    unit = packed(make())
    y = unit.forward(x)
    dy = rng.standard_normal(y.shape)
    dx = unit.backward(dy)
    for b, row in enumerate(IDS):
        for lo, hi in runs(row):
            alone = make()
            close(y[b, lo:hi], alone.forward(x[b:b + 1, lo:hi])[0], f"row {b} [{lo}:{hi}] y")
            close(dx[b, lo:hi], alone.backward(dy[b:b + 1, lo:hi])[0],
                  f"row {b} [{lo}:{hi}] dx")
    return x, y


def test_packed_positions_restart_at_each_document():
    np.testing.assert_array_equal(positions(IDS), [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0],
                                                   [0, 1, 2, 3, 4, 5, 0, 1, 0, 1]])


def test_rotary_restarts_positions_per_document(rng):
    nq, nkv, dh = 2, 1, 4
    x, y = check_alone(lambda: A.Rotary(nq, nkv, dh, 500.0), (nq + 2 * nkv) * dh, rng)
    plain = A.Rotary(nq, nkv, dh, 500.0).forward(x)          # no documents: 0 .. T-1
    assert not np.allclose(plain[:, 3:], y[:, 3:])


def test_rotary_packed_equals_transformers_position_ids(rng):
    """The packed rotary equals transformers' apply_rotary_pos_emb given per-row cos/sin at
    position_ids restarting per document (as DataCollatorWithFlattening's), taken in float64
    (transformers' LlamaRotaryEmbedding takes the angles in float32)."""
    torch = pytest.importorskip("torch")
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    nq, nkv, dh, theta = 2, 2, 8, 500.0
    position_ids = torch.tensor(np.array([np.concatenate([np.arange(hi - lo)
                                                          for lo, hi in runs(row)])
                                          for row in IDS]))
    inv = 1.0 / theta ** (torch.arange(0, dh, 2, dtype=torch.float64) / dh)
    emb = torch.cat([position_ids[..., None].double() * inv] * 2, -1)       # (B, T, Dh)
    x = rng.standard_normal(IDS.shape + ((nq + 2 * nkv) * dh,))
    y = packed(A.Rotary(nq, nkv, dh, theta)).forward(x)
    heads = torch.tensor(x).reshape(IDS.shape + (nq + 2 * nkv, dh)).transpose(1, 2)
    q, k = llama.apply_rotary_pos_emb(heads[:, :nq], heads[:, nq:nq + nkv], emb.cos(),
                                      emb.sin())
    want = torch.cat([q, k, heads[:, nq + nkv:]], dim=1).transpose(1, 2).reshape(x.shape)
    close(y, want.numpy(), "rotary vs transformers")


@pytest.mark.parametrize("nq,nkv,kv_heads", [(4, 2, None), (4, 4, None), (2, 2, (1, 1))])
def test_grouped_query_attention_keeps_each_document(rng, nq, nkv, kv_heads):
    dh = 3
    heads = A.KVHeads(nq, nkv, kv_heads)
    x, y = check_alone(lambda: A.GroupedQueryAttention(heads), (nq + 2 * nkv) * dh, rng)
    plain = A.GroupedQueryAttention(heads).forward(x)
    assert not np.allclose(plain[:, 3:], y[:, 3:])


def test_an_unpacked_microbatch_of_the_same_documents_is_plain_causal(rng):
    """Documents set for microbatch 0 only: microbatch 1 runs without a mask."""
    heads = A.KVHeads(2, 1)
    x = rng.standard_normal(IDS.shape + (4 * 3,))
    unit = packed(A.GroupedQueryAttention(heads))
    close(unit.forward(x, mb=1), A.GroupedQueryAttention(heads).forward(x, mb=1), "mb 1")

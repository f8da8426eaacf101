"""The decoders' activation_elements (models/gpt/costs.py, models/llama/costs.py), the
activation term of costs/peak_memory.rank_peak: after a recording forward of one microbatch,
the bytes on the units' tapes (engine.meter, nn/activations.py) equal the prediction exactly,
for a GPT, a Llama with grouped kv heads, a Qwen2 and a Mixtral, under each recompute mode, in
float64 and float32, and on 2 ranks under tp (with and without sequence_parallel: kv heads
split and replicated), fsdp, dp and a balanced Mixtral's ep. An ms.MoE layer: exact when no
assignment is dropped, an upper bound within a few % when capacity drops some.

MPI tests: `mpiexec -n 2 python -m mpi4py -m pytest --with-mpi -m mpi
tests/costs/test_activation_elements.py`.
"""
import numpy as np
import pytest

import mpishard as ms
from conftest import group_comm
from mpishard.costs.peak_memory import rank_peak, saved_bytes
from mpishard.costs.storage import Storage
from mpishard.costs.rank_costs import rank_view
from test_moe_costs import balanced

MODELS = {
    "gpt": lambda: ms.GPT(96, 16, 32, 4, 2),
    "llama": lambda: ms.Llama(96, 16, 32, 4, 2, n_kv_heads=2, d_ff=48),
    "llama-kv1": lambda: ms.Llama(96, 16, 32, 4, 2, n_kv_heads=1, d_ff=48),
    "qwen2": lambda: ms.Qwen2(96, 16, 32, 4, 2, n_kv_heads=2, d_ff=48),
    "mixtral": lambda: ms.Mixtral(96, 16, 32, 4, 2, n_experts=4, top_k=2, d_ff=48),
}


def tape_and_prediction(model, layout, dtype, comm=None, params=None, ids=None, batch=4):
    """(bytes on the tapes after engine.forward of the rank's rows, the predicted bytes)."""
    engine = ms.make_engine(model, layout, dtype=dtype, comm=comm)
    engine.load_checkpoint(model.init(0) if params is None else params)
    rng = np.random.default_rng(0)
    if ids is None and not model.takes_tokens:         # an ms.MoE: rows of d_model features
        ids = rng.standard_normal((8 * batch, model.d_model))
    elif ids is None:
        ids = rng.integers(0, model.vocab_size, (batch, model.seq_len))
    x = np.array(engine.shard_batch(ids))         # the rank's rows alone, not a view of all
    engine.forward(x)
    held = engine.meter.current
    itemsize = np.dtype(dtype).itemsize
    parsed = ms.parse_layout(layout)
    view = rank_view(model, parsed, engine.device_id, itemsize, len(ids))
    parts = model.activation_elements(view, str(parsed.option("recompute", 0)))
    predicted = saved_bytes(parts, view.rows // view.microbatches,
                            Storage(itemsize, itemsize))
    engine.close()
    return held, predicted


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("recompute", ["0", "attn", "1"])
@pytest.mark.parametrize("kind", sorted(MODELS))
def test_tapes_hold_what_activation_elements_predicts(kind, recompute, dtype):
    held, predicted = tape_and_prediction(MODELS[kind](), f"recompute={recompute}", dtype)
    assert held > 0 and predicted == held, (kind, recompute, held, predicted)


def test_a_llama_s_peak_has_activations_and_logits():
    """rank_peak prices a Llama's activations (recompute cuts them) and its loss's logits."""
    model = MODELS["llama"]()
    full = rank_peak(model, ms.parse_layout("single"), 0, 8)
    less = rank_peak(model, ms.parse_layout("recompute=1"), 0, 8)
    assert full["activations"] > less["activations"] > 0
    assert full["logits"] >= 8 * 16 * 96 * 4


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("kind, layout", [
    ("llama", "tp=2"), ("llama", "tp=2,sequence_parallel=1"), ("llama-kv1", "tp=2"),
    ("qwen2", "tp=2,sequence_parallel=1,recompute=attn"), ("gpt", "tp=2"),
    ("mixtral", "tp=2,sequence_parallel=1"), ("mixtral", "fsdp=2"), ("llama", "dp=2")])
def test_tapes_match_on_two_ranks(kind, layout):
    held, predicted = tape_and_prediction(MODELS[kind](), layout, np.float64, group_comm(2))
    assert predicted == held, (kind, layout, held, predicted)


@pytest.mark.mpi(min_size=2)
def test_tapes_match_a_balanced_mixtral_under_ep():
    """Under ep a rank's experts keep the rows routed to them: on a balanced batch (uniform
    routing, test_moe_costs.balanced) n k of them, as predicted."""
    model, params, ids = balanced()
    held, predicted = tape_and_prediction(model, "ep=2", np.float64, group_comm(2), params,
                                          ids)
    assert predicted == held, (held, predicted)


@pytest.mark.parametrize("activation", ["relu", "gelu", "tanh", "identity"])
def test_an_moe_layer_s_tapes_without_drops(activation):
    model = ms.MoE(16, 24, 4, top_k=2, capacity_factor=None, activation=activation)
    held, predicted = tape_and_prediction(model, "single", np.float64)
    assert predicted == held, (activation, held, predicted)


def test_an_moe_layer_s_capacity_drops_keep_less_than_predicted():
    model = ms.MoE(16, 24, 4, top_k=2, capacity_factor=0.5, groups=4)
    held, predicted = tape_and_prediction(model, "single", np.float64)
    assert held <= predicted <= 1.05 * held, (held, predicted)


@pytest.mark.mpi(min_size=2)
def test_an_moe_layer_s_tapes_under_dp():
    model = ms.MoE(16, 24, 4, top_k=2, capacity_factor=None, activation="gelu")
    held, predicted = tape_and_prediction(model, "dp=2", np.float64, group_comm(2))
    assert predicted == held, (held, predicted)

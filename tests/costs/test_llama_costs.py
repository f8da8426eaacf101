"""plan/inspect/bench of ms.Llama (`--model llama:KEY=VALUE,...`) and its pricing: the bytes
(costs.step_comm) and calls (call_counts.step_calls) of one train_step and AdamW step equal
what the engine counts on every rank, under tp with kv heads split and replicated (their
gradients' all_reduce), sequence parallel, cp, pp, fsdp and tied heads.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/costs/test_llama_costs.py`
for N in 2, 4.
"""
import pytest

import mpishard as ms
from conftest import group_comm
from mpishard import cli
from mpishard.models.gpt.costs import gpt_flops
from mpishard.cli.model_flag import model_from_flag
from mpishard.cli.usage import UsageError
from mpishard.costs.rank_costs import rank_view
from mpishard.costs.step_time import elementwise_seconds, train_elementwise_seconds
from test_llama_layouts import make_llama
from test_plan_bench import check_decoder_step
from test_step_time import flat

CASES = [(2, "tp=2", {"n_kv_heads": 1}), (2, "tp=2", {"tied": True}),
         (2, "tp=2,sequence_parallel=1", {"n_kv_heads": 1}), (2, "cp=2", {}),
         (2, "cp=2,cp_kind=ulysses", {"tied": True}), (2, "fsdp=2,zero=3", {"tied": True}),
         (2, "pp=2,recompute=1", {}),
         (4, "tp=4", {}), (4, "tp=2,pp=2", {"n_kv_heads": 1}), (4, "dp=2,tp=2", {}),
         (4, "fsdp=2,tp=2,zero=3", {"n_kv_heads": 1}), (4, "tp=2,cp=2", {"n_kv_heads": 1}),
         (4, "fsdp=2,pp=2,zero=2", {})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout,kw", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_llama_comm_bytes_and_calls_match_the_plan(n, layout, kw):
    check_decoder_step(group_comm(n), make_llama(**kw), layout)


def test_plan_inspect_and_bench_know_llama(capsys):
    spec = "llama:d_model=16,n_heads=4,n_kv_heads=1,n_layers=2,seq_len=8,vocab=13,rope_theta=500"
    assert cli.main(["plan", "--model", spec, "--world-size", "4", "--batch", "8",
                     "--top", "99"]) == 0
    out = capsys.readouterr().out
    assert "Llama(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=2, n_kv_heads=1" \
        in out and "rope_theta=500.0" in out and "tp=2" in out
    assert cli.main(["inspect", "--model", spec, "--layout", "tp=2"]) == 0
    out = capsys.readouterr().out
    assert "block_0/attn/k/weights               16x4 -> 16x4 on ranks 0,1" in out
    assert "block_0/attn/q/weights              16x16 -> 16x8 on ranks 0,1" in out
    llama = model_from_flag(spec + ",norm_eps=1e-6,d_ff=24,tied=1")
    assert (llama.norm_eps, llama.d_ff, llama.tied, llama.rope_theta) == (1e-6, 24, True, 500.0)
    assert gpt_flops(llama, 1) == 3 * 2 * 8 * (2 * (16 * (16 + 4 + 4) + 16 * 16 + 3 * 16 * 24
                                                    + 2 * 8 * 16) + 16 * 13)


@pytest.mark.parametrize("spec,match", [("llama:rope_theta=x", "rope_theta='x' is not a number"),
                                        ("llama:norm_eps=0", "norm_eps must be a positive number"),
                                        ("llama:n_kv_heads=1.5", "is not an integer"),
                                        ("llama:heads=2", "unknown key 'heads'")])
def test_llama_flag_refuses_bad_keys(spec, match):
    with pytest.raises(UsageError, match=match):
        model_from_flag(spec)


def test_step_time_prices_swiglu_and_rotary_not_gelu_and_biases():
    """A Llama block's element-wise work: sigmoid and four products of (T, F) for SwiGLU,
    rotary passes, no biases and no GELU (the GPT's)."""
    model = make_llama(n_layers=1)
    view = rank_view(model, ms.parse_layout("single"), 0, 8, 4)
    cal = flat()
    cal["ops"].update(gelu=[[1.0, 1.0]], sigmoid=[[1.0, 3e-9]])
    tokens, f, d = 4 * 8, model.d_ff, model.d_model
    base = elementwise_seconds(view, flat())
    assert elementwise_seconds(view, cal) == pytest.approx(base + tokens * f * 3e-9, rel=1e-12)
    cal = flat()
    cal["ops"].update(**{"pass": [[1.0, 1e-9]]})
    got = train_elementwise_seconds(view, cal)
    passes = 4 * tokens * f + 2 * 4 * tokens * d + 2 * 4 * tokens * d + 4 * tokens * d
    assert got == pytest.approx(passes * 1e-9, rel=1e-12)

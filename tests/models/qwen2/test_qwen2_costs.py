"""ms.Qwen2's pricing: the bytes (costs.step_comm) and calls (call_counts.step_calls) of one
train_step and AdamW step equal what the engine counts on every rank, the q, k and v biases
included (split on tp with their weights, or replicated with them and their gradients
all-reduced; fetched and reduce-scattered under fsdp); `plan --model qwen2:...` prices it.

MPI tests:
`mpiexec -n N python -m mpi4py -m pytest --with-mpi -m mpi tests/models/qwen2/test_qwen2_costs.py`
for N in 2, 4.
"""
import pytest

from conftest import group_comm
from mpishard import cli
from test_plan_bench import check_decoder_step
from test_qwen2_layouts import make_qwen2

CASES = [(2, "tp=2", {"n_kv_heads": 1}), (2, "tp=2,sequence_parallel=1", {}),
         (2, "fsdp=2,zero=3", {"tied": True}), (2, "fsdp=2,zero=2", {}), (2, "cp=2", {}),
         (4, "tp=4", {}), (4, "fsdp=2,tp=2,zero=3", {"n_kv_heads": 1}),
         (4, "tp=2,pp=2", {"n_kv_heads": 1})]


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("n,layout,kw", CASES, ids=[f"{c[1]}-{c[2]}" for c in CASES])
def test_qwen2_comm_bytes_and_calls_match_the_plan(n, layout, kw):
    check_decoder_step(group_comm(n), make_qwen2(**kw), layout)


def test_plan_knows_qwen2(capsys):
    spec = "qwen2:d_model=16,n_heads=4,n_kv_heads=1,n_layers=2,seq_len=8,vocab=13"
    assert cli.main(["plan", "--model", spec, "--world-size", "4", "--batch", "8",
                     "--top", "99"]) == 0
    out = capsys.readouterr().out
    assert "Qwen2(vocab_size=13, seq_len=8, d_model=16, n_heads=4, n_layers=2, n_kv_heads=1" \
        in out and "norm_eps=1e-06" in out and "tp=2" in out

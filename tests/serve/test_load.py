"""The load test, small: 8 concurrent clients, 60 requests (about 50 distinct prompts, a third
of them streamed) to 2 one-rank replicas (dp=2); none is lost, duplicated or mixed up, and each
greedy answer equals engine.generate of its prompt alone. The full run is
`python tests/serve/load_test.py --clients 64 --requests 1000` (docs/serving.md).

Serial test: it starts its own `mpiexec -n 2 ... mpishard serve` job.
"""
import pytest

pytest.importorskip("httpx")

from load_test import run  # noqa: E402


def test_8_clients_60_requests_every_answer_exact():
    summary = run(clients=8, requests=60, layout="dp=2", ranks=2, max_batch=4)
    print(summary)
    assert summary["answered"] == 60
    assert not summary["problems"], "\n".join(summary["problems"][:20])

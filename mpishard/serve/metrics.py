"""The server's Prometheus metrics, in a CollectorRegistry of their own (never the process-wide
default one, so two servers in one process, or a test, do not collide).

    metrics = make_metrics()
    metrics.set_queue(n); metrics.set_batch(running, max_batch)   # the decode loop, per step
    metrics.request(endpoint, status)                              # the HTTP side, per answer
    metrics.tokens(prompt, generated); metrics.first_token(s); metrics.next_token(s)
    body, content_type = metrics.render()                          # GET /metrics

prometheus_client is part of the `serve` extra: without it this module still imports (so
`import mpishard` never needs it) and make_metrics raises an ImportError naming the extra.
"""
from __future__ import annotations

try:
    from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge,
                                   Histogram, generate_latest)
except ImportError:                      # the serve extra is not installed
    CollectorRegistry = None

SERVE_EXTRA = "serve needs the serve extra: pip install 'mpishard[serve]'"

# seconds; time to first token spans a queue wait and a prefill, a token gap one decode step
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class ServeMetrics:
    """Counters, gauges and histograms of one server (names prefixed `mpishard_serve_`)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        r, p = self.registry, "mpishard_serve_"
        self._requests = Counter(p + "requests", "HTTP requests answered",
                                 ["endpoint", "status"], registry=r)
        self._prompt = Counter(p + "prompt_tokens", "prompt tokens of admitted requests",
                               registry=r)
        self._generated = Counter(p + "generation_tokens", "tokens generated", registry=r)
        self._queue = Gauge(p + "queue_depth", "requests waiting for a slot", registry=r)
        self._running = Gauge(p + "batch_running", "rows in the running batch", registry=r)
        self._slots = Gauge(p + "batch_slots", "rows the batch can hold (--max-batch)",
                            registry=r)
        self._occupancy = Gauge(p + "batch_occupancy", "running rows / slots", registry=r)
        self._kv = Gauge(p + "kv_cache_usage", "positions the running rows take (prompt and "
                         "tokens drawn) / the KV cache's (slots x --max-model-len)", registry=r)
        self._ttft = Histogram(p + "time_to_first_token_seconds",
                               "from a request's arrival to its first token",
                               buckets=TTFT_BUCKETS, registry=r)
        self._itl = Histogram(p + "inter_token_latency_seconds",
                              "between consecutive tokens of a request",
                              buckets=ITL_BUCKETS, registry=r)

    def request(self, endpoint: str, status: int) -> None:
        self._requests.labels(endpoint=endpoint, status=str(int(status))).inc()

    def tokens(self, prompt: int = 0, generated: int = 0) -> None:
        if prompt:
            self._prompt.inc(prompt)
        if generated:
            self._generated.inc(generated)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def next_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def set_queue(self, n: int) -> None:
        self._queue.set(n)

    def set_batch(self, running: int, max_batch: int) -> None:
        self._running.set(running)
        self._slots.set(max_batch)
        self._occupancy.set(running / max_batch if max_batch else 0.0)

    def set_kv_usage(self, fraction: float) -> None:
        self._kv.set(fraction)

    def render(self) -> tuple:
        """(the Prometheus text exposition, its content type)."""
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def make_metrics() -> ServeMetrics:
    """A fresh ServeMetrics; ImportError without prometheus_client (the serve extra)."""
    if CollectorRegistry is None:
        raise ImportError(SERVE_EXTRA)
    return ServeMetrics()

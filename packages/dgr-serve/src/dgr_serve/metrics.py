"""The front end's Prometheus metrics (GET /metrics), named as vLLM names its own under a `dgr:`
prefix: time to first token and time per output token per request, end-to-end latency, tokens
(prompt, cached by prefix reuse, generated) and the requests running and waiting."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# vLLM's buckets for these two (the same tail from half a second on)
_TAIL = (0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, *_TAIL)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, *_TAIL)


class ServeMetrics:
    def __init__(self, running: Callable[[], int], waiting: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.ttft = Histogram(
            "dgr:time_to_first_token_seconds",
            "From a request's arrival to its first token (admission wait and prefill included)",
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.tpot = Histogram(
            "dgr:time_per_output_token_seconds",
            "A request's mean time per output token after its first",
            registry=r,
            buckets=TPOT_BUCKETS,
        )
        self.e2e = Histogram(
            "dgr:e2e_request_latency_seconds",
            "From a request's arrival to its last token",
            registry=r,
            buckets=TPOT_BUCKETS,
        )
        self.prompt_tokens = Counter(
            "dgr:prompt_tokens", "Prompt tokens of admitted requests", registry=r
        )
        self.cached_tokens = Counter(
            "dgr:prompt_tokens_cached",
            "Prompt tokens the stages kept from earlier requests (prefix reuse)",
            registry=r,
        )
        self.generation_tokens = Counter("dgr:generation_tokens", "Tokens generated", registry=r)
        Gauge("dgr:num_requests_running", "Requests generating now", registry=r).set_function(
            running
        )
        Gauge(
            "dgr:num_requests_waiting", "Requests waiting for admission", registry=r
        ).set_function(waiting)

    def finished(
        self, arrived: float, first: float, last: float, prompt: int, cached: int, tokens: int
    ) -> None:
        """One request ended (perf_counter times; first 0: no token came)."""
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.generation_tokens.inc(tokens)
        if not first:
            return
        self.ttft.observe(first - arrived)
        self.e2e.observe(last - arrived)
        if tokens > 1:
            self.tpot.observe((last - first) / (tokens - 1))

    def text(self) -> bytes:
        return generate_latest(self.registry)

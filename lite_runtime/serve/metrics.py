"""GET /metrics: the server's Prometheus metrics (prometheus-client), named after vLLM's under our own prefix.

Every metric lives in the Service's own registry (not the process-global one), so two servers in one
process do not mix. Recorded when a request ends, from the times the engine keeps on it (SlotRequest:
submitted, started, token_times, ended): nothing is added to the decode loop but a clock read per token.

The names, types and meanings are the README's table ("Metrics"); where vLLM has the metric, ours has its
name under the prefix `mslite_llm:` (vllm:time_to_first_token_seconds -> mslite_llm:time_to_first_token_seconds).

A request with `n` choices counts each choice in the latency histograms and the running/waiting gauges, and
once in requests_total (with the first choice's finish reason) and prompt_tokens_total.
"""
from __future__ import annotations

from typing import Sequence

PREFIX = "mslite_llm:"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds: from a tiny model's millisecond steps to a 72B's long prompts (vLLM's buckets, trimmed)
_TTFT = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_ITL = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
_E2E = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)


class Metrics:
    def __init__(self, engine) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(PREFIX + "requests", "Requests ended, by endpoint and finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Prompt tokens of ended requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "Generated tokens, every choice", registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "Submitted to first token", buckets=_TTFT,
                              registry=r)
        self.itl = Histogram(PREFIX + "inter_token_latency_seconds", "Between two tokens of one choice",
                             buckets=_ITL, registry=r)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "Submitted to ended", buckets=_E2E, registry=r)
        self.queue_time = Histogram(PREFIX + "request_queue_time_seconds", "Submitted to its row's prefill",
                                    buckets=_TTFT, registry=r)
        # the paged KV cache's pool (lite_runtime/engine/blocks.py), read from the engine at each scrape (vLLM's names)
        _Live(PREFIX + "prefix_cache_queries", "Prompt tokens looked up in the KV cache's blocks (prefix caching)",
              "counter", lambda: engine.prefix_queries, r)
        _Live(PREFIX + "prefix_cache_hits", "Prompt tokens found in blocks some request computed (not prefilled "
              "again)", "counter", lambda: engine.prefix_hits, r)
        _Live(PREFIX + "num_preemptions", "Requests that gave their blocks back for an older one (recomputed later)",
              "counter", lambda: engine.preemptions, r)
        Gauge(PREFIX + "kv_cache_usage_perc", "The fraction of the KV cache's blocks in use (1 = all)",
              registry=r).set_function(lambda: engine.pool.usage())
        Gauge(PREFIX + "kv_cache_blocks", "The KV cache's blocks (the null block not counted)",
              registry=r).set(engine.pool.capacity)
        Gauge(PREFIX + "kv_cache_blocks_free", "Blocks no request holds (their contents kept for prefix caching)",
              registry=r).set_function(lambda: engine.pool.num_free)
        Gauge(PREFIX + "kv_cache_block_size", "Tokens per block", registry=r).set(engine.pool.block_size)
        # speculative decoding (vLLM: spec_decode_num_draft_tokens / spec_decode_num_accepted_tokens)
        self.spec_drafted = Counter(PREFIX + "spec_decode_num_draft_tokens", "Draft tokens checked by the score graph",
                                    registry=r)
        self.spec_accepted = Counter(PREFIX + "spec_decode_num_accepted_tokens", "Draft tokens kept", registry=r)
        self.rejections = Counter(PREFIX + "queue_rejections", "Requests refused with 503: queue full", registry=r)
        self.invalid = Counter(PREFIX + "invalid_requests", "Requests refused with a 4xx", ["endpoint"], registry=r)
        Gauge(PREFIX + "num_requests_running", "Choices running in a graph row", registry=r).set_function(
            lambda: engine.load()[0])
        Gauge(PREFIX + "num_requests_waiting", "Choices waiting for a graph row", registry=r).set_function(
            lambda: engine.load()[1])
        Gauge(PREFIX + "rows", "Graph rows: the sequences a step serves (the folder's batch size)",
              registry=r).set(engine.rows)

    def ended(self, endpoint: str, requests: Sequence, finish_reason: str) -> None:
        """One request's choices have all ended (engine thread or event loop: prometheus-client is thread-safe)."""
        self.requests.labels(endpoint, finish_reason).inc()
        self.prompt_tokens.inc(len(requests[0].prompt))
        for request in requests:
            times = request.token_times
            self.generation_tokens.inc(len(request.generated))
            self.spec_drafted.inc(request.spec_drafted)
            self.spec_accepted.inc(request.spec_accepted)
            if times:
                self.ttft.observe(times[0] - request.submitted)
            for a, b in zip(times, times[1:]):
                self.itl.observe(b - a)
            if request.started is not None:
                self.queue_time.observe(request.started - request.submitted)
            if request.ended is not None:
                self.e2e.observe(request.ended - request.submitted)

    def render(self) -> bytes:
        """The text exposition, without the `<counter>_created` / `<histogram>_created` series: prometheus-client adds
        one per counter and histogram (a timestamp under the metric's help text, doubling the page); vLLM turns them
        off. Dropped here, for this registry only: `prometheus_client.disable_created_metrics()` is process-wide."""
        from prometheus_client import generate_latest

        return generate_latest(_WithoutCreated(self.registry))


class _Live:
    """A counter whose value the engine keeps (read at each scrape), registered in `registry`."""

    def __init__(self, name: str, documentation: str, kind: str, read, registry) -> None:
        self.name, self.documentation, self.kind, self.read = name, documentation, kind, read
        registry.register(self)

    def describe(self):
        return self.collect()

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily(self.name, self.documentation)
        family.add_metric([], float(self.read()))
        return [family]


class _WithoutCreated:
    """A collector that yields a registry's metric families without their `_created` samples."""

    def __init__(self, registry) -> None:
        self.registry = registry

    def collect(self):
        for family in self.registry.collect():  # new family objects at each collect: editing them is safe
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family

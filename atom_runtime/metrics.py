"""Prometheus metrics, named after vLLM's so existing dashboards read them."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from atom_runtime.engine_core import EngineStats

_LATENCY_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    10.0,
    20.0,
    40.0,
    80.0,
)


class _EngineStatsCollector:
    """Reads the engine core's counters at scrape time (the latest the core reported)."""

    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.stats = stats
        self.labels = {"model_name": model_name}

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        metric = GaugeMetricFamily(name, doc, labels=list(self.labels))
        metric.add_metric(list(self.labels.values()), value)
        return metric

    def _counter(self, name: str, doc: str, value: float) -> CounterMetricFamily:
        metric = CounterMetricFamily(name, doc, labels=list(self.labels))
        metric.add_metric(list(self.labels.values()), value)
        return metric

    def collect(self):
        s = self.stats()
        hit_rate = s.prefix_cache_hits / s.prefix_cache_queries if s.prefix_cache_queries else 0.0
        yield self._gauge("atom:num_requests_running", "Sequences in the running batch.", s.num_running)
        yield self._gauge("atom:num_requests_waiting", "Sequences waiting to be scheduled.", s.num_waiting)
        yield self._gauge("atom:kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1).", s.kv_usage)
        yield self._gauge("atom:prefix_cache_hit_rate", "Prompt tokens served from the prefix cache (0-1).", hit_rate)
        yield self._counter(
            "atom:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", s.prefix_cache_queries
        )
        yield self._counter("atom:prefix_cache_hits", "Prompt tokens found in the prefix cache.", s.prefix_cache_hits)
        yield self._counter("atom:num_preemptions", "Sequences preempted for lack of KV blocks.", s.num_preemptions)
        yield self._counter("atom:engine_steps", "Engine steps run.", s.num_steps)
        yield self._counter("atom:engine_step_seconds", "Wall time of engine steps.", s.step_time_s)
        yield self._counter("atom:engine_step_wait_seconds", "Step time spent waiting for the GPU.", s.wait_time_s)


class Metrics:
    def __init__(self, stats: Callable[[], EngineStats], model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.prompt_tokens = Counter("atom:prompt_tokens", "Prompt tokens processed.", labels, registry=self.registry)
        self.generation_tokens = Counter("atom:generation_tokens", "Tokens generated.", labels, registry=self.registry)
        self.requests_finished = Counter(
            "atom:request_success",
            "Requests finished, by reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self.ttft = Histogram(
            "atom:time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.tpot = Histogram(
            "atom:time_per_output_token_seconds",
            "Mean time per output token after the first.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.e2e = Histogram(
            "atom:e2e_request_latency_seconds",
            "Request latency, arrival to finish.",
            labels,
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.model_name = model_name
        self.registry.register(_EngineStatsCollector(stats, model_name))

    def observe_finished(
        self,
        prompt_tokens: int,
        output_tokens: int,
        arrival: float,
        first_token: float | None,
        finished: float,
        reason: str,
    ) -> None:
        m = self.model_name
        self.prompt_tokens.labels(m).inc(prompt_tokens)
        self.generation_tokens.labels(m).inc(output_tokens)
        self.requests_finished.labels(m, reason).inc()
        self.e2e.labels(m).observe(finished - arrival)
        if first_token is not None:
            self.ttft.labels(m).observe(first_token - arrival)
            if output_tokens > 1:
                self.tpot.labels(m).observe((finished - first_token) / (output_tokens - 1))

    def render(self) -> bytes:
        return generate_latest(self.registry)

"""The router's own Prometheus metrics, in a per-app CollectorRegistry.

A registry per app (instead of the global default) lets tests and benchmarks create many apps in one
process without "Duplicated timeseries" errors, and keeps one router's numbers separate from another's.
"""

from __future__ import annotations

import contextlib
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)

CONTENT_TYPE = CONTENT_TYPE_LATEST


class RouterMetrics:
    """All router metrics; one instance per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "kvroute_requests_total",
            "Requests answered by route, HTTP status, model",
            ["route", "status", "model"],
            registry=r,
        )
        self.latency = Histogram(
            "kvroute_request_duration_seconds",
            "Time until the response was ready to send (streams: first chunk)",
            ["route"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "kvroute_time_to_first_byte_seconds",
            "Time to the worker's first body bytes",
            ["model"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.decision = Histogram(
            "kvroute_routing_decision_seconds",
            "Time spent gathering facts and choosing a plan",
            ["policy"],
            buckets=_DECISION_BUCKETS,
            registry=r,
        )
        self.upstream_errors = Counter(
            "kvroute_upstream_errors_total", "Failed upstream calls", ["worker", "kind"], registry=r
        )
        self.retries = Counter("kvroute_retries_total", "Requests retried on another worker", registry=r)
        self.engine_cached_by_source = Gauge(
            "kvroute_engine_cached_tokens_by_source",
            "Scraped vllm:prompt_tokens_cached_by_source_total: prompt tokens each engine served from cache, by "
            "source (device, host, disk, p2p, ...); compare with kvroute_predicted_cached_tokens_by_source_total",
            ["worker", "source"],
            registry=r,
        )
        self.rejections = Counter(
            "kvroute_admission_rejections_total",
            "Requests a worker refused before answering (vLLM admission control 503, 429), by worker and status",
            ["worker", "status"],
            registry=r,
        )
        self.inflight = Gauge(
            "kvroute_worker_inflight", "Requests the router has in flight to each worker", ["worker"], registry=r
        )
        self.healthy = Gauge(
            "kvroute_worker_healthy", "1 when the worker passes its health probes", ["worker"], registry=r
        )
        self.worker_running = Gauge(
            "kvroute_worker_requests_running", "Scraped vllm:num_requests_running", ["worker"], registry=r
        )
        self.worker_waiting = Gauge(
            "kvroute_worker_requests_waiting", "Scraped vllm:num_requests_waiting", ["worker"], registry=r
        )
        self.worker_kv_usage = Gauge(
            "kvroute_worker_kv_cache_usage", "Scraped vllm:kv_cache_usage_perc", ["worker"], registry=r
        )
        self.cached_tokens = Counter(
            "kvroute_cached_prompt_tokens_total",
            "usage.prompt_tokens_details.cached_tokens reported by workers",
            ["model"],
            registry=r,
        )
        self._request_children: dict[tuple[str, int, str], Counter] = {}
        self._latency_children: dict[str, Histogram] = {}
        self._children: dict[tuple[int, tuple[str, ...]], Any] = {}
        self.prompt_tokens = Counter(
            "kvroute_prompt_tokens_total", "usage.prompt_tokens reported by workers", ["model"], registry=r
        )

    def observe_request(self, route: str, status: int, model: str, seconds: float) -> None:
        """Hot path: count one answered request; label children are cached (``labels()`` costs µs)."""
        key = (route, status, model)
        child = self._request_children.get(key)
        if child is None:
            child = self._request_children[key] = self.requests.labels(route, str(status), model)
        child.inc()
        hist = self._latency_children.get(route)
        if hist is None:
            hist = self._latency_children[route] = self.latency.labels(route)
        hist.observe(seconds)

    def child(self, metric: Counter | Histogram, *labels: str) -> Any:
        """``metric.labels(*labels)``, cached."""
        key = (id(metric), labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def forget_worker(self, worker_id: str) -> None:
        """Drop a removed worker's series so dashboards do not show ghosts."""
        gauges = (self.inflight, self.healthy, self.worker_running, self.worker_waiting, self.worker_kv_usage)
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id)

    def render(self) -> bytes:
        """The router's metrics, then the process-wide ones (the indexer's, process stats)."""
        return generate_latest(self.registry) + generate_latest(REGISTRY)

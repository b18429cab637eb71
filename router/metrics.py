"""The router's own Prometheus metrics, in a per-app CollectorRegistry.

A registry per app (instead of the global default) lets tests and benchmarks create many apps in one
process without "Duplicated timeseries" errors, and keeps one router's numbers separate from another's.

Under ``kvroute serve --processes N`` the parent sets ``PROMETHEUS_MULTIPROC_DIR`` for its children:
every value then lives in a per-process file, and a scrape of any child answers the aggregate of all of
them (counters and histograms summed, dead children's included; each gauge by the mode it declares), so
``/metrics`` does not depend on which child the scrape reached.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
_DECISION_BUCKETS = (0.00001, 0.000025, 0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.05)

CONTENT_TYPE = CONTENT_TYPE_LATEST
#: The environment variable prometheus_client reads at import: set, metric values live in files there.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def multiprocess_dir() -> str | None:
    """The shared metrics folder of a multi-process ``kvroute serve`` (None: one process)."""
    return os.environ.get(MULTIPROC_ENV) or None


class RouterMetrics:
    """All router metrics; one instance per app."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry(auto_describe=True)
        self.multiproc_dir = multiprocess_dir()
        #: Multi-process mode: in-flight counts published from here (callback gauges are not shared).
        self._inflight_reads: dict[str, Callable[[], float]] = {}
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
            multiprocess_mode="livemostrecent",
        )
        self.rejections = Counter(
            "kvroute_admission_rejections_total",
            "Requests a worker refused before answering (vLLM admission control 503, 429), by worker and status",
            ["worker", "status"],
            registry=r,
        )
        # Every serving process sees its own requests: in-flight counts add up; what each of them probes or
        # scrapes from the same worker is one value (the latest).
        self.inflight = Gauge(
            "kvroute_worker_inflight",
            "Requests the router has in flight to each worker",
            ["worker"],
            registry=r,
            multiprocess_mode="livesum",
        )
        self.healthy = Gauge(
            "kvroute_worker_healthy",
            "1 when the worker passes its health probes",
            ["worker"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.worker_running = Gauge(
            "kvroute_worker_requests_running",
            "Scraped vllm:num_requests_running",
            ["worker"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.worker_waiting = Gauge(
            "kvroute_worker_requests_waiting",
            "Scraped vllm:num_requests_waiting",
            ["worker"],
            registry=r,
            multiprocess_mode="livemostrecent",
        )
        self.worker_kv_usage = Gauge(
            "kvroute_worker_kv_cache_usage",
            "Scraped vllm:kv_cache_usage_perc",
            ["worker"],
            registry=r,
            multiprocess_mode="livemostrecent",
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

    def watch_inflight(self, worker_id: str, read: Callable[[], float]) -> None:
        """``kvroute_worker_inflight{worker}`` from ``read()``: called at scrape time in one process (no
        metric update on the hot path); with several processes, written by :meth:`publish`."""
        if self.multiproc_dir is None:
            self.inflight.labels(worker_id).set_function(read)
        else:
            self._inflight_reads[worker_id] = read

    def publish(self) -> None:
        """Multi-process mode: write this process's callback values where the other processes read them
        (the registry calls it every metrics interval, a scrape of this process before answering)."""
        for worker_id, read in self._inflight_reads.items():
            self.inflight.labels(worker_id).set(read())

    def forget_worker(self, worker_id: str) -> None:
        """Drop a removed worker's series so dashboards do not show ghosts."""
        self._inflight_reads.pop(worker_id, None)
        gauges = (self.inflight, self.healthy, self.worker_running, self.worker_waiting, self.worker_kv_usage)
        for gauge in gauges:
            with contextlib.suppress(KeyError):
                gauge.remove(worker_id)

    def render(self) -> bytes:
        """The router's metrics, then the process-wide ones (the indexer's, process stats). With several
        processes: the aggregate of every process's files, and only that (a collector's values, such as
        ``process_*`` or the prefix caches', would describe whichever process the scrape reached)."""
        if self.multiproc_dir is not None:
            self.publish()
            aggregate = CollectorRegistry()
            MultiProcessCollector(aggregate, path=self.multiproc_dir)  # type: ignore[no-untyped-call]
            return generate_latest(aggregate)
        return generate_latest(self.registry) + generate_latest(REGISTRY)

"""Prometheus metrics under vLLM's names, one CollectorRegistry per worker (many workers per process).

A worker's data-parallel ranks share its registry (one ``/metrics``), each rank's series labelled
``engine="<rank>"`` as vLLM's ``PrometheusStatLogger`` labels them (``vllm/v1/metrics/loggers.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

TTFT_BUCKETS = (
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
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)


#: vLLM's ``CacheHitSource`` values (``vllm/v1/metrics/cache_hit_source.py``), every one exported from 0.
CACHE_HIT_SOURCES = ("device", "host", "p2p", "disk", "external_unspecified")
#: vLLM's ``PromptTokenStats.ALL_SOURCES`` (``vllm/v1/metrics/stats.py``).
PROMPT_TOKEN_SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
#: vLLM's ``ADMISSION_REASONS`` (``vllm/v1/metrics/loggers.py``).
ADMISSION_REASONS = ("max_num_queued_reqs", "max_num_queued_tokens")
PER_ENGINE = ["model_name", "engine"]


class MetricFamilies:
    """Every metric family of one worker, in one registry; :class:`SimMetrics` holds one rank's series."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.registry = reg = CollectorRegistry(auto_describe=False)
        self.running = Gauge(
            "vllm:num_requests_running", "Requests in model execution batches.", PER_ENGINE, registry=reg
        )
        self.waiting = Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", PER_ENGINE, registry=reg)
        self.usage = Gauge(
            "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", PER_ENGINE, registry=reg
        )
        self.cache_info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching", "engine"],
            registry=reg,
        )
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", PER_ENGINE, registry=reg
        )
        self.prefix_hits = Counter("vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", PER_ENGINE, registry=reg)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", PER_ENGINE, registry=reg)
        self.prompt_tokens_by_source = Counter(
            "vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", [*PER_ENGINE, "source"], registry=reg
        )
        self.prompt_tokens_cached = Counter(
            "vllm:prompt_tokens_cached", "Number of cached prompt tokens (local + external).", PER_ENGINE, registry=reg
        )
        self.cached_by_source = Counter(
            "vllm:prompt_tokens_cached_by_source",
            "Prefix-cache hit tokens by the cache tier that supplied them: device (local HBM), host "
            "(offloaded to DRAM), disk, p2p (transferred from another vLLM instance) or external_unspecified. "
            "Counted at admission; sums to vllm:prefix_cache_hits + vllm:external_prefix_cache_hits.",
            [*PER_ENGINE, "source"],
            registry=reg,
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", PER_ENGINE, registry=reg
        )
        self.success = Counter(
            "vllm:request_success", "Successfully processed requests.", [*PER_ENGINE, "finished_reason"], registry=reg
        )
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            PER_ENGINE,
            buckets=TTFT_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            PER_ENGINE,
            buckets=E2E_BUCKETS,
            registry=reg,
        )
        admission = Counter(
            "vllm:admission_rejections",
            "Number of admission attempts rejected by a queue limit, by reason.",
            ["model_name", "reason"],
            registry=reg,
        )
        self.admission = {reason: admission.labels(model_name=model, reason=reason) for reason in ADMISSION_REASONS}
        self.xfer_bytes = Counter(
            "kvroute_sim:kv_transfer_bytes", "KV bytes moved between workers.", ["direction", "protocol"], registry=reg
        )
        self.xfer_seconds = Counter(
            "kvroute_sim:kv_transfer_seconds",
            "Time spent moving KV between workers (scaled, real seconds).",
            ["direction", "protocol"],
            registry=reg,
        )
        self.xfer_blocks = Counter(
            "kvroute_sim:kv_transfer_blocks",
            "KV blocks moved between workers.",
            ["direction", "protocol"],
            registry=reg,
        )
        self.lookups = Counter("kvroute_sim:p2p_lookups", "P2P lookups answered, by status.", ["status"], registry=reg)
        self.promoted_blocks = Counter(
            "kvroute_sim:cpu_promoted_blocks", "CPU-tier blocks promoted to GPU.", registry=reg
        )
        self.decode_stall = Counter(
            "kvroute_sim:decode_stall_seconds",
            "Time decode streams waited for a prefill sharing their step (per stream, scaled real seconds).",
            registry=reg,
        )

    def admission_rejected(self, reason: str) -> None:
        """``vllm:admission_rejections_total{model_name, reason}`` (the API server's, not per rank)."""
        self.admission[reason].inc()

    def sample(self, name: str, **labels: str) -> float:
        """Sum of one metric's samples matching ``labels`` (0 when none) — for stats, not for scraping."""
        total = 0.0
        for family in self.registry.collect():
            for s in family.samples:
                if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                    total += s.value
        return total

    def render(self) -> bytes:
        return generate_latest(self.registry)


class SimMetrics:
    """One rank's metrics (DESIGN §9 plus the per-source ground truth and the sim's transfer accounting).

    Without ``families`` the rank gets a registry of its own (a single-rank worker, or a test)."""

    def __init__(
        self,
        model: str,
        block_size: int,
        gpu_blocks: int,
        cpu_blocks: int,
        running: Callable[[], float],
        waiting: Callable[[], float],
        usage: Callable[[], float],
        *,
        families: MetricFamilies | None = None,
        engine: int = 0,
    ) -> None:
        self.families = fam = families or MetricFamilies(model)
        self.registry = fam.registry
        labels: dict[str, Any] = {"model_name": model, "engine": str(engine)}
        self._labels = labels
        fam.running.labels(**labels).set_function(running)
        fam.waiting.labels(**labels).set_function(waiting)
        fam.usage.labels(**labels).set_function(usage)
        fam.cache_info.labels(
            block_size=str(block_size),
            num_gpu_blocks=str(gpu_blocks),
            num_cpu_blocks=str(cpu_blocks),
            enable_prefix_caching="True",
            engine=str(engine),
        ).set(1)
        self.prefix_queries = fam.prefix_queries.labels(**labels)
        self.prefix_hits = fam.prefix_hits.labels(**labels)
        self.prompt_tokens = fam.prompt_tokens.labels(**labels)
        self.prompt_tokens_cached = fam.prompt_tokens_cached.labels(**labels)
        self.prompt_by_source = {
            s: fam.prompt_tokens_by_source.labels(**labels, source=s) for s in PROMPT_TOKEN_SOURCES
        }
        self.cached_by_source = {s: fam.cached_by_source.labels(**labels, source=s) for s in CACHE_HIT_SOURCES}
        self.generation_tokens = fam.generation_tokens.labels(**labels)
        self.ttft = fam.ttft.labels(**labels)
        self.e2e = fam.e2e.labels(**labels)
        self.promoted_blocks = fam.promoted_blocks
        self.decode_stall = fam.decode_stall

    def cache_hits(self, *, device: int, host: int, p2p: int) -> None:
        """One request's cached prompt tokens by the tier that supplied them (at admission, as vLLM)."""
        for source, tokens in (("device", device), ("host", host), ("p2p", p2p)):
            if tokens:
                self.cached_by_source[source].inc(tokens)

    def prompt_done(self, *, total: int, local_hit: int, external: int) -> None:
        """``vllm:prompt_tokens`` and its breakdown once the prompt is prefilled."""
        self.prompt_tokens.inc(total)
        self.prompt_tokens_cached.inc(local_hit + external)
        self.prompt_by_source["local_compute"].inc(total - local_hit - external)
        self.prompt_by_source["local_cache_hit"].inc(local_hit)
        self.prompt_by_source["external_kv_transfer"].inc(external)

    def success(self, reason: str) -> None:
        self.families.success.labels(**self._labels, finished_reason=reason).inc()

    def transfer(self, direction: str, protocol: str, blocks: int, nbytes: int, seconds: float) -> None:
        fam = self.families
        fam.xfer_blocks.labels(direction, protocol).inc(blocks)
        fam.xfer_bytes.labels(direction, protocol).inc(nbytes)
        fam.xfer_seconds.labels(direction, protocol).inc(seconds)

    def lookup(self, status: str) -> None:
        self.families.lookups.labels(status).inc()

    def sample(self, name: str, **labels: str) -> float:
        """Sum of one metric's samples matching ``labels`` over the worker's registry (all its ranks)."""
        return self.families.sample(name, **labels)

    def render(self) -> bytes:
        return self.families.render()

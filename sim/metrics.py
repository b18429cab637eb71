"""Prometheus metrics under vLLM's names, one CollectorRegistry per worker (many workers per process)."""

from __future__ import annotations

from collections.abc import Callable

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


class SimMetrics:
    """The metrics the router scrapes (DESIGN §9) plus the simulator's transfer accounting."""

    def __init__(
        self,
        model: str,
        block_size: int,
        gpu_blocks: int,
        cpu_blocks: int,
        running: Callable[[], float],
        waiting: Callable[[], float],
        usage: Callable[[], float],
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"model_name": model, "engine": "0"}
        names = list(labels)
        reg = self.registry
        Gauge("vllm:num_requests_running", "Requests in model execution batches.", names, registry=reg).labels(
            **labels
        ).set_function(running)
        Gauge("vllm:num_requests_waiting", "Requests waiting to be processed.", names, registry=reg).labels(
            **labels
        ).set_function(waiting)
        Gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", names, registry=reg).labels(
            **labels
        ).set_function(usage)
        info = Gauge(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            ["block_size", "num_gpu_blocks", "num_cpu_blocks", "enable_prefix_caching"],
            registry=reg,
        )
        info.labels(
            block_size=str(block_size),
            num_gpu_blocks=str(gpu_blocks),
            num_cpu_blocks=str(cpu_blocks),
            enable_prefix_caching="True",
        ).set(1)
        self.prefix_queries = Counter(
            "vllm:prefix_cache_queries", "Prefix cache queries, in tokens.", names, registry=reg
        ).labels(**labels)
        self.prefix_hits = Counter(
            "vllm:prefix_cache_hits", "Prefix cache hits, in tokens.", names, registry=reg
        ).labels(**labels)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefill tokens processed.", names, registry=reg).labels(
            **labels
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Generation tokens processed.", names, registry=reg
        ).labels(**labels)
        self._success = Counter(
            "vllm:request_success", "Successfully processed requests.", [*names, "finished_reason"], registry=reg
        )
        self._labels = labels
        self.ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token in seconds.",
            names,
            buckets=TTFT_BUCKETS,
            registry=reg,
        ).labels(**labels)
        self.e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end request latency in seconds.",
            names,
            buckets=E2E_BUCKETS,
            registry=reg,
        ).labels(**labels)
        self._xfer_bytes = Counter(
            "kvroute_sim:kv_transfer_bytes", "KV bytes moved between workers.", ["direction", "protocol"], registry=reg
        )
        self._xfer_seconds = Counter(
            "kvroute_sim:kv_transfer_seconds",
            "Time spent moving KV between workers (scaled, real seconds).",
            ["direction", "protocol"],
            registry=reg,
        )
        self._xfer_blocks = Counter(
            "kvroute_sim:kv_transfer_blocks",
            "KV blocks moved between workers.",
            ["direction", "protocol"],
            registry=reg,
        )
        self._lookups = Counter("kvroute_sim:p2p_lookups", "P2P lookups answered, by status.", ["status"], registry=reg)
        self.promoted_blocks = Counter(
            "kvroute_sim:cpu_promoted_blocks", "CPU-tier blocks promoted to GPU.", registry=reg
        )

    def success(self, reason: str) -> None:
        self._success.labels(**self._labels, finished_reason=reason).inc()

    def transfer(self, direction: str, protocol: str, blocks: int, nbytes: int, seconds: float) -> None:
        self._xfer_blocks.labels(direction, protocol).inc(blocks)
        self._xfer_bytes.labels(direction, protocol).inc(nbytes)
        self._xfer_seconds.labels(direction, protocol).inc(seconds)

    def lookup(self, status: str) -> None:
        self._lookups.labels(status).inc()

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

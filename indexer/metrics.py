"""Prometheus metrics of the indexer, registered on a registry the composition root chooses.

An :class:`IndexerMetrics` owns the metric families; the indexer and its subscriber receive one instead
of reaching for module globals, so an app can put them on its own registry (the router renders its
registry on ``/metrics``) and tests can count in isolation. :func:`default_metrics` is the one instance
on prometheus' default ``REGISTRY`` that callers which pass nothing share: several indexers in one
process (tests, benchmarks) then add up there, labelled by worker entity, as they always did.

:class:`EntityMetrics` caches one entity's label children: ``labels()`` costs microseconds, and the
ingestion path touches several series per batch.
"""

from __future__ import annotations

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

LOOKUP_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0)


class IndexerMetrics:
    """The indexer's metric families, registered on ``registry`` (a fresh one when None)."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        r = self.registry
        self.events_received = Counter(
            "kvroute_index_events_received_total", "KV events received, by type", ["worker", "type"], registry=r
        )
        self.events_applied = Counter(
            "kvroute_index_events_applied_total",
            "KV events applied to the index, by type",
            ["worker", "type"],
            registry=r,
        )
        self.dropped = Counter(
            "kvroute_index_dropped_total", "Messages or events dropped, by reason", ["worker", "reason"], registry=r
        )
        self.gaps = Counter("kvroute_index_gaps_total", "Sequence gaps detected", ["worker"], registry=r)
        self.replays = Counter(
            "kvroute_index_replays_total", "Replay requests, by outcome", ["worker", "outcome"], registry=r
        )
        self.replay_resumes = Counter(
            "kvroute_index_replay_resumes_total",
            "Replays asked again from where they stopped (the engine's send queue dropped their tail)",
            ["worker"],
            registry=r,
        )
        self.purges = Counter(
            "kvroute_index_purges_total", "Worker purges, by reason", ["worker", "reason"], registry=r
        )
        # Several serving processes (kvroute serve --processes) index the same events: one value each.
        self.blocks = Gauge(
            "kvroute_index_blocks",
            "Blocks held per worker (any tier)",
            ["worker"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.event_lag = Gauge(
            "kvroute_index_event_lag_seconds",
            "Receive time minus the batch timestamp of the last batch",
            ["worker"],
            registry=r,
            multiprocess_mode="livemax",
        )
        self.lookup_seconds = Histogram(
            "kvroute_index_lookup_seconds",
            "Index lookup latency (keys to per-worker matches)",
            ["backend"],
            buckets=LOOKUP_BUCKETS,
            registry=r,
        )
        self.backend_up = Gauge(
            "kvroute_index_backend_up",
            "1 when the index backend answers",
            ["backend"],
            registry=r,
            multiprocess_mode="livemin",  # 0 as soon as one process cannot reach it
        )
        self.backend_errors = Counter(
            "kvroute_index_backend_errors_total",
            "Index backend failures, by operation",
            ["backend", "op"],
            registry=r,
        )
        self.evicted_blocks = Counter(
            "kvroute_index_evicted_blocks_total",
            "Blocks a bounded backend forgot to stay within its capacity (index.max_blocks)",
            ["backend"],
            registry=r,
        )
        self.reconciliations = Counter(
            "kvroute_index_reconciliations_total",
            "Checks of the index's block count against the engine's, by outcome (ok, diverged, resynced, error)",
            ["worker", "outcome"],
            registry=r,
        )
        self.resyncs = Counter(
            "kvroute_index_resyncs_total",
            "Full resyncs (purge, then replay from sequence 0), by reason",
            ["worker", "reason"],
            registry=r,
        )
        self.doubts = Counter(
            "kvroute_index_doubts_total",
            "Times a worker's entries were left out of lookups until its next events (a reset or restart seen "
            "outside its event stream), by reason",
            ["worker", "reason"],
            registry=r,
        )
        self.disconnects = Counter(
            "kvroute_index_stream_disconnects_total",
            "Event-stream disconnections seen by the socket monitor (a worker gone, or a frame over MAXMSGSIZE)",
            ["worker"],
            registry=r,
        )

    def entity(self, entity: str) -> EntityMetrics:
        return EntityMetrics(self, entity)


_default: IndexerMetrics | None = None


def default_metrics() -> IndexerMetrics:
    """The process-wide instance on prometheus' default ``REGISTRY`` (created on first use, once: the
    default registry refuses a second registration of the same names)."""
    global _default
    if _default is None:
        _default = IndexerMetrics(REGISTRY)
    return _default


class EntityMetrics:
    """One worker entity's series, created on first use (a series appears when it first counts)."""

    __slots__ = ("_applied", "_blocks", "_dropped", "_gaps", "_lag", "_metrics", "_purges", "_received", "entity")

    def __init__(self, metrics: IndexerMetrics, entity: str) -> None:
        self._metrics = metrics
        self.entity = entity
        self._received: dict[str, Counter] = {}
        self._applied: dict[str, Counter] = {}
        self._dropped: dict[str, Counter] = {}
        self._purges: dict[str, Counter] = {}
        self._blocks: Gauge | None = None
        self._lag: Gauge | None = None
        self._gaps: Counter | None = None

    def received(self, kind: str, n: int) -> None:
        child = self._received.get(kind)
        if child is None:
            child = self._received[kind] = self._metrics.events_received.labels(self.entity, kind)
        child.inc(n)

    def applied(self, kind: str, n: int) -> None:
        child = self._applied.get(kind)
        if child is None:
            child = self._applied[kind] = self._metrics.events_applied.labels(self.entity, kind)
        child.inc(n)

    def dropped(self, reason: str, n: int = 1) -> None:
        child = self._dropped.get(reason)
        if child is None:
            child = self._dropped[reason] = self._metrics.dropped.labels(self.entity, reason)
        child.inc(n)

    def purged(self, reason: str) -> None:
        child = self._purges.get(reason)
        if child is None:
            child = self._purges[reason] = self._metrics.purges.labels(self.entity, reason)
        child.inc()

    def gap(self) -> None:
        if self._gaps is None:
            self._gaps = self._metrics.gaps.labels(self.entity)
        self._gaps.inc()

    def set_blocks(self, n: int) -> None:
        if self._blocks is None:
            self._blocks = self._metrics.blocks.labels(self.entity)
        self._blocks.set(n)

    def set_lag(self, seconds: float) -> None:
        if self._lag is None:
            self._lag = self._metrics.event_lag.labels(self.entity)
        self._lag.set(seconds)

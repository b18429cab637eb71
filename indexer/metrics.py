"""Prometheus metrics of the indexer.

Defined once at module level (the default registry refuses duplicates), labelled by worker entity
so several indexers in one process (tests, benchmarks) share them without registration errors.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

EVENTS_RECEIVED = Counter("kvroute_index_events_received_total", "KV events received, by type", ["worker", "type"])
EVENTS_APPLIED = Counter(
    "kvroute_index_events_applied_total", "KV events applied to the index, by type", ["worker", "type"]
)
DROPPED = Counter("kvroute_index_dropped_total", "Messages or events dropped, by reason", ["worker", "reason"])
GAPS = Counter("kvroute_index_gaps_total", "Sequence gaps detected", ["worker"])
REPLAYS = Counter("kvroute_index_replays_total", "Replay requests, by outcome", ["worker", "outcome"])
PURGES = Counter("kvroute_index_purges_total", "Worker purges, by reason", ["worker", "reason"])
BLOCKS = Gauge("kvroute_index_blocks", "Blocks held per worker (any tier)", ["worker"])
EVENT_LAG = Gauge(
    "kvroute_index_event_lag_seconds", "Receive time minus the batch timestamp of the last batch", ["worker"]
)
LOOKUP_SECONDS = Histogram(
    "kvroute_index_lookup_seconds",
    "Index lookup latency (keys to per-worker matches)",
    ["backend"],
    buckets=(5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2.5e-2, 0.1, 1.0),
)
BACKEND_UP = Gauge("kvroute_index_backend_up", "1 when the index backend answers", ["backend"])
BACKEND_ERRORS = Counter(
    "kvroute_index_backend_errors_total", "Index backend failures, by operation", ["backend", "op"]
)

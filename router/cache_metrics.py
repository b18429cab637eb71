"""The decision path's prefix caches as Prometheus series, read when ``/metrics`` is scraped.

The tokenizers' text-prefix caches and the index's key-chain cache keep plain counters (no metric call on
the hot path); this collector turns them into ``kvroute_prefix_cache_events_total{cache,model,event}``
(hits, prefix hits, misses, fallbacks, tokens or blocks reused and computed) and
``kvroute_prefix_cache_bytes{cache,model}``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

_SIZES = frozenset({"entries", "bytes", "max_bytes"})


class PrefixCacheCollector(Collector):
    """``sources()``: per (cache name, model), the cache's ``stats()`` mapping."""

    def __init__(self, sources: Callable[[], Mapping[tuple[str, str], Mapping[str, int]]]) -> None:
        self.sources = sources

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        events = CounterMetricFamily(
            "kvroute_prefix_cache_events",
            "Prefix-cache events on the decision path (tokenizer text prefixes, block-key chains)",
            labels=["cache", "model", "event"],
        )
        size = GaugeMetricFamily(
            "kvroute_prefix_cache_bytes", "Bytes held by a decision-path prefix cache", labels=["cache", "model"]
        )
        for (cache, model), stats in self.sources().items():
            for event, value in stats.items():
                if event not in _SIZES:
                    events.add_metric([cache, model, event], float(value))
            size.add_metric([cache, model], float(stats.get("bytes", 0)))
        yield events
        yield size

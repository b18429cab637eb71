"""The indexer's metrics are handed in: same names and labels wherever they are registered, counted on the
registry given, and by default on prometheus' default registry (where the router's /metrics finds them)."""

from __future__ import annotations

import zmq.asyncio
from kvroute.indexer.events import AllBlocksCleared
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.metrics import IndexerMetrics, default_metrics
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from .fakevllm import Chain, frames

PROMPT = list(range(40, 40 + 16 * 4))

#: The metric contract (docs/indexer.md): family name -> label names.
FAMILIES = {
    "kvroute_index_events_received": ("worker", "type"),
    "kvroute_index_events_applied": ("worker", "type"),
    "kvroute_index_dropped": ("worker", "reason"),
    "kvroute_index_gaps": ("worker",),
    "kvroute_index_replays": ("worker", "outcome"),
    "kvroute_index_replay_resumes": ("worker",),
    "kvroute_index_purges": ("worker", "reason"),
    "kvroute_index_blocks": ("worker",),
    "kvroute_index_event_lag_seconds": ("worker",),
    "kvroute_index_lookup_seconds": ("backend",),
    "kvroute_index_backend_up": ("backend",),
    "kvroute_index_backend_errors": ("backend", "op"),
    # Added by the hardening (new families only; the ones above are unchanged).
    "kvroute_index_evicted_blocks": ("backend",),
    "kvroute_index_reconciliations": ("worker", "outcome"),
    "kvroute_index_resyncs": ("worker", "reason"),
    "kvroute_index_stream_disconnects": ("worker",),
    # A reset or restart seen outside the event stream (vLLM 0.33 edge, issue 15).
    "kvroute_index_doubts": ("worker", "reason"),
}


def test_families_keep_their_names_and_labels() -> None:
    metrics = IndexerMetrics()
    kinds = {family.name: family.type for family in metrics.registry.collect()}
    assert set(kinds) == set(FAMILIES)
    wrappers = [m for m in vars(metrics).values() if isinstance(m, Counter | Gauge | Histogram)]
    assert len(wrappers) == len(FAMILIES)
    for wrapper in wrappers:
        name = wrapper.describe()[0].name
        wrapper.labels(**dict.fromkeys(FAMILIES[name], "x"))  # raises unless the label names are exactly these
    assert kinds["kvroute_index_lookup_seconds"] == "histogram"
    assert kinds["kvroute_index_blocks"] == kinds["kvroute_index_backend_up"] == "gauge"
    assert kinds["kvroute_index_events_received"] == "counter"


async def test_an_indexer_counts_on_the_registry_it_is_given() -> None:
    registry = CollectorRegistry()
    indexer = KVIndexer(MemoryIndex(), metrics=IndexerMetrics(registry))
    indexer.register_worker("iso", "m")
    chain = Chain()
    await indexer.handle_message("iso", frames([chain.store(PROMPT)], 0))
    await indexer.handle_message("iso", frames([chain.store(PROMPT)], 3))  # a gap: purged, applied afresh
    await indexer.handle_message("iso", frames([AllBlocksCleared()], 4))
    await indexer.lookup_tokens("m", PROMPT)
    indexer.count_drop("iso", "unknown_topic")

    def value(name: str, **labels: str) -> float | None:
        return registry.get_sample_value(name, labels)

    assert value("kvroute_index_events_received_total", worker="iso", type="BlockStored") == 2
    assert value("kvroute_index_events_applied_total", worker="iso", type="AllBlocksCleared") == 1
    assert value("kvroute_index_gaps_total", worker="iso") == 1
    assert value("kvroute_index_purges_total", worker="iso", reason="gap") == 1
    assert value("kvroute_index_purges_total", worker="iso", reason="all_blocks_cleared") == 1
    assert value("kvroute_index_dropped_total", worker="iso", reason="unknown_topic") == 1
    assert value("kvroute_index_blocks", worker="iso") == 0
    assert value("kvroute_index_lookup_seconds_count", backend="memory") == 1
    assert value("kvroute_index_backend_up", backend="memory") == 1
    # Nothing of it reached the default registry.
    assert (
        REGISTRY.get_sample_value("kvroute_index_events_received_total", {"worker": "iso", "type": "BlockStored"})
        is None
    )


async def test_defaults_share_the_default_registry(zctx: zmq.asyncio.Context) -> None:
    first, second = KVIndexer(MemoryIndex()), KVIndexer(MemoryIndex())
    assert first.metrics is second.metrics is default_metrics()
    assert default_metrics().registry is REGISTRY
    assert EventSubscriber(first, ctx=zctx).metrics is first.metrics
    own = IndexerMetrics()
    assert EventSubscriber(first, ctx=zctx, metrics=own).metrics is own
    first.register_worker("dflt", "m")
    await first.handle_message("dflt", frames([Chain().store(PROMPT)], 0))
    text = generate_latest(REGISTRY).decode()
    assert 'kvroute_index_blocks{worker="dflt"} 4.0' in text

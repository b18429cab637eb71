"""What the admin page and ``/admin/index/stats`` show: per entity, from the local views, plus what the
backend knows of entities this process does not follow (a reader of a shared index sees only those).

Read-only, off the hot path, and O(entities): block counts come from counters maintained on every change
(the entities' ``EntityState.counts``, the memory backend's per-worker counters, Redis' ``counts`` hash),
never from a walk of the blocks (at a million blocks a walk took tens of seconds of the event loop).
"""

from __future__ import annotations

import time
from typing import Any

from kvroute.indexer.backend import IndexUnavailable
from kvroute.indexer.bitsets import named_counts
from kvroute.indexer.entities import Entity, Registry, split_entity
from kvroute.indexer.mirror import BackendMirror

#: One entity's or the whole index's row, as JSON.
Row = dict[str, Any]


def entity_row(ent: Entity, now: float) -> Row:
    seq = ent.seq
    return {
        "id": ent.id,
        "worker": ent.worker_id,
        "dp_rank": ent.rank,
        "model": ent.model.name,
        "blocks": len(ent.state.bits),
        "by_tier": named_counts(ent.state.counts),
        "events": ent.events,
        "events_per_s": round(ent.rate.per_second(), 2),
        "batches": ent.batches,
        "last_seq": seq.last_seq,
        "gaps": seq.gaps,
        "replays": seq.replays,
        "purges": ent.purges,
        "dropped": ent.dropped,
        "seconds_since_last_event": None if ent.last_event is None else round(now - ent.last_event, 3),
        "lag_s": None if ent.last_lag is None else round(ent.last_lag, 4),
    }


class IndexStats:
    """Snapshots of one indexer for people (admin API, dashboards)."""

    def __init__(self, registry: Registry, mirror: BackendMirror) -> None:
        self.registry = registry
        self.mirror = mirror

    async def stats(self) -> Row:
        registry = self.registry
        backend = self.mirror.backend
        now = time.time()
        entities = {e.id: entity_row(e, now) for e in registry.entities.values()}
        backend_ok = not self.mirror.dirty
        try:
            for row in await backend.worker_stats():
                if row.worker_id not in entities:
                    worker_id, rank = split_entity(row.worker_id)
                    entities[row.worker_id] = {
                        "id": row.worker_id,
                        "worker": worker_id,
                        "dp_rank": rank,
                        "model": row.model,
                        "blocks": row.blocks,
                        "by_tier": row.by_tier,
                        "source": "backend",
                    }
        except IndexUnavailable:
            backend_ok = False
        for worker in registry.workers.values():
            if not any(e["worker"] == worker.id for e in entities.values()):
                entities[worker.id] = {
                    "id": worker.id,
                    "worker": worker.id,
                    "dp_rank": 0,
                    "model": worker.model,
                    "blocks": 0,
                    "by_tier": {},
                    "events": 0,
                    "seconds_since_last_event": None,
                }
        return {
            "backend": backend.name,
            "backend_ok": backend_ok,
            "block_sizes": {m: info.block_size for m, info in registry.models.items()},
            "blocks": sum(e["blocks"] for e in entities.values()),
            "events_per_s": round(sum(e.get("events_per_s", 0.0) for e in entities.values()), 2),
            "gaps": sum(e.get("gaps", 0) for e in entities.values()),
            "replays": sum(e.get("replays", 0) for e in entities.values()),
            "purges": registry.purges_total,
            "workers": sorted(entities.values(), key=lambda e: e["id"]),
        }

    async def worker_info(self, worker_id: str) -> Row | None:
        now = time.time()
        ranks = [entity_row(e, now) for e in self.registry.entities.values() if e.worker_id == worker_id]
        if not ranks:
            stats = await self.stats()  # a worker this process does not follow: what the backend knows
            ranks = [e for e in stats["workers"] if e["worker"] == worker_id or e["id"] == worker_id]
        if not ranks:
            return None
        ranks.sort(key=lambda e: e["id"])
        return {"worker": worker_id, "ranks": ranks, "blocks": sum(e["blocks"] for e in ranks)}

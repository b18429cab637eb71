"""The indexer: messages from workers in, an exact prefix index out.

:class:`KVIndexer` is the one object the router, the stand-alone indexer process and the tests hold. It
composes parts with one job each and only forwards to them:

- :class:`~kvroute.indexer.entities.Registry`: models, workers, their data-parallel ranks (entities);
- :class:`~kvroute.indexer.handler.MessageHandler`: messages in, sequence verdicts, local views, purges;
- :class:`~kvroute.indexer.mirror.BackendMirror`: writes to the backend, batching, failure, recovery;
- :class:`~kvroute.indexer.lookup.IndexLookup`: tokens -> keys -> per-entity matches;
- :class:`~kvroute.indexer.stats.IndexStats`: what the admin API shows;
- :class:`~kvroute.indexer.maintenance.IndexMaintenance`: the periodic upkeep, once started.

Data-parallel ranks are indexed as their own entities: rank 0 keeps the worker id (``w``), rank n>0
is ``w#n`` (each rank has its own cache and its own sequence counter).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any

from kvroute.indexer.backend import IndexBackend, IndexUnavailable, WorkerMatch
from kvroute.indexer.entities import Entity, Registry, entity_id, split_entity
from kvroute.indexer.events import EventBatch
from kvroute.indexer.handler import LOG_INTERVAL_S, MessageHandler
from kvroute.indexer.ingest import ModelInfo
from kvroute.indexer.lookup import IndexLookup, LookupResult
from kvroute.indexer.maintenance import IndexMaintenance
from kvroute.indexer.metrics import IndexerMetrics, default_metrics
from kvroute.indexer.mirror import RECOVER_INTERVAL_S, BackendMirror
from kvroute.indexer.sequencing import GapPolicy, Handled, Outcome
from kvroute.indexer.stats import IndexStats

#: The longest a worker's entries stay doubtful without events from it (seconds): a reset that never
#: happened (the engine refused it) or an engine left idle must not keep it out of KV routing for good.
DOUBT_MAX_S = 120.0

__all__ = [
    "DOUBT_MAX_S",
    "LOG_INTERVAL_S",
    "RECOVER_INTERVAL_S",
    "GapPolicy",
    "Handled",
    "KVIndexer",
    "LookupResult",
    "Outcome",
    "entity_id",
    "split_entity",
]


class KVIndexer:
    """Per-worker event state machine in front of an :class:`IndexBackend`.

    ``metrics`` defaults to the process-wide instance on prometheus' default registry (what the
    router's ``/metrics`` renders besides its own registry); pass ``IndexerMetrics(registry)`` to count
    on a registry of your own.
    """

    def __init__(
        self,
        backend: IndexBackend,
        block_sizes: dict[str, int] | None = None,
        metrics: IndexerMetrics | None = None,
    ) -> None:
        self.backend = backend
        self.metrics = metrics if metrics is not None else default_metrics()
        self.registry = Registry(self.metrics, block_sizes)
        self.mirror = BackendMirror(backend, self.registry, self.metrics)
        self.handler = MessageHandler(self.registry, self.mirror, self.metrics)
        self.lookups = IndexLookup(backend, self.registry, self.metrics)
        self.inspector = IndexStats(self.registry, self.mirror)
        self.maintenance: IndexMaintenance | None = None
        evicted = self.metrics.evicted_blocks.labels(backend.name)
        backend.on_evict = evicted.inc

    # ---- models and workers --------------------------------------------------------------------

    def model_info(self, model: str) -> ModelInfo:
        return self.registry.model_info(model)

    def block_size(self, model: str) -> int | None:
        return self.registry.block_size(model)

    def check_block_size(self, model: str, block_size: int, source: str = "vllm:cache_config_info") -> bool:
        """Cross-check a block size reported elsewhere; adopt it when none is known. False = mismatch."""
        return self.registry.check_block_size(model, block_size, source)

    def register_worker(self, worker_id: str, model: str, dp_size: int = 1) -> None:
        """Events do not name the model: the worker's configured model is used for all its ranks."""
        self.registry.register(worker_id, model, dp_size)

    async def unregister_worker(self, worker_id: str) -> None:
        await self.handler.purge_worker(worker_id, "removed")
        self.registry.forget(worker_id)

    def workers(self) -> list[str]:
        return list(self.registry.workers)

    def mark_down(self, worker_id: str) -> None:
        """The worker stopped answering (health checks, lost connection): purge it after a grace period."""
        self.registry.mark_down(worker_id)

    def mark_up(self, worker_id: str) -> None:
        self.registry.mark_up(worker_id)

    def doubt_worker(self, worker_id: str, reason: str = "reset", max_s: float = DOUBT_MAX_S) -> None:
        """The worker's cache was reset or lost (seen outside its events: a restarted engine's counters, an
        operator's word): leave its entries out of lookups until its next events arrive — vLLM publishes
        ``AllBlocksCleared`` only at its next engine step — or ``max_s`` passed. Purges end it too."""
        if not worker_id:
            return
        for ident in self.registry.doubt(worker_id, time.monotonic() + max_s):
            self.metrics.doubts.labels(ident, reason).inc()

    @property
    def purges_total(self) -> int:
        return self.registry.purges_total

    # ---- messages ------------------------------------------------------------------------------

    async def handle_message(
        self, worker_id: str, frames: Sequence[bytes], *, on_gap: GapPolicy = "purge", replay: bool = False
    ) -> Handled:
        """Decode, sequence-check and apply one ZMQ message ``[topic, seq, payload]`` from a worker.

        ``on_gap="report"`` returns ``"gap"`` without applying, so the caller can replay first.
        ``replay=True`` marks messages coming from the worker's replay socket.
        """
        return await self.handler.handle_message(worker_id, frames, on_gap, replay)

    async def apply_batch(self, ent: Entity, batch: EventBatch) -> None:
        """Apply one decoded batch to an entity's local view, then mirror it into the backend."""
        await self.handler.apply_batch(ent, batch)

    def count_drop(self, worker_id: str, reason: str, detail: str = "") -> Handled:
        """Count and (rate-limited) log a message dropped before it reached a worker's state."""
        return self.handler.count_drop(worker_id, reason, detail)

    def prime_catch_up(self, worker_id: str, dp_rank: int = 0) -> bool:
        """Before any message of this rank was seen: expect sequence 0, so a replay starts there.
        False when the rank already has a position (nothing to catch up)."""
        ent = self.registry.entity(worker_id, dp_rank)
        return ent is not None and ent.seq.prime()

    def expected_seq(self, worker_id: str, dp_rank: int = 0) -> int | None:
        ent = self.registry.find(worker_id, dp_rank)
        return None if ent is None else ent.seq.expected()

    def dp_size(self, worker_id: str) -> int:
        """How many data-parallel ranks the worker was registered (or discovered) with; 0 when unknown."""
        worker = self.registry.workers.get(worker_id)
        return 0 if worker is None else worker.dp_size

    async def resync(self, worker_id: str, dp_rank: int, reason: str) -> bool:
        """Purge one rank and expect sequence 0, so that a replay from 0 (the caller's) re-learns it.
        False when the rank is unknown."""
        ent = self.registry.entity(worker_id, dp_rank)
        if ent is None:
            return False
        await self.handler.resync_entity(ent, reason)
        self.metrics.resyncs.labels(ent.id, reason).inc()
        return True

    def indexed_blocks(self, worker_id: str, dp_rank: int = 0, tier: int | None = None) -> int | None:
        """Blocks the local view of one rank holds (in ``tier``'s bit, or any tier); None when unknown.
        O(1): the counters are maintained on every change."""
        ent = self.registry.find(worker_id, dp_rank)
        if ent is None:
            return None
        state = ent.state
        return len(state.bits) if tier is None else state.counts.get(tier, 0)

    def begin_replay(self, worker_id: str, dp_rank: int, start: int) -> None:
        """Live messages queued behind a replay from ``start`` are overlap, not an engine restart."""
        ent = self.registry.find(worker_id, dp_rank)
        if ent is not None:
            ent.seq.begin_replay(start)

    def batched(self) -> AbstractAsyncContextManager[None]:
        """Handle several messages with one backend write per entity (the subscriber drains its
        socket this way: Redis round trips are paid per burst, not per batch)."""
        return self.mirror.batched()

    async def flush(self) -> None:
        """Write what :meth:`batched` has deferred so far."""
        await self.mirror.flush()

    # ---- purges --------------------------------------------------------------------------------

    async def purge_worker(self, worker_id: str, reason: str = "admin") -> int:
        """Forget all blocks of every rank of a worker; sequence tracking goes on. Returns entities purged.
        Raises IndexUnavailable for a worker not followed here whose purge the backend refused."""
        return await self.handler.purge_worker(worker_id, reason)

    async def purge_gone(self, grace_s: float) -> list[str]:
        """Purge the workers down for longer than ``grace_s`` (each once); returns their ids."""
        return await self.handler.purge_gone(grace_s)

    # ---- backend health ------------------------------------------------------------------------

    @property
    def backend_ok(self) -> bool:
        return not self.mirror.dirty

    def mark_backend_down(self, reason: str) -> None:
        """Treat the backend as failed: writes wait, and everything is rewritten once it answers."""
        self.mirror.failed("ping", IndexUnavailable(reason))

    async def recover(self, force: bool = False) -> bool:
        """Rewrite every entity into a backend that failed, once it answers again. True when healthy."""
        return await self.mirror.recover(force)

    async def refresh(self) -> None:
        """Re-store every entity's blocks: renews TTLs of long-lived blocks, restores any lost entry."""
        await self.mirror.refresh()

    # ---- maintenance ---------------------------------------------------------------------------

    def make_maintenance(self, grace_s: float = 30.0, refresh_s: float | None = None) -> IndexMaintenance:
        """Arrange the periodic upkeep (purge of workers down past ``grace_s``, backend recovery, a TTL refresh
        every ``refresh_s``) without starting it: a composition root adds the returned service to those its
        app starts and stops. While one runs, that one is returned unchanged."""
        if self.maintenance is None or not self.maintenance.running:
            self.maintenance = IndexMaintenance(self, grace_s, refresh_s)
        return self.maintenance

    def start_maintenance(self, grace_s: float = 30.0, refresh_s: float | None = None) -> IndexMaintenance:
        """Arrange the upkeep (or take the one arranged already, with its settings) and start it in the
        running loop. Stop it with :meth:`stop_maintenance`."""
        maintenance = self.maintenance or self.make_maintenance(grace_s, refresh_s)
        maintenance.launch()
        return maintenance

    async def stop_maintenance(self) -> None:
        """Stop the upkeep and forget it (bounded even when a Redis call dropped the cancellation)."""
        maintenance, self.maintenance = self.maintenance, None
        if maintenance is not None:
            await maintenance.stop()

    # ---- lookups -------------------------------------------------------------------------------

    def request_keys(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[int | None, list[int]]:
        return self.lookups.request_keys(model, token_ids, lora_name, cache_salt)

    async def lookup_tokens(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> LookupResult:
        """Per worker entity, how much of this prompt's prefix it holds. Raises IndexUnavailable."""
        return await self.lookups.lookup_tokens(model, token_ids, lora_name, cache_salt)

    async def lookup_keys(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        return await self.lookups.lookup_keys(model, keys)

    # ---- inspection ----------------------------------------------------------------------------

    async def stats(self) -> dict[str, Any]:
        """Everything the admin page and ``/admin/index/stats`` show."""
        return await self.inspector.stats()

    async def worker_info(self, worker_id: str) -> dict[str, Any] | None:
        """One worker (all its ranks), or None when unknown."""
        return await self.inspector.worker_info(worker_id)

"""One worker message in: decode, sequence verdict, local view updated, backend mirrored, all counted.

This is the ingestion path (``bench/indexer.py`` measures it). It never blocks: decoding
(:mod:`~kvroute.indexer.fastdecode`) and translation to index ops (:mod:`~kvroute.indexer.ingest`) are
pure CPU work per batch, the backend write is the only await. Purges live here too: they are what a
message (engine restart, unrecoverable gap, ``AllBlocksCleared``), an operator or a worker gone for
good does to an entity's local view and its backend entries.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvroute.indexer.entities import Entity, Registry
from kvroute.indexer.events import EventBatch, EventDecodeError, decode_seq
from kvroute.indexer.fastdecode import decode_batch_fast
from kvroute.indexer.ingest import group_table, translate
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.mirror import BackendMirror
from kvroute.indexer.sequencing import APPLY, GapPolicy, Handled
from kvroute.logs import RateLimitedLog

log = logging.getLogger("kvroute.indexer")

#: How often one worker's bad input of one kind is logged (seconds).
LOG_INTERVAL_S = 60.0

_DROPPED = Handled("dropped")


class MessageHandler:
    """Applies workers' messages to the registry's entities and mirrors them through ``mirror``."""

    def __init__(self, registry: Registry, mirror: BackendMirror, metrics: IndexerMetrics) -> None:
        self.registry = registry
        self.mirror = mirror
        self.metrics = metrics
        #: Every per-message line goes through this (a hostile publisher cannot flood the log).
        self.rlog = RateLimitedLog(log, LOG_INTERVAL_S)

    def count_drop(self, worker_id: str, reason: str, detail: str = "") -> Handled:
        """Count and (rate-limited) log a message dropped before it reached a worker's state."""
        self.metrics.dropped.labels(worker_id, reason).inc()
        self.rlog.warning(
            f"{worker_id}\0{reason}", "worker %s: dropped a message (%s) %s", worker_id, reason, detail[:200]
        )
        return _DROPPED

    async def handle_message(self, worker_id: str, frames: Sequence[bytes], on_gap: GapPolicy, replay: bool) -> Handled:
        if len(frames) != 3:
            return self.count_drop(worker_id, "bad_frames", f"{len(frames)} frames")
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch_fast(frames[2])
        except EventDecodeError as exc:
            return self.count_drop(worker_id, exc.reason, str(exc))
        rank = batch.dp_rank
        ent = self.registry.entity(worker_id, rank)
        if ent is None:
            if worker_id in self.registry.workers:  # a rank beyond the worker's dp_size: never an entity
                return self.count_drop(worker_id, "unknown_rank", f"data_parallel_rank {rank}")
            return self.count_drop(worker_id, "unknown_worker")
        verdict = ent.seq.check(seq, batch.ts, on_gap, replay)
        if verdict is not APPLY:  # APPLY has taken the new position already
            if verdict.gap:
                ent.metrics.gap()
            if not verdict.apply:
                return Handled(verdict.outcome, rank, seq)
            if verdict.purge is not None:
                await self.purge_entity(ent, verdict.purge)
            ent.seq.commit(seq, batch.ts, replay)
        await self.apply_batch(ent, batch)
        return Handled(verdict.outcome, rank, seq)

    async def apply_batch(self, ent: Entity, batch: EventBatch) -> None:
        """Apply one decoded batch to an entity's local view, then mirror it into the backend."""
        now = time.time()
        lag = max(0.0, now - batch.ts)
        ent.last_event = now
        ent.last_lag = lag
        ent.batches += 1
        n = len(batch.events)
        if batch.folds:  # removals folded by the decoder still count one by one
            n += sum(batch.folds.values()) - len(batch.folds)
        ent.events += n
        ent.rate.add(n)
        metrics = ent.metrics
        if batch.skipped:
            metrics.dropped("unknown_event_type", batch.skipped)
        mirror = self.mirror
        async with mirror.lock:
            result = translate(ent.state, ent.model, batch)
            if result.ops:
                await mirror.submit_locked(ent.model, ent.id, result.ops)
            for idx, group_ops in result.groups.items():
                if group_ops.ops:
                    await mirror.submit_locked(ent.model, ent.id, group_ops.ops, group_table(ent.model.name, idx))
        if self.registry.doubtful:
            self.registry.lift(ent.id)  # events after a reset seen elsewhere: the view is the engine's again
        for kind, count in result.received.items():
            metrics.received(kind, count)
        for kind, count in result.applied.items():
            metrics.applied(kind, count)
        for reason, count in result.dropped.items():
            metrics.dropped(reason, count)
            ent.dropped += count
        if result.cleared:
            self._count_purge(ent, "all_blocks_cleared")
        metrics.set_lag(lag)
        metrics.set_blocks(len(ent.state.bits))
        if mirror.dirty:
            await mirror.recover()

    # ---- purges --------------------------------------------------------------------------------

    def _count_purge(self, ent: Entity, reason: str) -> None:
        ent.purges += 1
        self.registry.purges_total += 1
        ent.metrics.purged(reason)

    async def purge_entity(self, ent: Entity, reason: str) -> None:
        self.rlog.log(logging.INFO, f"{ent.id}\0purge\0{reason}", "purging %s (%s)", ent.id, reason)
        ent.state.clear()
        self.registry.lift(ent.id)
        self._count_purge(ent, reason)
        ent.metrics.set_blocks(0)
        await self.mirror.purge(ent.id)

    async def resync_entity(self, ent: Entity, reason: str) -> None:
        """Purge the entity and expect sequence 0: a replay from 0 (the caller's) re-learns it."""
        await self.purge_entity(ent, reason)
        ent.seq.restart_from_zero()

    async def purge_worker(self, worker_id: str, reason: str) -> int:
        ents = list(self.registry.of_worker(worker_id))
        for ent in ents:
            await self.purge_entity(ent, reason)
        if not ents:
            # Not subscribed here (a reader of a shared Redis index): purge by id in the backend.
            await self.mirror.purge_unknown(worker_id)
        return len(ents)

    async def purge_gone(self, grace_s: float) -> list[str]:
        registry = self.registry
        gone = registry.down_longer_than(grace_s)
        for worker_id in gone:
            await self.purge_worker(worker_id, "worker_gone")
            registry.workers[worker_id].down_since = None
            for ent in registry.of_worker(worker_id):
                ent.seq.forget()
        return gone

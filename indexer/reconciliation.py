"""Reconciliation: each rank's index count checked against the engine's own, a diverged one resynced.

The engine's count comes from ``engine_blocks`` (:class:`EngineBlockCounts`, the router implements it
from vLLM's ``/metrics``; the indexer has no HTTP). A rank off by more than the tolerance on
:data:`RECONCILE_CHECKS` rounds in a row is purged and re-learnt from its replay buffer, as a replay job.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable
from typing import Protocol

from kvroute.indexer.entities import entity_id
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.replays import Feed, Replays
from kvroute.indexer.service import KVIndexer
from kvroute.logs import RateLimitedLog
from kvroute.tasks import raise_if_cancel_swallowed
from kvroute.vocabulary import Tier

#: Reconciliation: a rank whose index count differs from the engine's by more than
#: ``max(self.reconcile_tolerance, RECONCILE_REL_TOLERANCE * engine)`` on two checks in a row is resynced.
RECONCILE_ABS_TOLERANCE = 8
RECONCILE_REL_TOLERANCE = 0.1
RECONCILE_CHECKS = 2


class EngineBlockCounts(Protocol):
    """The engine's own count of cached (hashed, prefix-cache) GPU blocks of one data-parallel rank, or None
    when it cannot tell now. The router implements it from vLLM's ``/metrics``; the indexer has no HTTP."""

    def __call__(self, worker_id: str, dp_rank: int) -> Awaitable[int | None]: ...


class Reconciler:
    """The subscriber's reconciliation rounds over its ``feeds`` (shared with its :class:`Replays`)."""

    def __init__(
        self,
        indexer: KVIndexer,
        feeds: dict[str, Feed],
        replays: Replays,
        *,
        engine_blocks: EngineBlockCounts | None,
        metrics: IndexerMetrics,
        rlog: RateLimitedLog,
        reconcile_s: float | None = None,
        reconcile_tolerance: int = RECONCILE_ABS_TOLERANCE,
        replay_timeout_s: float = 2.0,
    ) -> None:
        self.indexer = indexer
        self.feeds = feeds
        self.replays = replays
        self.engine_blocks = engine_blocks
        self.metrics = metrics
        self.rlog = rlog
        self.reconcile_s = reconcile_s
        self.reconcile_tolerance = reconcile_tolerance
        self.replay_timeout_s = replay_timeout_s

    async def loop(self) -> None:
        assert self.reconcile_s
        while True:
            raise_if_cancel_swallowed()
            await asyncio.sleep(self.reconcile_s)
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception:
                self.rlog.error("reconcile", "index reconciliation failed; retrying", exc_info=True)

    async def reconcile(self) -> None:
        """One round: per rank, the index's GPU block count against the engine's (``engine_blocks``). A rank
        off by more than the tolerance on :data:`RECONCILE_CHECKS` rounds in a row is resynced (purge, replay
        from 0) when its worker has a replay endpoint; without one it is counted ``diverged``."""
        counts = self.engine_blocks
        if counts is None:
            return
        gpu = int(Tier.GPU)
        for feed in list(self.feeds.values()):
            spec = feed.spec
            if feed.job is not None:
                continue  # a replay is under way: the counts are in motion
            for rank in range(self.indexer.dp_size(spec.worker_id)):
                entity = entity_id(spec.worker_id, rank)
                try:
                    async with asyncio.timeout(max(self.replay_timeout_s, 1.0)):
                        engine = await counts(spec.worker_id, rank)
                except asyncio.CancelledError:
                    raise
                except Exception:
                    engine = None
                if engine is None:
                    self.metrics.reconciliations.labels(entity, "error").inc()
                    continue
                indexed = self.indexer.indexed_blocks(spec.worker_id, rank, gpu) or 0
                if abs(indexed - engine) <= max(self.reconcile_tolerance, RECONCILE_REL_TOLERANCE * engine):
                    feed.diverged.pop(rank, None)
                    self.metrics.reconciliations.labels(entity, "ok").inc()
                    continue
                seen = feed.diverged[rank] = feed.diverged.get(rank, 0) + 1
                if seen < RECONCILE_CHECKS or spec.replay is None:
                    self.metrics.reconciliations.labels(entity, "diverged").inc()
                    continue
                feed.diverged.pop(rank, None)
                self.metrics.reconciliations.labels(entity, "resynced").inc()
                self.rlog.warning(
                    f"{entity}\0reconcile",
                    "worker %s: index holds %d GPU blocks, the engine %d: resyncing from its replay buffer",
                    entity,
                    indexed,
                    engine,
                )
                self.replays.start_job(feed, functools.partial(self.replays.full_resync, spec, rank, "reconcile"))

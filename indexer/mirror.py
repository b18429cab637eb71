"""Keeping the backend a mirror of the entities' local views, through backend failures.

Every change to a local view is written to the backend under one lock (a recovery rewrite must not
interleave with a batch's write). Inside :meth:`BackendMirror.batched` writes are deferred per entity
and go out together, so Redis round trips are paid per burst of messages, not per message. When the
backend fails (Redis down), writes stop, the local views keep being updated, and the whole index is
rewritten from them once the backend answers again: a restarted, empty Redis heals without waiting
for the workers to resend anything.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator

from kvroute.indexer.backend import IndexBackend, IndexOp, IndexUnavailable
from kvroute.indexer.entities import Registry
from kvroute.indexer.ingest import ModelInfo, group_table
from kvroute.indexer.metrics import IndexerMetrics

log = logging.getLogger("kvroute.indexer")

#: How often a failed backend is retried (seconds).
RECOVER_INTERVAL_S = 1.0


class BackendMirror:
    """Writes, deferred writes, failure state and recovery of one indexer's backend."""

    def __init__(self, backend: IndexBackend, registry: Registry, metrics: IndexerMetrics) -> None:
        self.backend = backend
        self.registry = registry
        self.metrics = metrics
        #: True while the backend is failing: nothing is written until :meth:`recover` rewrote it all.
        self.dirty = False
        #: Earliest time (monotonic) of the next recovery attempt.
        self.next_recover = 0.0
        #: Orders local-view changes and their backend writes.
        self.lock = asyncio.Lock()
        #: Inside :meth:`batched`: writes wait here (per table and entity, in order) and go out together.
        self._deferring = 0
        self._pending: dict[tuple[str, str], list[IndexOp]] = {}
        metrics.backend_up.labels(backend.name).set(1)

    # ---- writes --------------------------------------------------------------------------------

    async def submit_locked(self, model: ModelInfo, entity: str, ops: list[IndexOp], table: str | None = None) -> None:
        """Mirror one batch's ops (the caller holds :attr:`lock`): now, or at the end of the burst.
        ``table``: one of the model's other KV-cache groups' tables instead of its own."""
        if self.dirty:
            return  # rewritten from the local views on recovery
        name = table or model.name
        if self._deferring:
            self._pending.setdefault((name, entity), []).extend(ops)
            return
        try:
            await self.backend.apply(name, entity, ops)
        except IndexUnavailable as exc:
            self.failed("apply", exc)
        await self._publish_meta(model)

    async def _publish_meta(self, model: ModelInfo) -> None:
        """Readers of a shared index learn block sizes, lookahead and KV-cache groups from the writer."""
        if model.published or not model.block_size or self.dirty:
            return
        try:
            await self.backend.set_model_meta(model.name, model.meta())
            model.published = True
        except IndexUnavailable as exc:
            self.failed("apply", exc)

    async def _flush_locked(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending or self.dirty:
            return  # when dirty, everything is rewritten from the local views on recovery
        try:
            await self.backend.apply_many([(table, entity, ops) for (table, entity), ops in pending.items()])
        except IndexUnavailable as exc:
            self.failed("apply", exc)
            return
        for table in {table for table, _ in pending}:
            info = self.registry.models.get(table)  # a group's table has no model record of its own
            if info is not None:
                await self._publish_meta(info)

    async def flush(self) -> None:
        """Write what :meth:`batched` has deferred so far."""
        if self._pending:
            async with self.lock:
                await self._flush_locked()

    @contextlib.asynccontextmanager
    async def batched(self) -> AsyncIterator[None]:
        """Several messages, one backend write per entity (nestable; the outermost one flushes)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring:
                await self.flush()

    async def purge(self, entity: str) -> None:
        """Drop a known entity's entries (after what was deferred for it, in order)."""
        async with self.lock:
            await self._flush_locked()
            if self.dirty:
                return
            try:
                await self.backend.purge_worker(entity)
            except IndexUnavailable as exc:
                self.failed("purge", exc)

    async def purge_unknown(self, worker_id: str) -> None:
        """Drop entries of a worker this indexer does not follow (a reader of a shared index). Raises
        :class:`IndexUnavailable`: there is no local view to rewrite it from later."""
        try:
            await self.backend.purge_worker(worker_id)
        except IndexUnavailable as exc:
            self.failed("purge", exc)
            raise

    # ---- failure and recovery ------------------------------------------------------------------

    def failed(self, op: str, exc: Exception) -> None:
        """The backend failed ``op``: stop writing, retry after :data:`RECOVER_INTERVAL_S`."""
        name = self.backend.name
        if not self.dirty:
            log.error("index backend %s unavailable (%s): keeping local views, will rewrite on recovery", name, exc)
        self.metrics.backend_errors.labels(name, op).inc()
        self.metrics.backend_up.labels(name).set(0)
        self.dirty = True
        self.next_recover = time.monotonic() + RECOVER_INTERVAL_S

    async def recover(self, force: bool = False) -> bool:
        """Rewrite every entity into a backend that failed, once it answers again. True when healthy."""
        if not self.dirty:
            return True
        if not force and time.monotonic() < self.next_recover:
            return False
        registry = self.registry
        async with self.lock:
            self._pending.clear()  # the snapshots below include everything deferred
            try:
                for ent in list(registry.entities.values()):
                    await self.backend.apply(ent.model.name, ent.id, ent.state.snapshot_ops())
                    for idx, ops in ent.state.group_snapshots(ent.model.side_groups).items():
                        await self.backend.apply(group_table(ent.model.name, idx), ent.id, ops)
                for info in registry.models.values():
                    if info.block_size and info.published:
                        await self.backend.set_model_meta(info.name, info.meta())
            except IndexUnavailable as exc:
                self.failed("recover", exc)
                return False
        self.dirty = False
        self.metrics.backend_up.labels(self.backend.name).set(1)
        log.warning("index backend %s is back: %d workers rewritten", self.backend.name, len(registry.entities))
        return True

    async def refresh(self) -> None:
        """Re-store every entity's blocks: renews TTLs of long-lived blocks, restores any lost entry."""
        if self.dirty:
            return
        async with self.lock:
            await self._flush_locked()
            try:
                for ent in list(self.registry.entities.values()):
                    ops = ent.state.snapshot_ops()[1:]
                    if ops:
                        await self.backend.apply(ent.model.name, ent.id, ops)
                    for idx, group in ent.state.group_snapshots(ent.model.side_groups).items():
                        if group[1:]:
                            await self.backend.apply(group_table(ent.model.name, idx), ent.id, group[1:])
            except IndexUnavailable as exc:
                self.failed("refresh", exc)

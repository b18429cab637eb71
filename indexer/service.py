"""The indexer: messages from workers in, an exact prefix index out.

:class:`KVIndexer` owns what is per worker (the configured model, each data-parallel rank's sequence
counter and local view) and drives a backend. It never blocks: decoding and key computation are
pure CPU work per batch, the backend call is the only await. When the backend fails (Redis down),
the local views keep being updated and every entity is rewritten once the backend answers again, so
a Redis restart heals without waiting for the workers to resend anything.

Data-parallel ranks are indexed as their own entities: rank 0 keeps the worker id (``w``), rank n>0
is ``w#n`` (each rank has its own cache and its own sequence counter).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from kvroute.indexer import metrics
from kvroute.indexer.backend import IndexBackend, IndexUnavailable, WorkerMatch
from kvroute.indexer.bitsets import tier_counts
from kvroute.indexer.events import EventBatch, EventDecodeError, decode_seq
from kvroute.indexer.fastdecode import decode_batch_fast
from kvroute.indexer.ingest import EntityState, ModelInfo, translate
from kvroute.indexer.keys import request_keys

log = logging.getLogger("kvroute.indexer")

Outcome = Literal["applied", "duplicate", "gap", "restart", "resync", "dropped"]
GapPolicy = Literal["report", "purge"]


class Handled(NamedTuple):
    """What became of one message; ``dp_rank``/``seq`` are None when it could not be decoded."""

    outcome: Outcome
    dp_rank: int | None = None
    seq: int | None = None


#: How often a failed backend is retried (seconds) and how often a worker's bad input is logged.
RECOVER_INTERVAL_S = 1.0
LOG_INTERVAL_S = 60.0


def entity_id(worker_id: str, dp_rank: int) -> str:
    """The index identity of one data-parallel rank of a worker."""
    return worker_id if dp_rank == 0 else f"{worker_id}#{dp_rank}"


def split_entity(entity: str) -> tuple[str, int]:
    """Inverse of :func:`entity_id`."""
    worker, sep, rank = entity.rpartition("#")
    if sep and rank.isdigit():
        return worker, int(rank)
    return entity, 0


@dataclass(slots=True)
class LookupResult:
    """A request's prefix as the index sees it."""

    model: str
    block_size: int | None
    num_blocks: int
    matches: dict[str, WorkerMatch] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)


class _Rate:
    """Events per second over the last few seconds, in one-second buckets (cheap to update)."""

    __slots__ = ("buckets", "current", "second")
    WINDOW = 10

    def __init__(self) -> None:
        self.second = int(time.monotonic())
        self.current = 0
        self.buckets: list[tuple[int, int]] = []

    def add(self, n: int) -> None:
        now = int(time.monotonic())
        if now != self.second:
            self.buckets.append((self.second, self.current))
            self.buckets = [b for b in self.buckets if b[0] > now - self.WINDOW]
            self.second, self.current = now, 0
        self.current += n

    def per_second(self) -> float:
        now = int(time.monotonic())
        total = sum(n for second, n in self.buckets if second > now - self.WINDOW)
        if self.second > now - self.WINDOW:
            total += self.current
        return total / self.WINDOW


@dataclass(slots=True)
class _Entity:
    id: str
    worker_id: str
    rank: int
    model: ModelInfo
    state: EntityState = field(default_factory=EntityState)
    last_seq: int | None = None
    #: While catching up after a replay: live sequence numbers at or above this, behind ``last_seq``,
    #: are overlap with what the replay delivered. Otherwise a sequence going backwards is a restart.
    replay_floor: int | None = None
    #: Timestamp of the last batch applied: overlap re-delivers batches no newer than it, while an engine
    #: that restarted sends new batches (newer timestamps) with small sequence numbers again.
    last_ts: float = 0.0
    last_event: float | None = None
    last_lag: float | None = None
    events: int = 0
    batches: int = 0
    gaps: int = 0
    replays: int = 0
    purges: int = 0
    dropped: int = 0
    rate: _Rate = field(default_factory=_Rate)
    metric_cache: dict[tuple[str, str], Any] = field(default_factory=dict)

    def child(self, family: Any) -> Any:
        """The entity's child of a metric labelled by worker only (cached: ``labels()`` is slow)."""
        child = self.metric_cache.get((family._name, ""))
        if child is None:
            child = self.metric_cache[(family._name, "")] = family.labels(self.id)
        return child

    def counter(self, family: Any, label: str) -> Any:
        child = self.metric_cache.get((family._name, label))
        if child is None:
            child = self.metric_cache[(family._name, label)] = family.labels(self.id, label)
        return child


@dataclass(slots=True)
class _Worker:
    id: str
    model: str
    dp_size: int = 1
    down_since: float | None = None


class KVIndexer:
    """Per-worker event state machine in front of an :class:`IndexBackend`."""

    def __init__(self, backend: IndexBackend, block_sizes: dict[str, int] | None = None) -> None:
        self.backend = backend
        self._models: dict[str, ModelInfo] = {}
        self._workers: dict[str, _Worker] = {}
        self._entities: dict[str, _Entity] = {}
        self._dirty = False
        self._next_recover = 0.0
        #: Orders local-view changes and their backend writes (a recovery rewrite must not interleave).
        self._lock = asyncio.Lock()
        #: Inside :meth:`batched`: writes wait here (per entity, in order) and go out together.
        self._deferring = 0
        self._pending: dict[str, tuple[str, list[Any]]] = {}
        self._log_times: dict[tuple[str, str], float] = {}
        self.purges_total = 0
        for model, size in (block_sizes or {}).items():
            self.model_info(model).block_size = size
        metrics.BACKEND_UP.labels(backend.name).set(1)

    # ---- workers -------------------------------------------------------------------------------

    def model_info(self, model: str) -> ModelInfo:
        info = self._models.get(model)
        if info is None:
            info = self._models[model] = ModelInfo(model, on_learn=self._learnt)
        return info

    def _learnt(self, model: str, block_size: int) -> None:
        log.info("model %s: block size %d learnt from KV events", model, block_size)

    def block_size(self, model: str) -> int | None:
        info = self._models.get(model)
        return info.block_size if info else None

    def check_block_size(self, model: str, block_size: int, source: str = "vllm:cache_config_info") -> bool:
        """Cross-check a block size reported elsewhere; adopt it when none is known. False = mismatch."""
        info = self.model_info(model)
        if info.block_size is None:
            info.block_size = block_size
            return True
        if info.block_size != block_size:
            log.warning(
                "model %s: block size %d from %s differs from %d in use", model, block_size, source, info.block_size
            )
            return False
        return True

    def register_worker(self, worker_id: str, model: str, dp_size: int = 1) -> None:
        """Events do not name the model: the worker's configured model is used for all its ranks."""
        if not worker_id or "#" in worker_id:
            raise ValueError(f"invalid worker id {worker_id!r}")
        self.model_info(model)
        self._workers[worker_id] = _Worker(worker_id, model, max(1, dp_size))

    async def unregister_worker(self, worker_id: str) -> None:
        await self.purge_worker(worker_id, "removed")
        self._workers.pop(worker_id, None)
        for eid in [e for e, ent in self._entities.items() if ent.worker_id == worker_id]:
            del self._entities[eid]

    def workers(self) -> list[str]:
        return list(self._workers)

    def _entity(self, worker_id: str, rank: int) -> _Entity | None:
        eid = entity_id(worker_id, rank)
        ent = self._entities.get(eid)
        if ent is None:
            worker = self._workers.get(worker_id)
            if worker is None:
                return None
            ent = self._entities[eid] = _Entity(eid, worker_id, rank, self.model_info(worker.model))
        return ent

    # ---- messages ------------------------------------------------------------------------------

    def count_drop(self, worker_id: str, reason: str, detail: str = "") -> Handled:
        """Count and (rate-limited) log a message dropped before it reached a worker's state."""
        return self._drop(worker_id, reason, detail)

    def _drop(self, worker_id: str, reason: str, detail: str = "", ent: _Entity | None = None) -> Handled:
        metrics.DROPPED.labels(ent.id if ent else worker_id, reason).inc()
        if ent is not None:
            ent.dropped += 1
        now = time.monotonic()
        key = (worker_id, reason)
        if now - self._log_times.get(key, -LOG_INTERVAL_S) >= LOG_INTERVAL_S:
            self._log_times[key] = now
            log.warning("worker %s: dropped a message (%s) %s", worker_id, reason, detail[:200])
        return Handled("dropped")

    async def handle_message(
        self, worker_id: str, frames: Sequence[bytes], *, on_gap: GapPolicy = "purge", replay: bool = False
    ) -> Handled:
        """Decode, sequence-check and apply one ZMQ message ``[topic, seq, payload]`` from a worker.

        ``on_gap="report"`` returns ``"gap"`` without applying, so the caller can replay first.
        ``replay=True`` marks messages coming from the worker's replay socket.
        """
        if len(frames) != 3:
            return self._drop(worker_id, "bad_frames", f"{len(frames)} frames")
        try:
            seq = decode_seq(frames[1])
            batch = decode_batch_fast(frames[2])
        except EventDecodeError as exc:
            return self._drop(worker_id, exc.reason, str(exc))
        ent = self._entity(worker_id, batch.dp_rank)
        if ent is None:
            return self._drop(worker_id, "unknown_worker")
        rank = batch.dp_rank
        last = ent.last_seq
        outcome: Outcome = "applied"
        if last is None and seq > 0 and on_gap == "report" and not replay:
            # First message from a worker that was already running (the router restarted, or a
            # connecting PUB lost its first batches): catch up from the start of its replay buffer.
            ent.last_seq = -1
            return Handled("gap", rank, seq)
        if last is not None and seq != last + 1:
            if seq <= last:
                overlap = ent.replay_floor is not None and seq >= ent.replay_floor and batch.ts <= ent.last_ts
                if replay or overlap:
                    return Handled("duplicate", rank, seq)
                await self._purge_entity(ent, "engine_restart")
                outcome = "restart"
            else:
                ent.gaps += 1
                metrics.GAPS.labels(ent.id).inc()
                if replay:
                    # The replay buffer no longer holds what we missed: start afresh from here.
                    await self._purge_entity(ent, "replay_too_old")
                    outcome = "resync"
                elif on_gap == "report":
                    return Handled("gap", rank, seq)
                else:
                    await self._purge_entity(ent, "gap")
                    outcome = "resync"
        ent.last_seq = seq
        ent.last_ts = max(ent.last_ts, batch.ts)
        if not replay:
            ent.replay_floor = None
        await self.apply_batch(ent, batch)
        return Handled(outcome, rank, seq)

    def prime_catch_up(self, worker_id: str, dp_rank: int = 0) -> bool:
        """Before any message of this rank was seen: expect sequence 0, so a replay starts there.
        False when the rank already has a position (nothing to catch up)."""
        ent = self._entity(worker_id, dp_rank)
        if ent is None or ent.last_seq is not None:
            return False
        ent.last_seq = -1
        return True

    def expected_seq(self, worker_id: str, dp_rank: int = 0) -> int | None:
        ent = self._entities.get(entity_id(worker_id, dp_rank))
        return None if ent is None or ent.last_seq is None else ent.last_seq + 1

    def begin_replay(self, worker_id: str, dp_rank: int, start: int) -> None:
        """Live messages queued behind a replay from ``start`` are overlap, not an engine restart."""
        ent = self._entities.get(entity_id(worker_id, dp_rank))
        if ent is not None:
            ent.replay_floor = start
            ent.replays += 1

    async def apply_batch(self, ent: _Entity, batch: EventBatch) -> None:
        """Apply one decoded batch to an entity's local view, then mirror it into the backend."""
        now = time.time()
        ent.last_event = now
        ent.last_lag = max(0.0, now - batch.ts)
        ent.batches += 1
        n = len(batch.events)
        ent.events += n
        ent.rate.add(n)
        if batch.skipped:
            ent.counter(metrics.DROPPED, "unknown_event_type").inc(batch.skipped)
        async with self._lock:
            result = translate(ent.state, ent.model, batch)
            if result.ops and not self._dirty:
                if self._deferring:
                    self._pending.setdefault(ent.id, (ent.model.name, []))[1].extend(result.ops)
                else:
                    await self._write(ent.model.name, ent.id, result.ops)
                    await self._publish_block_size(ent.model)
        for kind, count in result.received.items():
            ent.counter(metrics.EVENTS_RECEIVED, kind).inc(count)
        for kind, count in result.applied.items():
            ent.counter(metrics.EVENTS_APPLIED, kind).inc(count)
        for reason, count in result.dropped.items():
            ent.counter(metrics.DROPPED, reason).inc(count)
            ent.dropped += count
        if result.cleared:
            self._count_purge(ent, "all_blocks_cleared")
        ent.child(metrics.EVENT_LAG).set(ent.last_lag)
        ent.child(metrics.BLOCKS).set(len(ent.state.bits))
        if self._dirty:
            await self.recover()

    async def _write(self, model: str, entity: str, ops: list[Any]) -> None:
        """One backend write (the caller holds the lock)."""
        try:
            await self.backend.apply(model, entity, ops)
        except IndexUnavailable as exc:
            self._backend_failed("apply", exc)

    async def _publish_block_size(self, model: ModelInfo) -> None:
        if model.published or not model.block_size or self._dirty:
            return
        try:
            await self.backend.set_block_size(model.name, model.block_size)
            model.published = True
        except IndexUnavailable as exc:
            self._backend_failed("apply", exc)

    async def _flush_locked(self) -> None:
        pending, self._pending = self._pending, {}
        if not pending or self._dirty:
            return  # when dirty, everything is rewritten from the local views on recovery
        try:
            await self.backend.apply_many([(model, entity, ops) for entity, (model, ops) in pending.items()])
        except IndexUnavailable as exc:
            self._backend_failed("apply", exc)
            return
        for model in {model for model, _ in pending.values()}:
            await self._publish_block_size(self.model_info(model))

    async def flush(self) -> None:
        """Write what :meth:`batched` has deferred so far."""
        if self._pending:
            async with self._lock:
                await self._flush_locked()

    @contextlib.asynccontextmanager
    async def batched(self) -> AsyncIterator[None]:
        """Handle several messages with one backend write per entity (the subscriber drains its
        socket this way: Redis round trips are paid per burst, not per batch)."""
        self._deferring += 1
        try:
            yield
        finally:
            self._deferring -= 1
            if not self._deferring:
                await self.flush()

    def _backend_failed(self, op: str, exc: Exception) -> None:
        if not self._dirty:
            log.error(
                "index backend %s unavailable (%s): keeping local views, will rewrite on recovery",
                self.backend.name,
                exc,
            )
        metrics.BACKEND_ERRORS.labels(self.backend.name, op).inc()
        metrics.BACKEND_UP.labels(self.backend.name).set(0)
        self._dirty = True
        self._next_recover = time.monotonic() + RECOVER_INTERVAL_S

    def mark_backend_down(self, reason: str) -> None:
        """Treat the backend as failed: writes wait, and everything is rewritten once it answers."""
        self._backend_failed("ping", IndexUnavailable(reason))

    @property
    def backend_ok(self) -> bool:
        return not self._dirty

    async def recover(self, force: bool = False) -> bool:
        """Rewrite every entity into a backend that failed, once it answers again. True when healthy."""
        if not self._dirty:
            return True
        if not force and time.monotonic() < self._next_recover:
            return False
        async with self._lock:
            self._pending.clear()  # the snapshots below include everything deferred
            try:
                for ent in list(self._entities.values()):
                    await self.backend.apply(ent.model.name, ent.id, ent.state.snapshot_ops())
                for info in self._models.values():
                    if info.block_size and info.published:
                        await self.backend.set_block_size(info.name, info.block_size)
            except IndexUnavailable as exc:
                self._backend_failed("recover", exc)
                return False
        self._dirty = False
        metrics.BACKEND_UP.labels(self.backend.name).set(1)
        log.warning("index backend %s is back: %d workers rewritten", self.backend.name, len(self._entities))
        return True

    async def refresh(self) -> None:
        """Re-store every entity's blocks: renews TTLs of long-lived blocks, restores any lost entry."""
        if self._dirty:
            return
        async with self._lock:
            await self._flush_locked()
            try:
                for ent in list(self._entities.values()):
                    ops = ent.state.snapshot_ops()[1:]
                    if ops:
                        await self.backend.apply(ent.model.name, ent.id, ops)
            except IndexUnavailable as exc:
                self._backend_failed("refresh", exc)

    # ---- purges --------------------------------------------------------------------------------

    def _count_purge(self, ent: _Entity, reason: str) -> None:
        ent.purges += 1
        self.purges_total += 1
        ent.counter(metrics.PURGES, reason).inc()

    async def _purge_entity(self, ent: _Entity, reason: str) -> None:
        log.info("purging %s (%s)", ent.id, reason)
        ent.state.clear()
        self._count_purge(ent, reason)
        metrics.BLOCKS.labels(ent.id).set(0)
        async with self._lock:
            await self._flush_locked()
            if self._dirty:
                return
            try:
                await self.backend.purge_worker(ent.id)
            except IndexUnavailable as exc:
                self._backend_failed("purge", exc)

    async def purge_worker(self, worker_id: str, reason: str = "admin") -> int:
        """Forget all blocks of every rank of a worker; sequence tracking goes on. Returns entities purged."""
        ents = [e for e in self._entities.values() if e.worker_id == worker_id]
        for ent in ents:
            await self._purge_entity(ent, reason)
        if not ents:
            # Not subscribed here (a reader of a shared Redis index): purge by id in the backend.
            try:
                await self.backend.purge_worker(worker_id)
            except IndexUnavailable as exc:
                self._backend_failed("purge", exc)
                raise
        return len(ents)

    def mark_down(self, worker_id: str) -> None:
        """The worker stopped answering (health checks, lost connection): purge it after a grace period."""
        worker = self._workers.get(worker_id)
        if worker is not None and worker.down_since is None:
            worker.down_since = time.monotonic()

    def mark_up(self, worker_id: str) -> None:
        worker = self._workers.get(worker_id)
        if worker is not None:
            worker.down_since = None

    async def purge_gone(self, grace_s: float) -> list[str]:
        """Purge the workers down for longer than ``grace_s`` (each once); returns their ids."""
        now = time.monotonic()
        gone = []
        for worker in self._workers.values():
            if worker.down_since is not None and now - worker.down_since >= grace_s:
                gone.append(worker.id)
        for worker_id in gone:
            await self.purge_worker(worker_id, "worker_gone")
            self._workers[worker_id].down_since = None
            for ent in self._entities.values():
                if ent.worker_id == worker_id:
                    ent.last_seq = None
        return gone

    # ---- lookups -------------------------------------------------------------------------------

    def request_keys(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[int | None, list[int]]:
        size = self.block_size(model)
        if size is None:
            return None, []
        return size, request_keys(token_ids, size, model, lora_name=lora_name, cache_salt=cache_salt)

    async def lookup_tokens(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> LookupResult:
        """Per worker entity, how much of this prompt's prefix it holds. Raises IndexUnavailable."""
        if self.block_size(model) is None:
            await self._ask_block_size(model)
        size, keys = self.request_keys(model, token_ids, lora_name, cache_salt)
        result = LookupResult(model, size, len(keys), keys=keys)
        if keys:
            result.matches = await self.lookup_keys(model, keys)
        return result

    async def _ask_block_size(self, model: str) -> None:
        """A reader of a shared index learns block sizes from the writer (asked at most every 5 s)."""
        info = self.model_info(model)
        now = time.monotonic()
        if now < info.next_ask:
            return
        info.next_ask = now + 5.0
        try:
            size = await self.backend.get_block_size(model)
        except IndexUnavailable as exc:
            metrics.BACKEND_ERRORS.labels(self.backend.name, "block_size").inc()
            raise exc from None
        if size and info.block_size is None:
            info.block_size = size
            info.published = True

    async def lookup_keys(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        start = time.perf_counter()
        try:
            matches = await self.backend.lookup(model, keys)
        except IndexUnavailable as exc:
            metrics.BACKEND_ERRORS.labels(self.backend.name, "lookup").inc()
            metrics.BACKEND_UP.labels(self.backend.name).set(0)
            log.warning("index lookup failed (%s): route by load", exc)
            raise
        metrics.LOOKUP_SECONDS.labels(self.backend.name).observe(time.perf_counter() - start)
        return matches

    # ---- inspection ----------------------------------------------------------------------------

    def _entity_info(self, ent: _Entity, now: float) -> dict[str, Any]:
        return {
            "id": ent.id,
            "worker": ent.worker_id,
            "dp_rank": ent.rank,
            "model": ent.model.name,
            "blocks": len(ent.state.bits),
            "by_tier": tier_counts(ent.state.bits.values()),
            "events": ent.events,
            "events_per_s": round(ent.rate.per_second(), 2),
            "batches": ent.batches,
            "last_seq": ent.last_seq,
            "gaps": ent.gaps,
            "replays": ent.replays,
            "purges": ent.purges,
            "dropped": ent.dropped,
            "seconds_since_last_event": None if ent.last_event is None else round(now - ent.last_event, 3),
            "lag_s": None if ent.last_lag is None else round(ent.last_lag, 4),
        }

    async def stats(self) -> dict[str, Any]:
        """Everything the admin page and ``/admin/index/stats`` show."""
        now = time.time()
        entities = {e.id: self._entity_info(e, now) for e in self._entities.values()}
        backend_ok = not self._dirty
        try:
            for row in await self.backend.worker_stats():
                if row.worker_id not in entities:
                    worker, rank = split_entity(row.worker_id)
                    entities[row.worker_id] = {
                        "id": row.worker_id,
                        "worker": worker,
                        "dp_rank": rank,
                        "model": row.model,
                        "blocks": row.blocks,
                        "by_tier": row.by_tier,
                        "source": "backend",
                    }
        except IndexUnavailable:
            backend_ok = False
        for worker in self._workers.values():
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
            "backend": self.backend.name,
            "backend_ok": backend_ok,
            "block_sizes": {m: info.block_size for m, info in self._models.items()},
            "blocks": sum(e["blocks"] for e in entities.values()),
            "events_per_s": round(sum(e.get("events_per_s", 0.0) for e in entities.values()), 2),
            "gaps": sum(e.get("gaps", 0) for e in entities.values()),
            "replays": sum(e.get("replays", 0) for e in entities.values()),
            "purges": self.purges_total,
            "workers": sorted(entities.values(), key=lambda e: e["id"]),
        }

    async def worker_info(self, worker_id: str) -> dict[str, Any] | None:
        """One worker (all its ranks), or None when unknown."""
        stats = await self.stats()
        ranks = [e for e in stats["workers"] if e["worker"] == worker_id or e["id"] == worker_id]
        if not ranks:
            return None
        return {"worker": worker_id, "ranks": ranks, "blocks": sum(e["blocks"] for e in ranks)}

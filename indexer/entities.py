"""Who is indexed: models, workers and their data-parallel ranks (entities), and what we know of each.

Events do not name the model, so a worker is registered with its configured model before its events
count. Each data-parallel rank has its own cache and its own sequence counter, so each is indexed as
its own entity: rank 0 keeps the worker id (``w``), rank n>0 is ``w#n``. An :class:`Entity` holds
the rank's local view (the truth the backend mirrors), its sequence position and its counters; the
:class:`Registry` is the one place these records are created and dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from kvroute.indexer.ingest import EntityState, ModelInfo
from kvroute.indexer.metrics import EntityMetrics, IndexerMetrics
from kvroute.indexer.sequencing import SeqTrack

log = logging.getLogger("kvroute.indexer")


def entity_id(worker_id: str, dp_rank: int) -> str:
    """The index identity of one data-parallel rank of a worker."""
    return worker_id if dp_rank == 0 else f"{worker_id}#{dp_rank}"


def split_entity(entity: str) -> tuple[str, int]:
    """Inverse of :func:`entity_id`."""
    worker, sep, rank = entity.rpartition("#")
    if sep and rank.isdigit():
        return worker, int(rank)
    return entity, 0


class EventRate:
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
class Entity:
    """One data-parallel rank of a worker: its local view, sequence position and counters."""

    id: str
    worker_id: str
    rank: int
    model: ModelInfo
    metrics: EntityMetrics
    state: EntityState = field(default_factory=EntityState)
    seq: SeqTrack = field(default_factory=SeqTrack)
    last_event: float | None = None
    last_lag: float | None = None
    events: int = 0
    batches: int = 0
    purges: int = 0
    dropped: int = 0
    rate: EventRate = field(default_factory=EventRate)


@dataclass(slots=True)
class Worker:
    id: str
    model: str
    dp_size: int = 1
    #: When it stopped answering (monotonic); purged once this is older than the grace period.
    down_since: float | None = None


class Registry:
    """Models, workers and entities of one indexer."""

    def __init__(self, metrics: IndexerMetrics, block_sizes: dict[str, int] | None = None) -> None:
        self.metrics = metrics
        self.models: dict[str, ModelInfo] = {}
        self.workers: dict[str, Worker] = {}
        self.entities: dict[str, Entity] = {}
        #: Purges since start, of entities present or gone (the stats' total).
        self.purges_total = 0
        #: Entity (or, for a worker with no entity here, worker) id -> until when (monotonic) its entries
        #: are doubtful: left out of lookups until its next events (or this deadline).
        self.doubtful: dict[str, float] = {}
        for model, size in (block_sizes or {}).items():
            self.model_info(model).block_size = size

    # ---- models --------------------------------------------------------------------------------

    def model_info(self, model: str) -> ModelInfo:
        info = self.models.get(model)
        if info is None:
            info = self.models[model] = ModelInfo(model, on_learn=_learnt)
        return info

    def block_size(self, model: str) -> int | None:
        info = self.models.get(model)
        return info.block_size if info else None

    def check_block_size(self, model: str, block_size: int, source: str) -> bool:
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

    # ---- workers and entities ------------------------------------------------------------------

    def register(self, worker_id: str, model: str, dp_size: int) -> None:
        if not worker_id or "#" in worker_id:
            raise ValueError(f"invalid worker id {worker_id!r}")
        self.model_info(model)
        self.workers[worker_id] = Worker(worker_id, model, max(1, dp_size))

    def forget(self, worker_id: str) -> None:
        """Drop a worker and its entities' records (its blocks must have been purged)."""
        self.workers.pop(worker_id, None)
        for eid in [e for e, ent in self.entities.items() if ent.worker_id == worker_id]:
            del self.entities[eid]

    def entity(self, worker_id: str, rank: int) -> Entity | None:
        """The rank's entity, created on its first message; None when the worker is not registered."""
        eid = worker_id if rank == 0 else f"{worker_id}#{rank}"
        ent = self.entities.get(eid)
        if ent is None:
            worker = self.workers.get(worker_id)
            if worker is None or rank >= worker.dp_size:
                return None  # not registered, or a rank the worker does not have (hostile input)
            model = self.model_info(worker.model)
            ent = self.entities[eid] = Entity(eid, worker_id, rank, model, self.metrics.entity(eid))
        return ent

    def find(self, worker_id: str, rank: int) -> Entity | None:
        """The rank's entity if it exists (never creates one)."""
        return self.entities.get(entity_id(worker_id, rank))

    def of_worker(self, worker_id: str) -> Iterator[Entity]:
        return (ent for ent in self.entities.values() if ent.worker_id == worker_id)

    def mark_down(self, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None and worker.down_since is None:
            worker.down_since = time.monotonic()

    def mark_up(self, worker_id: str) -> None:
        worker = self.workers.get(worker_id)
        if worker is not None:
            worker.down_since = None

    # ---- doubt ---------------------------------------------------------------------------------

    def doubt(self, worker_id: str, until: float) -> list[str]:
        """Set the worker's entries aside until its next events or ``until`` (monotonic): its ranks here,
        else the worker id itself (a reader of a shared index has no entities). Returns the ids."""
        ids = [ent.id for ent in self.of_worker(worker_id)] or [worker_id]
        for ident in ids:
            self.doubtful[ident] = max(until, self.doubtful.get(ident, 0.0))
        return ids

    def lift(self, ident: str) -> None:
        self.doubtful.pop(ident, None)

    def is_doubtful(self, entity: str) -> bool:
        """Whether a lookup must leave this entity out (its own doubt, or its worker's as a whole)."""
        for ident in (entity, split_entity(entity)[0]):
            until = self.doubtful.get(ident)
            if until is None:
                continue
            if time.monotonic() < until:
                return True
            del self.doubtful[ident]  # expired: nothing came, the entries count again
        return False

    def down_longer_than(self, grace_s: float) -> list[str]:
        now = time.monotonic()
        return [w.id for w in self.workers.values() if w.down_since is not None and now - w.down_since >= grace_s]


def _learnt(model: str, block_size: int) -> None:
    log.info("model %s: block size %d learnt from KV events", model, block_size)

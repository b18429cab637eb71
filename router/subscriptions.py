"""Keeps the KV-event subscribers in step with the worker registry.

New workers are subscribed once their model is known, removed workers unsubscribed (and purged from the
index), health transitions passed to the indexer. A worker given by URL only is asked where it publishes
(vLLM >= 0.32's ``GET /kv_event_sources``); one without the endpoint is routed by load only (counted).
A reconcile loop catches workers added or removed at run time (admin API, discovery).
"""

from __future__ import annotations

import asyncio
import logging
import time

from kvroute.config import WorkerConfig
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from kvroute.router.discovery.event_sources import EventSourceProbe
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.registry import WorkerRegistry, WorkerState
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed

log = logging.getLogger("kvroute.subscriptions")

#: How often the subscribers are reconciled with the registry (workers added/removed at run time).
RECONCILE_INTERVAL_S = 1.0
#: How long a worker that reported no usable event source is routed by load before it is asked again.
ASK_AGAIN_S = 30.0


class SubscriptionSync:
    """A :class:`~kvroute.router.state.Service`: starts the subscriber and keeps it reconciled."""

    def __init__(
        self,
        registry: WorkerRegistry,
        subscriber: EventSubscriber,
        indexer: KVIndexer,
        metrics: KVRouteMetrics,
        probe: EventSourceProbe | None = None,
    ) -> None:
        self.registry = registry
        self.subscriber = subscriber
        self.indexer = indexer
        self.metrics = metrics
        #: Asks a worker given by URL only where it publishes (vLLM's GET /kv_event_sources).
        self.probe = probe
        self._subscribed: set[str] = set()
        #: Worker id -> when to ask its /kv_event_sources again (it was down, or answered nothing usable).
        self._ask_after: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    def on_health(self, worker_id: str, healthy: bool) -> None:
        if healthy:
            self.indexer.mark_up(worker_id)
        else:
            self.indexer.mark_down(worker_id)

    async def _spec(self, worker: WorkerState) -> WorkerSpec | None:
        if not worker.models:
            return None  # model not discovered yet: next round
        cfg = worker.config
        if not cfg.kv_events and not self.subscriber.bind:
            cfg = await self._ask_sources(worker)
            if not cfg.kv_events:
                return None  # no event source: the worker is routed by load only
        first = worker.models[0]
        return WorkerSpec(
            worker_id=cfg.worker_id,
            # Events do not name the model; an adapter's blocks are the base model's, keyed with its name.
            model=self.registry.base_of(first) or first,
            endpoint=cfg.kv_events,
            topic=cfg.kv_events_topic,
            replay=cfg.replay,
            dp_size=cfg.dp_size,
        )

    async def _ask_sources(self, worker: WorkerState) -> WorkerConfig:
        """The worker's config with the event endpoints it reports, at most once per ASK_AGAIN_S."""
        cfg = worker.config
        now = time.monotonic()
        if self.probe is None or not worker.healthy or self._ask_after.get(cfg.worker_id, 0.0) > now:
            return cfg
        filled = await self.probe.fill(cfg)
        if not filled.kv_events:
            self._ask_after[cfg.worker_id] = now + ASK_AGAIN_S
        else:
            worker.config = filled  # the registry now knows its ranks too (steering reads dp_size)
        return filled

    async def reconcile(self) -> None:
        current = {w.id: w for w in self.registry.all()}
        for worker_id in list(self._subscribed - set(current)):
            await self.subscriber.remove_worker(worker_id)
            self._subscribed.discard(worker_id)
            self._ask_after.pop(worker_id, None)
            log.info("worker %s left the pool: unsubscribed and purged from the index", worker_id)
        for worker_id, worker in current.items():
            if worker_id in self._subscribed:
                continue
            spec = await self._spec(worker)
            if spec is None:
                continue
            try:
                self.subscriber.add_worker(spec)
            except ValueError as exc:
                log.error("cannot subscribe to %s's KV events: %s", worker_id, exc)
            self._subscribed.add(worker_id)
        self.metrics.event_sources.set(len(self._subscribed))
        self.metrics.load_only_workers.set(len(set(current) - self._subscribed))

    def routing_basis(self) -> dict[str, object]:
        """Which workers are routed by their KV cache and which by load only (for explain)."""
        workers = {w.id for w in self.registry.all()}
        subscribed = sorted(self._subscribed & workers)
        return {
            "kv_events": subscribed,
            "load_only": sorted(workers - self._subscribed),
            "routing": "kv_cache" if subscribed else "load_only: no worker's KV events are received",
        }

    def catching_up(self) -> list[str]:
        """Workers whose events are subscribed but whose cache the index has not caught up with yet."""
        return self.subscriber.catching_up()

    async def _run(self) -> None:
        while True:
            raise_if_cancel_swallowed()  # a cancel dropped by a Redis purge in reconcile() ends the loop
            try:
                await self.reconcile()
            except Exception:
                log.exception("subscriber reconciliation failed")
            await asyncio.sleep(RECONCILE_INTERVAL_S)

    async def start(self) -> None:
        self.registry.listeners.append(self.on_health)
        await self.reconcile()
        await self.subscriber.start()
        self._task = asyncio.create_task(self._run(), name="kv-subscriptions")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await self.subscriber.stop()

"""Assembles a running kvroute router from its config: policy, index, subscribers, tokens, conversations.

:func:`build_app` is what ``kvroute serve`` runs. The base app (:func:`~kvroute.router.app.create_app`)
knows HTTP, workers and policies; this module adds the KV-aware parts on its hooks:

* the index backend (memory, or a Redis index shared by replicas) and, unless another process keeps it
  (``index.subscribe: false``), the KV-event subscribers, kept in step with the worker registry;
* the tokenizers (local files or the workers' ``/tokenize``) and the conversation store;
* the :class:`~kvroute.router.kv_pipeline.KVPipeline`, the index admin API and ``/admin/route/explain``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx
from kvroute.config import RouterConfig
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec
from kvroute.policies import create_policy
from kvroute.policies.base import PoolContext
from kvroute.router.app import RouterState, create_app
from kvroute.router.conversations import ConversationStore, MemoryConversationStore, RedisConversationStore
from kvroute.router.explain import explain_router
from kvroute.router.index_admin import index_admin_router
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.kv_pipeline import KVParts, KVPipeline
from kvroute.router.tokens import Tokenizers
from kvroute.tasks import cancel_and_wait, raise_if_cancel_swallowed
from starlette.applications import Starlette

log = logging.getLogger("kvroute.server")

#: How often the subscribers are reconciled with the registry (workers added/removed at run time).
RECONCILE_INTERVAL_S = 1.0


def pool_context(config: RouterConfig) -> PoolContext:
    models = {
        m.name: {
            "prefill_tokens_per_s": m.prefill_tokens_per_s,
            "attention_coeff_s": m.attention_coeff_s,
            "bytes_per_token": float(m.bytes_per_token),
            "transfer_per_block_s": m.transfer_per_block_s,
        }
        for m in config.models
    }
    pool = config.pool
    return PoolContext(
        models=models,
        kv_protocol=pool.kv_protocol,
        kv_recompute_threshold=pool.kv_recompute_threshold,
        link_bytes_per_s=pool.link_bytes_per_s,
        transfer_setup_s=pool.transfer_setup_s,
    )


def make_backend(config: RouterConfig) -> IndexBackend:
    if config.index.backend == "redis":
        from kvroute.indexer.redis_index import RedisIndex

        return RedisIndex(config.index.redis_url, prefix=config.index.redis_prefix, ttl_s=config.index.block_ttl_s)
    return MemoryIndex()


def make_conversations(config: RouterConfig) -> ConversationStore:
    if config.index.backend == "redis":
        return RedisConversationStore(
            config.index.redis_url, ttl_s=config.pool.conversation_ttl_s, prefix=f"{config.index.redis_prefix}:conv"
        )
    return MemoryConversationStore(ttl_s=config.pool.conversation_ttl_s)


class SubscriptionSync:
    """Keeps the event subscribers in step with the registry: new workers subscribed once their model is
    known, removed workers unsubscribed (and purged), health transitions passed to the indexer."""

    def __init__(self, state: RouterState, subscriber: EventSubscriber, indexer: KVIndexer) -> None:
        self.state = state
        self.subscriber = subscriber
        self.indexer = indexer
        self._subscribed: set[str] = set()
        self._task: asyncio.Task[None] | None = None

    def on_health(self, worker_id: str, healthy: bool) -> None:
        if healthy:
            self.indexer.mark_up(worker_id)
        else:
            self.indexer.mark_down(worker_id)

    def _spec(self, worker: Any) -> WorkerSpec | None:
        cfg = worker.config
        if not cfg.kv_events and not self.subscriber.bind:
            return None  # no event source: the worker is routed by load only
        if not worker.models:
            return None  # model not discovered yet: next round
        return WorkerSpec(
            worker_id=cfg.worker_id,
            model=worker.models[0],
            endpoint=cfg.kv_events,
            topic=cfg.kv_events_topic,
            replay=cfg.replay,
            dp_size=cfg.dp_size,
        )

    async def reconcile(self) -> None:
        current = {w.id: w for w in self.state.registry.all()}
        for worker_id in list(self._subscribed - set(current)):
            await self.subscriber.remove_worker(worker_id)
            self._subscribed.discard(worker_id)
            log.info("worker %s left the pool: unsubscribed and purged from the index", worker_id)
        for worker_id, worker in current.items():
            if worker_id in self._subscribed:
                continue
            spec = self._spec(worker)
            if spec is None:
                continue
            try:
                self.subscriber.add_worker(spec)
            except ValueError as exc:
                log.error("cannot subscribe to %s's KV events: %s", worker_id, exc)
            self._subscribed.add(worker_id)

    async def run(self) -> None:
        while True:
            raise_if_cancel_swallowed()  # a cancel dropped by a Redis purge in reconcile() ends the loop
            try:
                await self.reconcile()
            except Exception:
                log.exception("subscriber reconciliation failed")
            await asyncio.sleep(RECONCILE_INTERVAL_S)

    async def start(self) -> None:
        self.state.registry.listeners.append(self.on_health)
        await self.reconcile()
        await self.subscriber.start()
        self._task = asyncio.create_task(self.run(), name="kv-subscriptions")

    async def stop(self) -> None:
        if self._task is not None:
            await cancel_and_wait([self._task])
            self._task = None
        await self.subscriber.stop()


def build_app(config: RouterConfig) -> Starlette:
    """The full router: base app + index + subscribers + tokens + conversations + KV pipeline."""
    policy = create_policy(config.policy, pool_context(config), **config.policy_options)
    block_sizes = {m.name: m.block_size for m in config.models if m.block_size}
    indexer = KVIndexer(make_backend(config), block_sizes=block_sizes)
    holder: dict[str, Tokenizers] = {}

    async def tokenize(model: str, prompt: str | None, messages: list[dict[str, Any]] | None) -> list[int]:
        body: dict[str, Any] = {"messages": messages} if messages is not None else {"prompt": prompt}
        return await holder["tokenizers"].tokens_for_body(model, body)

    app = create_app(
        config,
        policy=policy,
        pipeline_cls=KVPipeline,
        admin_routers=[index_admin_router(indexer, config.admin_token, tokenize), explain_router()],
    )
    state: RouterState = app.state.kvroute
    pipeline = state.pipeline
    assert isinstance(pipeline, KVPipeline)
    conversations = make_conversations(config) if config.pool.kv_protocol == "nixl" else None
    parts = KVParts(
        metrics=KVRouteMetrics(state.metrics.registry),
        indexer=indexer,
        conversations=conversations,
        protocol=config.pool.kv_protocol,
        client_kv_params=config.pool.client_kv_params,
    )
    pipeline.attach(parts)
    state.extras["indexer"] = indexer
    client = httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=64))

    def worker_url_for(model: str) -> str | None:
        healthy = [w for w in state.registry.all() if w.healthy and w.serves(model)]
        return healthy[0].url if healthy else None

    tokenizers = Tokenizers.from_models(config.models, client, worker_url_for)
    holder["tokenizers"] = tokenizers
    parts.tokenizers = tokenizers
    # A Redis index expires entries after block_ttl_s (the safety net for lost removals): rewrite the
    # live blocks well before that, or long-lived hot prefixes (system prompts) would drop out.
    refresh_s = config.index.block_ttl_s / 3 if config.index.backend == "redis" and config.index.block_ttl_s else None
    subscriber = EventSubscriber(
        indexer, bind=config.index.events_bind, grace_s=config.index.worker_gone_grace_s, refresh_s=refresh_s
    )
    sync = SubscriptionSync(state, subscriber, indexer)

    async def start(_: RouterState) -> None:
        if config.index.subscribe:
            await sync.start()
            state.extras["subscriber"] = sync.subscriber

    async def stop(_: RouterState) -> None:
        if config.index.subscribe:
            await sync.stop()
        await client.aclose()
        if conversations is not None:
            await conversations.close()
        await indexer.backend.close()

    state.on_startup.append(start)
    state.on_shutdown.append(stop)
    return app

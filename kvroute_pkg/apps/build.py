"""The composition root: every part of a running router built once, in order, from the config.

``kvroute serve``, ``kvroute epp`` and ``kvroute indexer`` all build from here, so the index, the
subscribers and the policy are made one way. Order: metrics -> transport -> registry -> index -> event
subscribers -> tokenizers -> conversation store -> policy -> request flow -> services (started in this
order by the app's lifespan, stopped in reverse).
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import httpx
from fastapi import APIRouter
from kvroute.config import RouterConfig, WorkerConfig
from kvroute.indexer import memory as memory_index
from kvroute.indexer.backend import IndexBackend
from kvroute.indexer.fastdecode import DECODER
from kvroute.indexer.ingest import APPLY
from kvroute.indexer.keys import CHAIN
from kvroute.indexer.maintenance import IndexMaintenance
from kvroute.indexer.memory import MemoryIndex
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.indexer.service import KVIndexer
from kvroute.indexer.subscriber import EventSubscriber, WorkerSpec, subscriber_options
from kvroute.policies import Policy, create_policy
from kvroute.policies.base import ModelFigures, PoolContext
from kvroute.router.app import create_app
from kvroute.router.cache_metrics import PrefixCacheCollector
from kvroute.router.conversations import ConversationStore, MemoryConversationStore, RedisConversationStore
from kvroute.router.discovery import build_discovery
from kvroute.router.discovery.event_sources import EventSourceProbe
from kvroute.router.explain import explain_router
from kvroute.router.facts import FactGatherer
from kvroute.router.flow import RequestFlow
from kvroute.router.forwarding import Forwarder
from kvroute.router.index_admin import index_admin_router
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.metrics import RouterMetrics
from kvroute.router.outcomes import Outcomes
from kvroute.router.receipts import Receipts
from kvroute.router.receipts_admin import receipts_router
from kvroute.router.registry import WorkerRegistry
from kvroute.router.routed_prefixes import RoutedPrefixes
from kvroute.router.state import RouterState, Service
from kvroute.router.subscriptions import SubscriptionSync
from kvroute.router.tokens import Tokenizers
from kvroute.router.transport import Transport, make_transport
from kvroute.router.warmup import WarmUp
from starlette.applications import Starlette

log = logging.getLogger("kvroute.build")


# ---------------------------------------------------------------------------------------------- index


def make_backend(config: RouterConfig) -> IndexBackend:
    """``index.backend``: memory (one process), or a Redis index shared by replicas."""
    index = config.index
    if index.backend == "redis":
        from kvroute.indexer.redis_index import RedisIndex

        return RedisIndex(
            index.redis_url, prefix=index.redis_prefix, ttl_s=index.block_ttl_s, cluster=index.redis_cluster
        )
    if memory_index.WALK != "compiled":
        log.warning("the compiled chain walk is not built: lookups run the Python walk (reinstall with a C compiler)")
    return MemoryIndex(max_blocks=index.max_blocks)


def make_indexer(
    config: RouterConfig, backend: IndexBackend | None = None, metrics: IndexerMetrics | None = None
) -> KVIndexer:
    """The index over the configured backend; ``metrics`` on the process's registry (default: prometheus')."""
    sizes = {m.name: m.block_size for m in config.models if m.block_size}
    missing = [
        name
        for name, which in (("key chain", CHAIN), ("event decoder", DECODER), ("removal loops", APPLY))
        if which != "compiled"
    ]
    if missing:
        log.warning(
            "compiled ingest parts not built (%s): they run in Python, same results, slower (reinstall with a C "
            "compiler and libxxhash-dev)",
            ", ".join(missing),
        )
    return KVIndexer(backend or make_backend(config), block_sizes=sizes, metrics=metrics)


def make_subscriber(config: RouterConfig, indexer: KVIndexer) -> EventSubscriber:
    """The KV-event subscriber (it only consumes events; upkeep is :func:`make_maintenance`'s)."""
    return EventSubscriber(indexer, bind=config.index.events_bind, **subscriber_options(config.index))


def make_maintenance(config: RouterConfig, indexer: KVIndexer) -> IndexMaintenance:
    """The index's upkeep: workers gone past the grace period purged, backend recovery, and for Redis a
    rewrite of live blocks well before ``block_ttl_s`` (the safety net for lost removals), or hot prefixes
    (system prompts) would expire."""
    index = config.index
    refresh_s = index.block_ttl_s / 3 if index.backend == "redis" and index.block_ttl_s else None
    return indexer.make_maintenance(grace_s=index.worker_gone_grace_s, refresh_s=refresh_s)


def spec_for(worker: WorkerConfig, model: str) -> WorkerSpec:
    """A configured worker as the subscriber needs it."""
    return WorkerSpec(
        worker.worker_id,
        model,
        endpoint=worker.kv_events,
        topic=worker.kv_events_topic,
        replay=worker.replay,
        dp_size=worker.dp_size,
    )


# ---------------------------------------------------------------------------------------------- router


def pool_context(config: RouterConfig) -> PoolContext:
    """The pool's facts for the policy: per-model figures for the cost model, the KV protocol, the links."""
    models = {
        m.name: ModelFigures(
            prefill_tokens_per_s=m.prefill_tokens_per_s,
            attention_coeff_s=m.attention_coeff_s,
            bytes_per_token=m.bytes_per_token,
            transfer_per_block_s=m.transfer_per_block_s,
        )
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


def make_conversations(config: RouterConfig) -> ConversationStore | None:
    """Multi-turn reuse exists only on NixlConnector pools (the decoder returns its kv_transfer_params)."""
    if config.pool.kv_protocol != "nixl":
        return None
    if config.index.backend == "redis":
        return RedisConversationStore(
            config.index.redis_url,
            ttl_s=config.pool.conversation_ttl_s,
            prefix=f"{config.index.redis_prefix}:conv",
            cluster=config.index.redis_cluster,
        )
    return MemoryConversationStore(ttl_s=config.pool.conversation_ttl_s)


@dataclass(slots=True)
class Closing:
    """A :class:`Service` that only has something to close at shutdown (clients, stores, the backend)."""

    name: str
    close: Callable[[], Awaitable[object]]

    async def start(self) -> None:
        return None

    async def stop(self) -> None:
        await self.close()


def build_state(
    config: RouterConfig,
    *,
    policy: Policy | None = None,
    transport: Transport | None = None,
    extra_services: Sequence[Callable[[RouterState], Service]] = (),
) -> RouterState:
    """Every part of the router, wired once. ``extra_services`` build services that need the state (the
    EPP's gRPC server); they start last and stop first."""
    c = config
    metrics = RouterMetrics()
    kv_metrics = KVRouteMetrics(metrics.registry)
    transport = transport or make_transport(c.http_client, c.connect_timeout_s, c.read_timeout_s)
    registry = WorkerRegistry(
        c.workers,
        transport,
        metrics,
        health_interval_s=c.health_interval_s,
        metrics_interval_s=c.metrics_interval_s,
        unhealthy_after=c.unhealthy_after,
        healthy_after=c.healthy_after,
        probe_timeout_s=min(c.connect_timeout_s + 1.0, c.health_interval_s + 1.0),
        adapters=c.adapter_bases(),
    )
    indexer = make_indexer(c, metrics=IndexerMetrics(metrics.registry))
    registry.cache_listeners.append(indexer.doubt_worker)  # an engine restart seen in its counters
    tokenize_client = httpx.AsyncClient(timeout=10.0, limits=httpx.Limits(max_connections=64))

    def worker_urls_for(model: str) -> list[str]:
        return [w.url for w in registry.all() if w.healthy and w.serves(model)]

    tokenizers = Tokenizers.from_models(
        c.models, tokenize_client, worker_urls_for, lambda reason: kv_metrics.render_failures.labels(reason).inc()
    )
    conversations = make_conversations(c)
    policy = policy or create_policy(c.policy, pool_context(c), **c.policy_options)
    forwarder = Forwarder(transport, registry, metrics, first_byte_timeout_s=c.first_byte_timeout_s)
    routed = RoutedPrefixes(c.routed_prefix_ttl_s) if c.routed_prefix_ttl_s > 0 else None
    facts = FactGatherer(
        registry,
        kv_metrics,
        tokenizers=tokenizers,
        indexer=indexer,
        conversations=conversations,
        routed=routed,
        heads=c.prompt_heads,
    )
    receipts = Receipts(c.receipts, c.receipts_path) if c.receipts or c.receipts_path else None
    flow = RequestFlow(
        registry,
        policy,
        forwarder,
        facts,
        Outcomes(metrics, kv_metrics, policy.name or type(policy).__name__, receipts),
        metrics,
        kv_metrics,
        protocol=c.pool.kv_protocol,
        conversations=conversations,
        debug_headers=c.debug_headers,
        max_attempts=c.retry_attempts,
        refusal_cooldown_s=c.refusal_cooldown_s,
        early_head_ttft_s=c.early_head_ttft_s,
    )
    services: list[Service] = [registry]
    # Workers given by URL only (or discovered) are asked where they publish KV events.
    probe = EventSourceProbe(transport, metrics.registry) if not c.index.events_bind else None
    discovery = build_discovery(c, registry, transport, metrics.registry, probe)  # Kubernetes pods, DNS names
    if discovery is not None:
        services.append(discovery)
    subscriptions = None
    if c.index.subscribe:
        services.append(make_maintenance(c, indexer))  # starts before the subscriber, stops after it
        subscriptions = SubscriptionSync(registry, make_subscriber(c, indexer), indexer, kv_metrics, probe)
        services.append(subscriptions)
    services.append(WarmUp(tokenizers))
    services.append(Closing("tokenizer client", tokenize_client.aclose))
    if conversations is not None:
        services.append(Closing("conversation store", conversations.close))
    services.append(Closing("index backend", indexer.backend.close))
    services.append(Closing("upstream transport", transport.aclose))
    if receipts is not None:
        services.append(Closing("receipts", receipts.close))
    metrics.registry.register(
        PrefixCacheCollector(
            lambda: {
                **{("tokens", model): stats for model, stats in tokenizers.stats().items()},
                ("block_keys", "*"): indexer.lookups.key_cache.stats(),
            }
        )
    )
    state = RouterState(c, registry, flow, forwarder, transport, metrics, indexer, tokenizers, subscriptions)
    state.services = [*services, *(make(state) for make in extra_services)]
    return state


def build_app(
    config: RouterConfig,
    *,
    policy: Policy | None = None,
    transport: Transport | None = None,
    extra_services: Sequence[Callable[[RouterState], Service]] = (),
    admin_routers: Sequence[APIRouter] = (),
) -> Starlette:
    """The full router app (``kvroute serve``): state + HTTP surface + admin (index, explain, and
    ``admin_routers``: a serving process's ``/admin/process``)."""
    state = build_state(config, policy=policy, transport=transport, extra_services=extra_services)
    admin = [
        index_admin_router(
            state.indexer, lambda: state.config.admin_token, state.tokenizers.tokenize, state.registry.base_of
        ),
        explain_router(),
        *admin_routers,
    ]
    if state.flow.outcomes.receipts is not None:
        admin.append(receipts_router(state.flow.outcomes.receipts))
    return create_app(state, admin_routers=admin)

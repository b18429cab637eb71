"""The running router's parts, built once by the composition root (:mod:`kvroute.apps.build`).

The HTTP app, the admin API and the Endpoint Picker read them from here; nothing is attached later.
:attr:`RouterState.services` are started in order when the app starts and stopped in reverse order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvroute.config import RouterConfig
from kvroute.indexer.service import KVIndexer
from kvroute.policies.base import Policy
from kvroute.router.flow import RequestFlow
from kvroute.router.forwarding import Forwarder
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry
from kvroute.router.requests import FORWARDED_HEADERS
from kvroute.router.subscriptions import SubscriptionSync
from kvroute.router.tokens import Tokenizers
from kvroute.router.transport import Transport


class Service(Protocol):
    """Something with a lifetime inside the app's (probes, event subscribers, the EPP's gRPC server)."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


@dataclass(slots=True)
class RouterState:
    config: RouterConfig
    registry: WorkerRegistry
    flow: RequestFlow
    forwarder: Forwarder
    transport: Transport
    metrics: RouterMetrics
    indexer: KVIndexer
    tokenizers: Tokenizers
    #: The embedded event subscription (None when another process keeps a shared index).
    subscriptions: SubscriptionSync | None = None
    services: Sequence[Service] = ()
    started_at: float = field(default_factory=time.time)
    _forwarded: frozenset[str] = FORWARDED_HEADERS
    _forwarded_for: RouterConfig | None = None

    @property
    def policy(self) -> Policy:
        return self.flow.policy

    @property
    def forwarded_headers(self) -> frozenset[str]:
        """The client headers a worker gets: the built-in allowlist plus the config's ``forward_headers``
        (computed once per config: a reload that replaces the config is seen at once)."""
        config = self.config
        if self._forwarded_for is not config:
            self._forwarded = FORWARDED_HEADERS | {h.lower() for h in config.forward_headers}
            self._forwarded_for = config
        return self._forwarded

    def routing_basis(self) -> dict[str, object]:
        """What the KV-aware decision can see: per worker, KV events or load only."""
        if self.subscriptions is not None:
            return self.subscriptions.routing_basis()
        if not self.config.index.subscribe:
            return {"routing": "kv_cache: shared index kept by another process (index.subscribe: false)"}
        return {"routing": "load_only: no event subscription"}

    def readiness(self) -> dict[str, Any]:
        """``/ready``'s answer (and the EPP's gRPC readiness): every model has a healthy worker, and the index
        has caught up with what the subscribed workers cached before this replica came up (a fresh
        replica would otherwise route blind; the catch-up is bounded by ``replay_max_s`` per rank)."""
        ok, missing = self.registry.ready(self.expected_models())
        catching_up = self.subscriptions.catching_up() if self.subscriptions is not None else []
        return {
            "ready": ok and not catching_up,
            "models_without_healthy_worker": missing,
            "healthy_workers": sum(1 for w in self.registry.all() if w.healthy),
            "index_catching_up": catching_up,
        }

    def expected_models(self) -> list[str]:
        names = [m.name for m in self.config.models]
        for worker in self.config.workers:
            names.extend(worker.models)
        return list(dict.fromkeys(names))

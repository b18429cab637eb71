"""The worker registry as a :class:`~kvroute.router.discovery.base.WorkerSink`.

Structural on purpose (a Protocol for the three registry methods it calls), so discovery depends on the
registry's behaviour, not on its module: ``WorkerRegistry.add`` is async (it probes the new worker once
so it can take traffic at once) and raises ``ValueError`` for an id it already has; ``remove`` is
synchronous and raises ``KeyError`` for an unknown id.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from typing import Protocol

from kvroute.config import WorkerConfig

log = logging.getLogger("kvroute.discovery")


class _Registry(Protocol):
    def add(self, cfg: WorkerConfig) -> Awaitable[object]: ...

    def remove(self, worker_id: str) -> object: ...

    def get(self, worker_id: str) -> object | None: ...


class RegistrySink:
    """Applies discovery's decisions to a ``WorkerRegistry`` (the event subscriptions follow the registry)."""

    def __init__(self, registry: _Registry) -> None:
        self.registry = registry

    async def add(self, worker: WorkerConfig) -> None:
        if self.registry.get(worker.worker_id) is not None:
            # Added by hand through POST /admin/workers: the operator's entry stays, discovery retries later.
            raise ValueError(f"worker {worker.worker_id!r} is already in the registry")
        await self.registry.add(worker)

    async def remove(self, worker_id: str) -> None:
        try:
            self.registry.remove(worker_id)
        except KeyError:
            log.info("worker %s was already removed (by the admin API?)", worker_id)

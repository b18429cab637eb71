"""Answering a request: its tokens -> our block keys -> per worker entity, how much of the prefix it holds.

This is the routing decision's index step, so it stays a straight line: one dict read for the block
size, one key chain, one backend call. The chain comes from a :class:`~kvroute.indexer.keys.KeyChainCache`
(bounded in bytes): a prompt that extends a recent one hashes only its new blocks, with keys equal to
:func:`kvroute.indexer.keys.request_keys`'s. A reader of a shared index that never sees events learns
block sizes from the writer through the backend.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.indexer.backend import IndexBackend, IndexUnavailable, WorkerMatch
from kvroute.indexer.entities import Registry
from kvroute.indexer.keys import KeyChainCache
from kvroute.indexer.metrics import IndexerMetrics
from prometheus_client import Histogram

log = logging.getLogger("kvroute.indexer")

#: How often a reader asks the backend for a block size it does not know (seconds).
BLOCK_SIZE_ASK_INTERVAL_S = 5.0


@dataclass(slots=True)
class LookupResult:
    """A request's prefix as the index sees it."""

    model: str
    block_size: int | None
    num_blocks: int
    matches: dict[str, WorkerMatch] = field(default_factory=dict)
    keys: list[int] = field(default_factory=list)


class IndexLookup:
    """Request-side reads of one indexer's backend."""

    def __init__(
        self,
        backend: IndexBackend,
        registry: Registry,
        metrics: IndexerMetrics,
        *,
        key_cache_bytes: int = 16 << 20,
    ) -> None:
        self.backend = backend
        self.registry = registry
        self.metrics = metrics
        #: Recent prompts' key chains (``key_cache_bytes`` at most; 0 hashes every prompt from scratch).
        self.key_cache = KeyChainCache(key_cache_bytes)
        #: The latency child, resolved on first use: the lookup path must not pay ``labels()`` per request.
        self._lookup_seconds: Histogram | None = None

    def request_keys(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[int | None, list[int]]:
        info = self.registry.models.get(model)
        size = info.block_size if info else None
        if size is None:
            return None, []
        return size, self.key_cache.keys(token_ids, size, model, lora_name=lora_name, cache_salt=cache_salt)

    async def lookup_tokens(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> LookupResult:
        """Per worker entity, how much of this prompt's prefix it holds. Raises IndexUnavailable."""
        info = self.registry.models.get(model)
        size = info.block_size if info else None
        if size is None:
            await self._ask_block_size(model)
            size = self.registry.block_size(model)
        if size is None:
            return LookupResult(model, None, 0)
        keys = self.key_cache.keys(token_ids, size, model, lora_name=lora_name, cache_salt=cache_salt)
        result = LookupResult(model, size, len(keys), keys=keys)
        if keys:
            result.matches = await self.lookup_keys(model, keys)
        return result

    async def _ask_block_size(self, model: str) -> None:
        """Learn the block size from the writer of a shared index (asked at most every few seconds)."""
        info = self.registry.model_info(model)
        now = time.monotonic()
        if now < info.next_ask:
            return
        info.next_ask = now + BLOCK_SIZE_ASK_INTERVAL_S
        try:
            size = await self.backend.get_block_size(model)
        except IndexUnavailable as exc:
            self.metrics.backend_errors.labels(self.backend.name, "block_size").inc()
            raise exc from None
        if size and info.block_size is None:
            info.block_size = size
            info.published = True

    async def lookup_keys(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        start = time.perf_counter()
        try:
            matches = await self.backend.lookup(model, keys)
        except IndexUnavailable as exc:
            name = self.backend.name
            self.metrics.backend_errors.labels(name, "lookup").inc()
            self.metrics.backend_up.labels(name).set(0)
            log.warning("index lookup failed (%s): route by load", exc)
            raise
        elapsed = time.perf_counter() - start
        child = self._lookup_seconds
        if child is None:
            child = self._lookup_seconds = self.metrics.lookup_seconds.labels(self.backend.name)
        child.observe(elapsed)
        return matches

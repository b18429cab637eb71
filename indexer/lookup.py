"""Answering a request: its tokens -> our block keys -> per worker entity, how much of the prefix it holds.

This is the routing decision's index step, so it stays a straight line: one dict read for the block
size, one key chain, one backend call (a hybrid model's other KV-cache groups add one each, see
:mod:`kvroute.indexer.hybrid`; entities set aside as doubtful are left out). The chain comes from a
:class:`~kvroute.indexer.keys.KeyChainCache` (bounded in bytes): a prompt that extends a recent one
hashes only its new blocks, with keys equal to :func:`kvroute.indexer.keys.request_keys`'s. A reader of a
shared index that never sees events learns block sizes, lookahead and KV-cache groups from the writer
through the backend.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvroute.indexer.backend import IndexBackend, IndexUnavailable, WorkerMatch
from kvroute.indexer.entities import Registry
from kvroute.indexer.hybrid import hybrid_matches
from kvroute.indexer.ingest import ModelInfo
from kvroute.indexer.keys import KeyChainCache, lookahead_keys
from kvroute.indexer.metrics import IndexerMetrics
from kvroute.logs import RateLimitedLog
from prometheus_client import Histogram

log = logging.getLogger("kvroute.indexer")
#: A backend outage fails every lookup: one line per interval, not one per request.
limited = RateLimitedLog(log)

#: How often a reader asks the backend for what the writer learnt of a model (block size, lookahead, groups).
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

    def _keys(
        self, info: ModelInfo, size: int, token_ids: Sequence[int], lora_name: str | None, cache_salt: str | None
    ) -> list[int]:
        """The prompt's block keys as the engine's blocks are keyed: the plain chain (through the cache),
        with the model's lookahead tokens folded in when it hashes with lookahead (EAGLE)."""
        keys = self.key_cache.keys(token_ids, size, info.name, lora_name=lora_name, cache_salt=cache_salt)
        if info.lookahead:
            return lookahead_keys(keys, token_ids, size, info.lookahead)
        return keys

    def request_keys(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> tuple[int | None, list[int]]:
        info = self.registry.models.get(model)
        size = info.block_size if info else None
        if info is None or size is None:
            return None, []
        return size, self._keys(info, size, token_ids, lora_name, cache_salt)

    async def lookup_tokens(
        self, model: str, token_ids: Sequence[int], lora_name: str | None = None, cache_salt: str | None = None
    ) -> LookupResult:
        """Per worker entity, how much of this prompt's prefix it holds. Raises IndexUnavailable."""
        info = self.registry.models.get(model)
        if info is None or info.block_size is None or not info.from_events:
            await self._ask_meta(model)
            info = self.registry.models.get(model)
        size = info.block_size if info else None
        if info is None or size is None:
            return LookupResult(model, None, 0)
        keys = self._keys(info, size, token_ids, lora_name, cache_salt)
        result = LookupResult(model, size, len(keys), keys=keys)
        if keys:
            matches = await self.lookup_keys(model, keys)
            if info.side_groups:
                matches = await hybrid_matches(self.backend, info, keys, matches, (len(token_ids) - 1) // size)
            result.matches = self._trusted(matches) if self.registry.doubtful else matches
        return result

    def _trusted(self, matches: dict[str, WorkerMatch]) -> dict[str, WorkerMatch]:
        """``matches`` without the entities whose entries are doubtful (a reset or restart seen elsewhere
        than in their events, which have not come since): counting them would predict hits they lost."""
        doubtful = self.registry.is_doubtful
        return {entity: match for entity, match in matches.items() if not doubtful(entity)}

    async def _ask_meta(self, model: str) -> None:
        """Learn the block size, lookahead and KV-cache groups a shared index's writer published (asked at
        most every few seconds; a model whose events are applied here needs it only for its block size)."""
        info = self.registry.model_info(model)
        now = time.monotonic()
        if now < info.next_ask:
            return
        info.next_ask = now + BLOCK_SIZE_ASK_INTERVAL_S
        try:
            meta = await self.backend.get_model_meta(model)
        except IndexUnavailable as exc:
            self.metrics.backend_errors.labels(self.backend.name, "block_size").inc()
            raise exc from None
        if meta and not info.from_events:
            info.adopt(meta)

    async def lookup_keys(self, model: str, keys: Sequence[int]) -> dict[str, WorkerMatch]:
        start = time.perf_counter()
        try:
            matches = await self.backend.lookup(model, keys)
        except IndexUnavailable as exc:
            name = self.backend.name
            self.metrics.backend_errors.labels(name, "lookup").inc()
            self.metrics.backend_up.labels(name).set(0)
            limited.warning(f"lookup:{name}", "index lookup failed (%s): route by load", exc)
            raise
        elapsed = time.perf_counter() - start
        child = self._lookup_seconds
        if child is None:
            child = self._lookup_seconds = self.metrics.lookup_seconds.labels(self.backend.name)
        child.observe(elapsed)
        return matches

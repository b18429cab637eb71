"""What the router learns about a request before the policy decides: tokens -> keys -> lookup -> conversation.

:class:`FactGatherer` runs the KV steps of the request flow for generation routes, and only the ones the
policy asks for (``needs_index``, ``needs_text``) or conversation reuse needs. Every step degrades: no
tokens, no index or no conversation store means routing by load or recomputing, never a failed request.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from kvroute.indexer.backend import IndexUnavailable, WorkerMatch
from kvroute.indexer.entities import split_entity
from kvroute.indexer.service import KVIndexer
from kvroute.logs import RateLimitedLog
from kvroute.policies.base import Policy, RouteRequest
from kvroute.router.conversations import ConversationEntry, ConversationStore
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.registry import WorkerRegistry
from kvroute.router.requests import ParsedRequest, prompt_text
from kvroute.router.tokens import TokenizeError, Tokenizers

log = logging.getLogger("kvroute.facts")
#: Per-request failures (tokenizer down, conversation store down) are counted each time, logged rarely.
limited = RateLimitedLog(log)


@dataclass(slots=True)
class Facts:
    """The policy's view of the request, plus what the later steps of the flow need from the lookup."""

    route: RouteRequest
    #: The prompt's block keys; None when the index was not consulted.
    keys: list[int] | None = None
    #: The previous turn's entry taken from the conversation store (single use).
    conversation: ConversationEntry | None = None
    #: Per data-parallel worker, the rank holding the longest prefix (sent as ``X-data-parallel-rank``).
    ranks: dict[str, int] = field(default_factory=dict)


def fold_ranks(
    matches: dict[str, WorkerMatch], data_parallel: Callable[[str], bool]
) -> tuple[dict[str, WorkerMatch], dict[str, int]]:
    """The index knows each data-parallel rank apart (``worker#rank``); a policy picks workers. Each worker
    gets its best rank's match, and for a data-parallel worker (``data_parallel(worker)``) that rank is
    remembered, rank 0 included, so the request is steered to it."""
    if not any("#" in entity for entity in matches) and not any(data_parallel(w) for w in matches):
        return matches, {}
    folded: dict[str, WorkerMatch] = {}
    ranks: dict[str, int] = {}
    for entity, match in matches.items():
        worker, rank = split_entity(entity)
        best = folded.get(worker)
        if best is None or (match.blocks, match.gpu) > (best.blocks, best.gpu):
            folded[worker] = replace(match, worker_id=worker)
            if data_parallel(worker):
                ranks[worker] = rank
    return folded, ranks


class FactGatherer:
    """Tokenizes the prompt exactly as the engine will, looks its block keys up in the index, and takes the
    conversation store's entry from the previous turn."""

    def __init__(
        self,
        registry: WorkerRegistry,
        metrics: KVRouteMetrics,
        *,
        tokenizers: Tokenizers | None,
        indexer: KVIndexer | None,
        conversations: ConversationStore | None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.indexer = indexer
        self.conversations = conversations

    def _data_parallel(self, worker_id: str) -> bool:
        state = self.registry.get(worker_id)
        return state is not None and state.config.dp_size > 1

    async def gather(self, request: ParsedRequest, policy: Policy, *, dry_run: bool = False) -> Facts:
        """``dry_run`` (explain) must not consume the single-use conversation entry."""
        facts = Facts(
            RouteRequest(
                request_id=request.request_id,
                model=request.model or "",
                max_tokens=request.max_tokens,
                latency_class=request.latency_class,
            )
        )
        body = request.json
        if body is None or not request.generation:
            return facts
        cid = request.conversation_id
        # Conversation reuse needs the prompt's block keys too, whatever the policy.
        wants_keys = policy.needs_index or (cid is not None and self.conversations is not None)
        if wants_keys and self.indexer is not None and self.tokenizers is not None:
            facts.keys = await self._lookup(request, facts)
        if policy.needs_text:
            facts.route.prompt_text = prompt_text(body)
        if cid and self.conversations is not None and facts.keys and facts.route.block_size and not dry_run:
            facts.conversation = await self._take_conversation(facts.route, cid, facts.keys)
        return facts

    async def _lookup(self, request: ParsedRequest, facts: Facts) -> list[int] | None:
        assert self.indexer is not None and self.tokenizers is not None and request.json is not None
        body = request.json
        route = facts.route
        try:
            tokens = await self.tokenizers.tokens_for_body(route.model, body)
        except TokenizeError as exc:
            self.metrics.fallbacks.labels("tokenizer").inc()
            limited.warning(
                f"tokenizer:{route.model}",
                "request %s: no tokens (%s); routing without the index",
                request.request_id,
                exc,
            )
            return None
        route.prompt_tokens = len(tokens)
        salt = body.get("cache_salt")
        try:
            result = await self.indexer.lookup_tokens(
                route.model, tokens, cache_salt=salt if isinstance(salt, str) else None
            )
        except IndexUnavailable:
            self.metrics.fallbacks.labels("index_unavailable").inc()
            return None
        if result.block_size:
            route.block_size = result.block_size
        route.matches, facts.ranks = fold_ranks(result.matches, self._data_parallel)
        return result.keys

    async def _take_conversation(self, route: RouteRequest, cid: str, keys: list[int]) -> ConversationEntry | None:
        assert self.conversations is not None
        try:
            entry = await self.conversations.take(cid)
        except Exception as exc:  # a store outage costs reuse, never the request
            self.metrics.fallbacks.labels("conversation_store").inc()
            limited.warning("conversation_store", "conversation store failed: %r", exc)
            return None
        if entry is None:
            return None
        self.metrics.conversations.labels("taken").inc()
        if self.registry.get(entry.worker_id) is None:
            return None  # peers are only registered workers
        route.conversation_reusable_tokens = entry.reusable_tokens(keys, route.block_size)
        route.conversation_worker = entry.worker_id
        return entry

"""What the router learns about a request before the policy decides: tokens -> keys -> lookup -> conversation.

:class:`FactGatherer` runs the KV steps of the request flow for generation routes (completions, chat,
Messages, Responses), and only the ones the policy asks for (``needs_index``, ``needs_text``) or
conversation reuse needs. Every step degrades: no tokens, no index or no conversation store means routing
by load or recomputing, never a failed request; a prompt that cannot be known exactly here (an image for
a local tokenizer, a previous response one engine keeps) is routed by load and counted per surface and
reason (``kvroute_unrendered_requests_total``), never guessed.
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
from kvroute.router.routed_prefixes import RoutedPrefixes
from kvroute.router.tokens import TokenizeError, Tokenizers, Unrenderable

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
    #: The LoRA adapter the request names (looked up under its base model with the adapter's key).
    lora: str | None = None


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
        routed: RoutedPrefixes | None = None,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.indexer = indexer
        self.conversations = conversations
        #: Prefixes just routed, seen as GPU hits until their events arrive (None: the index alone).
        self.routed = routed

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
            chat = request.prompt.chat if request.prompt is not None else None
            facts.route.prompt_text = prompt_text(body if chat is None else {"messages": chat.messages})
        if cid and self.conversations is not None and facts.keys and facts.route.block_size and not dry_run:
            facts.conversation = await self._take_conversation(facts.route, cid, facts.keys)
        return facts

    async def _lookup(self, request: ParsedRequest, facts: Facts) -> list[int] | None:
        assert self.indexer is not None and self.tokenizers is not None and request.json is not None
        body = request.json
        route = facts.route
        # A LoRA adapter runs on its base: the base's tokenizer, the base's blocks (events come under the base
        # model), keyed with the adapter's name as vLLM does, so base blocks never count for the adapter.
        base = self.registry.base_of(route.model)
        model, lora = (base, route.model) if base else (route.model, None)
        facts.lora = lora
        prompt = request.prompt
        if prompt is not None and prompt.load_only:
            self.metrics.unrendered.labels(prompt.surface, prompt.load_only).inc()
            return None
        try:
            tokens = await self.tokenizers.tokens_for_request(model, request.route, body, prompt)
        except Unrenderable as exc:
            self.metrics.unrendered.labels(prompt.surface if prompt else "other", exc.reason).inc()
            return None
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
                model, tokens, lora_name=lora, cache_salt=salt if isinstance(salt, str) else None
            )
        except IndexUnavailable:
            self.metrics.fallbacks.labels("index_unavailable").inc()
            return None
        if result.block_size:
            route.block_size = result.block_size
        route.matches, facts.ranks = fold_ranks(result.matches, self._data_parallel)
        route.block_keys = result.keys
        if self.routed is not None and result.keys:
            self._add_routed(route, result.keys)
        return result.keys

    def _add_routed(self, route: RouteRequest, keys: list[int]) -> None:
        """A worker the prefix was just sent to holds it as soon as that request's prefill runs: beyond what
        the index knows there, the rest of the routed prefix counts as GPU blocks (reconciled by the events).
        What a routed request is still computing there is marked ``pending``: no peer's source yet."""
        assert self.routed is not None
        for worker, (blocks, ready) in self.routed.held_ready(route.model, keys).items():
            match = route.matches.get(worker) or WorkerMatch(worker)
            if blocks > match.blocks:
                match = replace(match, blocks=blocks, gpu=match.gpu + blocks - match.blocks)
                self.metrics.routed_prefix_hits.inc()
            if ready < blocks:
                match = replace(match, pending=match.blocks - ready)
            route.matches[worker] = match

    def routed_to(self, facts: Facts, worker_id: str) -> None:
        """The policy sent the request's prefill to ``worker_id``: later requests sharing it may follow. What
        the worker was not known to hold ready, it computes now."""
        if self.routed is not None and facts.keys:
            match = facts.route.matches.get(worker_id)
            ready = match.blocks - match.pending if match is not None else 0
            self.routed.note(facts.route.request_id, facts.route.model, worker_id, facts.keys, ready)

    def settled(self, facts: Facts) -> None:
        """The request's first bytes came back (its prefill ran, so the engine has published its blocks'
        events: the index speaks for them now), or it failed and its prefix will not be there."""
        if self.routed is not None:
            self.routed.forget(facts.route.request_id)

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

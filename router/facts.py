"""What the router learns about a request before the policy decides: tokens -> keys -> lookup -> conversation.

:class:`FactGatherer` runs the KV steps of the request flow for generation routes (completions, chat,
Messages, Responses), and only the ones the policy asks for (``needs_index``, ``needs_text``) or
conversation reuse needs. Every step degrades: no tokens, no index or no conversation store means routing
by load or recomputing, never a failed request; a prompt that cannot be known exactly here (an image for
a local tokenizer, a previous response one engine keeps) is routed by load and counted per surface and
reason (``kvroute_unrendered_requests_total``), never guessed.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TypeVar

from kvroute.indexer.backend import IndexUnavailable, WorkerMatch
from kvroute.indexer.entities import split_entity
from kvroute.indexer.service import KVIndexer
from kvroute.logs import RateLimitedLog
from kvroute.policies.base import Policy, RouteRequest
from kvroute.router.conversations import ConversationEntry, ConversationStore
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.prompt_head import PromptHead
from kvroute.router.registry import WorkerRegistry
from kvroute.router.requests import ParsedRequest, prompt_text
from kvroute.router.routed_prefixes import RoutedPrefixes
from kvroute.router.tokens import TokenizeError, Tokenizers, Unrenderable

log = logging.getLogger("kvroute.facts")
#: Per-request failures (tokenizer down, conversation store down) are counted each time, logged rarely.
limited = RateLimitedLog(log)
T = TypeVar("T")


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
    #: A prompt decided on its head: encodes the rest once the request is routed.
    finish_head: Callable[[], None] | None = None


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


def _salt(request: ParsedRequest) -> str | None:
    """The request's ``cache_salt`` (vLLM keys its blocks with it), when it is a string."""
    salt = request.json.get("cache_salt") if request.json is not None else None
    return salt if isinstance(salt, str) else None


def _holds_whole(matches: dict[str, WorkerMatch], head_blocks: int) -> bool:
    """Whether some worker holds (or was just sent) all ``head_blocks`` blocks of a prompt's head."""
    return head_blocks <= 0 or any(m.blocks >= head_blocks for m in matches.values())


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
        heads: bool = True,
    ) -> None:
        self.registry = registry
        self.metrics = metrics
        self.tokenizers = tokenizers
        self.indexer = indexer
        self.conversations = conversations
        #: Prefixes just routed, seen as GPU hits until their events arrive (None: the index alone).
        self.routed = routed
        #: Whether a long new prompt may be decided on its head (:mod:`~kvroute.router.prompt_head`).
        self.heads = heads
        #: The rests of prompts decided on their heads, being encoded (held so they are not collected).
        self._finishing: set[asyncio.Task[None]] = set()

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
            heads = self.heads and policy.needs_index and cid is None  # conversation reuse needs every key
            facts.keys = await self._lookup(request, facts, heads)
        if policy.needs_text:
            chat = request.prompt.chat if request.prompt is not None else None
            facts.route.prompt_text = prompt_text(body if chat is None else {"messages": chat.messages})
        if cid and self.conversations is not None and facts.keys and facts.route.block_size and not dry_run:
            facts.conversation = await self._take_conversation(facts.route, cid, facts.keys)
        return facts

    async def _lookup(self, request: ParsedRequest, facts: Facts, heads: bool) -> list[int] | None:
        """The prompt's tokens, looked up; ``heads``: a long new prompt may be decided on its head."""
        assert self.indexer is not None and self.tokenizers is not None and request.json is not None
        route = facts.route
        # A LoRA adapter runs on its base: the base's tokenizer, the base's blocks (events come under the base
        # model), keyed with the adapter's name as vLLM does, so base blocks never count for the adapter.
        base = self.registry.base_of(route.model)
        model, facts.lora = (base, route.model) if base else (route.model, None)
        prompt = request.prompt
        if prompt is not None and prompt.load_only:
            self.metrics.unrendered.labels(prompt.surface, prompt.load_only).inc()
            return None
        tokenize = self.tokenizers.head_for_request if heads else self.tokenizers.tokens_for_request
        got = await self._tokens(request, model, tokenize(model, request.route, request.json, prompt))
        if isinstance(got, PromptHead):
            keys = await self._find(request, facts, model, got.tokens)
            block = route.block_size
            if keys is not None and block and not _holds_whole(route.matches, len(got.tokens) // block):
                # Nobody holds past the head: the whole prompt's lookup would find no more.
                route.prompt_tokens = got.estimated_total
                self.metrics.prompt_heads.labels("decided").inc()
                facts.finish_head = functools.partial(self._finish_head, request, facts, model, got)
                return keys
            self.metrics.prompt_heads.labels("encoded_whole").inc()
            tokens = await self._tokens(request, model, got.rest())
        else:
            tokens = got
        if tokens is None:
            return None
        route.prompt_tokens = len(tokens)
        return await self._find(request, facts, model, tokens)

    async def _tokens(self, request: ParsedRequest, model: str, pending: Awaitable[T]) -> T | None:
        """What ``pending`` tokenizes; None (counted, logged rarely) when it cannot."""
        try:
            return await pending
        except Unrenderable as exc:
            prompt = request.prompt
            self.metrics.unrendered.labels(prompt.surface if prompt else "other", exc.reason).inc()
        except TokenizeError as exc:
            self.metrics.fallbacks.labels("tokenizer").inc()
            limited.warning(
                f"tokenizer:{model}",
                "request %s: no tokens (%s); routing without the index",
                request.request_id,
                exc,
            )
        return None

    async def _find(self, request: ParsedRequest, facts: Facts, model: str, tokens: Sequence[int]) -> list[int] | None:
        """``tokens`` looked up: the route's matches (ranks folded, routed prefixes added) and block keys."""
        assert self.indexer is not None
        route = facts.route
        try:
            result = await self.indexer.lookup_tokens(model, tokens, lora_name=facts.lora, cache_salt=_salt(request))
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

    def _finish_head(self, request: ParsedRequest, facts: Facts, model: str, head: PromptHead) -> None:
        """The rest of a prompt decided on its head, encoded once the request is routed (the next turn's prefix
        cache), the head checked against it, and the request's routed note made whole (wherever it went)."""

        async def finish() -> None:
            try:
                tokens = await head.rest()
            except Exception as exc:  # off the request's path: its answer is not at stake, only the cache's
                limited.warning(f"tokenizer:{model}", "request %s: its rest: %r", request.request_id, exc)
                return
            n = len(head.tokens)
            if list(tokens[:n]) != list(head.tokens):
                self.metrics.prompt_heads.labels("mismatch").inc()
                limited.warning(
                    f"head:{model}",
                    "request %s: its head's tokens differ from the whole prompt's: this tokenizer's pieces change "
                    "where a head is cut; set prompt_heads: false",
                    request.request_id,
                )
                return
            facts.keys = self._keys(request, facts, model, tokens)
            if self.routed is not None and facts.keys:
                self.routed.grow(facts.route.request_id, facts.keys)

        task = asyncio.get_running_loop().create_task(finish())
        self._finishing.add(task)
        task.add_done_callback(self._finishing.discard)

    def _keys(self, request: ParsedRequest, facts: Facts, model: str, tokens: Sequence[int]) -> list[int]:
        assert self.indexer is not None
        return self.indexer.request_keys(model, tokens, facts.lora, _salt(request))[1]

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
        finish, facts.finish_head = facts.finish_head, None
        if finish is not None:
            finish()

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

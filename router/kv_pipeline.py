"""The KV-aware request flow: tokens and index lookup before the decision, multi-leg plans after it.

:class:`KVPipeline` extends the base :class:`~kvroute.router.pipeline.Pipeline` through its hooks:

* ``gather_facts`` strips client routing fields (always), pops ``conversation_id``, and — for policies
  that ask — tokenizes the prompt exactly as the engine will, looks its block keys up in the index, and
  takes the conversation store's entry from the previous turn;
* ``executor_for`` keeps the plain one-worker forward for local plans and uses :class:`FlowExecutor` for
  plans that need ``kv_transfer_params`` or two legs (P/D over P2P or NixlConnector);
* ``report`` adds the prediction check: predicted cached tokens against the engine's report.

Every KV step degrades to routing by load or to local recomputation; none of them can fail a request.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import orjson
from kvroute.indexer.backend import IndexUnavailable
from kvroute.indexer.service import KVIndexer
from kvroute.policies.base import Policy, RoutePlan, RouteRequest
from kvroute.router.conversations import (
    ConversationEntry,
    ConversationError,
    ConversationStore,
    entry_from_turn,
    pop_conversation_id,
)
from kvroute.router.errors import ApiError
from kvroute.router.forwarding import Result
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.kv_params import KVParamsError, Leg, build_flow, sanitize_client_body
from kvroute.router.pipeline import Executor, Pipeline, RequestContext
from kvroute.router.tokens import TokenizeError, Tokenizers
from kvroute.router.transport import UpstreamError
from starlette.responses import Response

log = logging.getLogger("kvroute.kv")

GENERATION_ROUTES = frozenset({"/v1/chat/completions", "/v1/completions"})


@dataclass(slots=True)
class KVParts:
    """What the KV-aware flow needs besides the base pipeline; any part may be absent."""

    metrics: KVRouteMetrics
    indexer: KVIndexer | None = None
    tokenizers: Tokenizers | None = None
    conversations: ConversationStore | None = None
    protocol: str = "none"
    client_kv_params: str = "strip"


def prompt_text(body: dict[str, Any]) -> str | None:
    """The prompt as text, for text-approximate policies (chat: the messages' contents in order)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        parts = []
        for message in messages:
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str):
                parts.append(content)
            elif isinstance(content, list):
                parts.extend(p.get("text", "") for p in content if isinstance(p, dict))
        return "\n".join(parts)
    prompt = body.get("prompt")
    return prompt if isinstance(prompt, str) else None


class KVPipeline(Pipeline):
    """The pipeline with KV facts and KV plans; :meth:`attach` gives it its parts."""

    kv: KVParts

    def attach(self, parts: KVParts) -> None:
        self.kv = parts
        self.flow_executor = FlowExecutor()

    # ------------------------------------------------------------------ facts

    async def gather_facts(self, ctx: RequestContext, policy: Policy) -> RouteRequest:
        facts = await super().gather_facts(ctx, policy)
        body = ctx.json
        if body is None or ctx.route not in GENERATION_ROUTES:
            return facts
        self._sanitize(ctx, body)
        cid = ctx.extra.get("conversation_id")
        keys: list[int] = []
        # Conversation reuse needs the prompt's block keys too, whatever the policy.
        wants_keys = policy.needs_index or (cid is not None and self.kv.conversations is not None)
        if wants_keys and self.kv.indexer is not None and self.kv.tokenizers is not None:
            keys = await self._lookup(ctx, facts, body)
        if policy.needs_text:
            facts.prompt_text = prompt_text(body)
        dry_run = ctx.extra.get("dry_run", False)  # explain must not consume the single-use entry
        if cid and self.kv.conversations is not None and keys and facts.block_size and not dry_run:
            await self._take_conversation(ctx, facts, cid, keys)
        return facts

    def _sanitize(self, ctx: RequestContext, body: dict[str, Any]) -> None:
        """Clients never choose routing: their kv_transfer_params go (or the request is refused)."""
        changed = False
        if "kv_transfer_params" in body:
            try:
                body, removed = sanitize_client_body(body, self.kv.client_kv_params)  # type: ignore[arg-type]
            except KVParamsError as exc:
                raise ApiError(400, str(exc), "kv_transfer_params_not_allowed") from None
            self.kv.metrics.client_params.inc(len(removed) or 1)
            changed = True
        headers = ctx.http.headers if ctx.http is not None else {}
        try:
            had_field = "conversation_id" in body
            cid = pop_conversation_id(body, headers)
        except ConversationError as exc:
            raise ApiError(400, str(exc), "invalid_conversation_id") from None
        changed = changed or had_field
        if cid:
            ctx.extra["conversation_id"] = cid
        if changed:
            ctx.json = body
            ctx.body = orjson.dumps(body)

    async def _lookup(self, ctx: RequestContext, facts: RouteRequest, body: dict[str, Any]) -> list[int]:
        assert self.kv.indexer is not None and self.kv.tokenizers is not None
        model = ctx.model or ""
        try:
            tokens = await self.kv.tokenizers.tokens_for_body(model, body)
        except TokenizeError as exc:
            self.kv.metrics.fallbacks.labels("tokenizer").inc()
            log.warning("request %s: no tokens (%s); routing without the index", ctx.request_id, exc)
            return []
        facts.prompt_tokens = len(tokens)
        salt = body.get("cache_salt")
        try:
            result = await self.kv.indexer.lookup_tokens(
                model, tokens, cache_salt=salt if isinstance(salt, str) else None
            )
        except IndexUnavailable:
            self.kv.metrics.fallbacks.labels("index_unavailable").inc()
            return []
        if result.block_size:
            facts.block_size = result.block_size
        facts.matches = result.matches
        ctx.extra["block_keys"] = result.keys
        return result.keys

    async def _take_conversation(self, ctx: RequestContext, facts: RouteRequest, cid: str, keys: list[int]) -> None:
        assert self.kv.conversations is not None
        try:
            entry = await self.kv.conversations.take(cid)
        except Exception as exc:  # a store outage costs reuse, never the request
            self.kv.metrics.fallbacks.labels("conversation_store").inc()
            log.warning("conversation store failed: %r", exc)
            return
        if entry is None:
            return
        self.kv.metrics.conversations.labels("taken").inc()
        if self.registry.get(entry.worker_id) is None:
            return  # peers are only registered workers
        facts.conversation_reusable_tokens = entry.reusable_tokens(keys, facts.block_size)
        facts.conversation_worker = entry.worker_id
        ctx.extra["conversation_entry"] = entry

    # ------------------------------------------------------------------ plans

    def executor_for(self, ctx: RequestContext, plan: RoutePlan) -> Executor:
        if ctx.route not in GENERATION_ROUTES or ctx.json is None:
            return self.executor
        local = not plan.disaggregated and not plan.kv_source
        if self.kv.protocol == "none" and local:
            return self.executor
        if self.kv.protocol == "p2p" and local and plan.kv_load_tiers is None and plan.max_offload_tokens is None:
            return self.executor
        return self.flow_executor

    def report(self, ctx: RequestContext, plan: RoutePlan, result: Result) -> None:
        super().report(ctx, plan, result)
        m = self.kv.metrics
        shape = "pd" if plan.disaggregated else "aggregated"
        if plan.kv_source:
            shape += "+p2p"
        if plan.reuse_conversation:
            shape += "+conversation"
        m.decisions.labels(plan.policy or self.policy.name, shape).inc()
        if "block_keys" not in ctx.extra or not result.ok:
            return
        model = ctx.model or ""
        m.predicted.labels(model).inc(plan.predicted_cached_tokens)
        for tier, tokens in plan.predicted_by_tier.items():
            m.predicted_by_tier.labels(tier).inc(tokens)
        m.bytes_moved.inc(int(plan.breakdown.get("bytes_moved", 0)))
        details = (result.usage or {}).get("prompt_tokens_details")
        reported = details.get("cached_tokens") if isinstance(details, dict) else None
        if isinstance(reported, int):
            m.checked.labels(model).inc()
            m.reported.labels(model).inc(reported)
            block = ctx.facts.block_size if ctx.facts is not None else 16
            if plan.predicted_cached_tokens > reported + block:
                m.stale.labels(model).inc()


class PrefillFailed(RuntimeError):
    """The prefill leg answered, but not with something the decode leg can use."""


class FlowExecutor:
    """Carries out plans that need ``kv_transfer_params``: P2P keys, P/D legs, conversation reuse.

    A failed prefill leg falls back to local recomputation on the decode worker; an engine that misses a
    peer lookup recomputes by itself. So a stale or failed plan costs time, never the request.
    """

    async def execute(self, pipeline: Pipeline, ctx: RequestContext, plan: RoutePlan) -> Response:
        assert isinstance(pipeline, KVPipeline) and ctx.json is not None
        kv = pipeline.kv
        views = {v.id: v for v in pipeline.registry.views(ctx.model)}
        entry: ConversationEntry | None = ctx.extra.get("conversation_entry")
        conversation_params = entry.kv_transfer_params if entry is not None and plan.reuse_conversation else None
        try:
            flow = build_flow(
                ctx.json,
                plan,
                views,
                protocol=kv.protocol,  # type: ignore[arg-type]
                request_id=ctx.request_id,
                conversation_params=conversation_params,
            )
        except KVParamsError as exc:
            log.error("request %s: plan %s cannot be carried out: %s", ctx.request_id, plan.to_dict(), exc)
            raise ApiError(
                503, f"the routing plan cannot be carried out on this pool: {exc}", "unroutable_plan"
            ) from None
        final = flow.final
        if flow.prefill is not None:
            try:
                answer = await self._prefill(pipeline, ctx, flow.prefill)
                final = flow.decode_leg(answer)
                if conversation_params:
                    kv.metrics.conversations.labels("reused").inc()
            except (UpstreamError, KVParamsError, PrefillFailed) as exc:
                kv.metrics.fallbacks.labels("prefill_leg").inc()
                log.warning(
                    "request %s: prefill leg on %s failed (%s); recomputing on %s",
                    ctx.request_id,
                    flow.prefill.worker_id,
                    exc,
                    plan.decode,
                )
                final = flow.fallback_leg()
        assert final is not None
        ctx.tried.add(final.worker_id)
        opened = await pipeline.forwarder.open(
            final.worker_id, "POST", ctx.path, ctx.headers, orjson.dumps(final.body), ctx.started
        )
        cid = ctx.extra.get("conversation_id")
        if cid and kv.conversations is not None and opened.rest is None and opened.upstream.status == 200:
            await self._remember(pipeline, ctx, cid, final, opened.first)
        return pipeline.forwarder.respond(
            opened, ctx.request_id, lambda r: pipeline.report(ctx, plan, r), pipeline.debug_headers(ctx, plan)
        )

    @staticmethod
    async def _prefill(pipeline: Pipeline, ctx: RequestContext, leg: Leg) -> Any:
        """Run a prefill-only leg to completion; its JSON answer feeds the decode leg."""
        opened = await pipeline.forwarder.open(
            leg.worker_id, "POST", ctx.path, ctx.headers, orjson.dumps(leg.body), ctx.started
        )
        try:
            if opened.rest is not None:
                raise PrefillFailed("the prefill leg streamed its answer")
            if opened.upstream.status != 200:
                raise PrefillFailed(f"status {opened.upstream.status}: {opened.first[:200]!r}")
            try:
                return orjson.loads(opened.first)
            except orjson.JSONDecodeError:
                raise PrefillFailed("the prefill leg's answer is not JSON") from None
        finally:
            if opened.rest is not None:
                await opened.upstream.aclose()
            pipeline.registry.release(leg.worker_id)

    @staticmethod
    async def _remember(pipeline: KVPipeline, ctx: RequestContext, cid: str, leg: Leg, raw: bytes) -> None:
        """Keep the decoder's returned kv_transfer_params for the conversation's next turn."""
        if b'"kv_transfer_params"' not in raw:
            return
        store = pipeline.kv.conversations
        assert store is not None
        try:
            answer = orjson.loads(raw)
            usage = answer.get("usage") or {}
            entry = entry_from_turn(
                leg.worker_id,
                answer,
                ctx.extra.get("block_keys") or [],
                int(usage.get("prompt_tokens") or 0),
                int(usage.get("completion_tokens") or 0),
            )
            if entry is not None:
                await store.put(cid, entry)
                pipeline.kv.metrics.conversations.labels("stored").inc()
        except Exception as exc:  # never fail an answer that is already in hand
            log.warning("request %s: conversation not stored: %r", ctx.request_id, exc)

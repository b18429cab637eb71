"""The request flow, top to bottom: parse -> tokens -> keys -> lookup -> policy -> rewrite -> forward -> report.

One :class:`RequestFlow` serves every entry point. ``kvroute serve`` calls :meth:`RequestFlow.handle`
(decide, execute, retry once elsewhere before any byte went out); the Endpoint Picker calls
:meth:`~RequestFlow.decide` and :meth:`~RequestFlow.rewrite` and lets Envoy forward;
``/admin/route/explain`` calls :meth:`~RequestFlow.decide` as a dry run. Parsing happens before
(:func:`~kvroute.router.requests.parse_request`), the KV facts in :class:`~kvroute.router.facts.FactGatherer`,
the bodies in :mod:`~kvroute.router.kv_params`, the bytes in :class:`~kvroute.router.forwarding.Forwarder`,
the bookkeeping in :class:`~kvroute.router.outcomes.Outcomes`.

A stale or failed plan costs time, never the request: a failed prefill leg falls back to local
recomputation on the decode worker, and an engine that misses a peer lookup recomputes by itself.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import orjson
from kvroute.logs import RateLimitedLog
from kvroute.policies.base import NoWorkerError, Policy, RoutePlan, WorkerView
from kvroute.router.conversations import ConversationStore, entry_from_turn
from kvroute.router.errors import ApiError, model_not_found, no_healthy_worker
from kvroute.router.facts import FactGatherer, Facts
from kvroute.router.forwarding import Forwarder, RawResponse, Result, response_headers
from kvroute.router.kv_metrics import KVRouteMetrics
from kvroute.router.kv_params import KVParamsError, Leg, Legs, build_legs
from kvroute.router.metrics import RouterMetrics
from kvroute.router.outcomes import Outcomes, PrefillLegAnswer
from kvroute.router.registry import WorkerRegistry
from kvroute.router.requests import ParsedRequest
from kvroute.router.surfaces import usage_counts
from kvroute.router.transport import UpstreamError
from kvroute.vocabulary import KVProtocol
from starlette.responses import Response

log = logging.getLogger("kvroute.flow")
limited = RateLimitedLog(log)


@dataclass(slots=True)
class Decision:
    """A routed request: what the flow learnt and what the policy chose."""

    request: ParsedRequest
    facts: Facts
    plan: RoutePlan
    #: The candidates the policy saw (the rewrite names peers among them, without asking the registry again).
    views: list[WorkerView]


@dataclass(slots=True)
class Delivery:
    """How a plan is carried out: the worker that answers the client and the bytes it gets, or the legs
    (prefill first) when the plan needs ``kv_transfer_params``."""

    worker_id: str
    body: bytes
    legs: Legs | None = None

    @property
    def single_leg(self) -> bool:
        return self.legs is None or (self.legs.prefill is None and self.legs.final is not None)


#: vLLM's header choosing the data-parallel rank of a request (ignored by engines without DP).
DP_RANK_HEADER = "x-data-parallel-rank"
#: Worker answers that mean "not now, try elsewhere" when they come before any byte of an answer.
REFUSAL_STATUSES = frozenset({429, 503})
#: Pause before offering every worker again when all of them refused.
REFUSED_BACKOFF_S = 0.05


class Rejected(UpstreamError):
    """A worker refused the request before doing any work; its answer is kept in case everyone refuses."""

    def __init__(self, worker_id: str, status: int, headers: list[tuple[str, str]], body: bytes) -> None:
        super().__init__("rejected", f"worker {worker_id} refused the request ({status})")
        self.worker_id = worker_id
        self.status = status
        self.headers = headers
        self.body = body

    def response(self, request_id: str) -> Response:
        return RawResponse(self.body, self.status, response_headers(self.headers, request_id))


class PrefillFailed(RuntimeError):
    """The prefill leg answered, but not with something the decode leg can use."""


class RequestFlow:
    """Routes one parsed request and answers it."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        forwarder: Forwarder,
        facts: FactGatherer,
        outcomes: Outcomes,
        metrics: RouterMetrics,
        kv_metrics: KVRouteMetrics,
        *,
        protocol: KVProtocol = "none",
        conversations: ConversationStore | None = None,
        debug_headers: bool = False,
        max_attempts: int = 3,
        refusal_cooldown_s: float = 1.0,
        early_head_ttft_s: float = 0.0,
    ) -> None:
        self.registry = registry
        #: Replaceable at run time (tests swap in a fixed plan); read once per decision.
        self.policy = policy
        self.forwarder = forwarder
        self.facts = facts
        self.outcomes = outcomes
        self.metrics = metrics
        self.kv_metrics = kv_metrics
        self.protocol = protocol
        self.conversations = conversations
        self.allow_debug = debug_headers
        self.max_attempts = max_attempts
        self.refusal_cooldown_s = refusal_cooldown_s
        self.early_head_ttft_s = early_head_ttft_s

    # ------------------------------------------------------------------ serve: the whole flow

    async def handle(self, request: ParsedRequest) -> Response:
        """Decide and carry out; a worker that failed or refused (admission control) before answering is
        replaced by the next-best plan, never the same worker twice, ``max_attempts`` in all. When every
        candidate refused, back off briefly and offer them all again; the last refusal is the answer."""
        decision = await self.decide(request)
        failure: UpstreamError | None = None
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await self.execute(decision)
            except UpstreamError as exc:
                self.facts.settled(decision.facts)
                if exc.kind == "timeout":
                    raise upstream_api_error(exc) from None
                failure = exc
            if attempt == self.max_attempts:
                break
            log.info("request %s: %s; trying another worker", request.request_id, failure)
            try:
                decision = await self.decide(request, exclude=request.tried, facts=decision.facts)
            except ApiError:
                if not isinstance(failure, Rejected):
                    break
                await asyncio.sleep(REFUSED_BACKOFF_S * attempt)  # everyone refused: give queues a moment
                request.tried.clear()
                try:
                    decision = await self.decide(request, facts=decision.facts)
                except ApiError:
                    break
            self.metrics.retries.inc()
        assert failure is not None
        if isinstance(failure, Rejected):
            return failure.response(request.request_id)
        raise upstream_api_error(failure) from None

    # ------------------------------------------------------------------ tokens -> keys -> lookup -> policy

    async def decide(
        self,
        request: ParsedRequest,
        *,
        exclude: Collection[str] = (),
        dry_run: bool = False,
        facts: Facts | None = None,
    ) -> Decision:
        """Gather facts (once per request) and ask the policy, among healthy workers serving the model.
        ``dry_run`` (explain) asks ``policy.explain`` and changes no state anywhere."""
        began = time.perf_counter()
        if request.model and not self.registry.knows_model(request.model):
            raise model_not_found(request.model)
        views = self.registry.views(request.model)
        if exclude:
            views = [v for v in views if v.id not in exclude]
        if not views:
            raise no_healthy_worker(request.model)
        if request.stripped_client_params and not dry_run and facts is None:
            self.kv_metrics.client_params.inc(request.stripped_client_params)
        policy = self.policy
        if facts is None:
            facts = await self.facts.gather(request, policy, dry_run=dry_run)
        try:
            plan = policy.explain(facts.route, views) if dry_run else policy.choose(facts.route, views)
        except NoWorkerError as exc:
            raise ApiError(503, str(exc), "no_healthy_worker") from None
        if not dry_run:
            self.outcomes.decided(time.perf_counter() - began)
            self.facts.routed_to(facts, plan.prefill)
        if log.isEnabledFor(logging.DEBUG):  # the decision log: `kvroute serve --log-level debug`
            log.debug(
                "request %s -> prefill %s decode %s source %s: %s",
                request.request_id,
                plan.prefill,
                plan.decode,
                plan.kv_source,
                plan.why(),
            )
        return Decision(request, facts, plan, views)

    # ------------------------------------------------------------------ rewrite

    def rewrite(self, decision: Decision) -> Delivery:
        """The plan as requests to workers. The client's bytes go untouched when the plan needs no
        ``kv_transfer_params``; otherwise :func:`~kvroute.router.kv_params.build_legs` writes them (and
        never a combination vLLM refuses). Raises 503 ``unroutable_plan`` when the pool cannot carry it."""
        request, plan = decision.request, decision.plan
        if not self._needs_params(request, plan):
            return Delivery(plan.prefill, request.body)
        assert request.json is not None
        views = {v.id: v for v in decision.views}
        entry = decision.facts.conversation
        try:
            legs = build_legs(
                request.json,
                plan,
                views,
                protocol=self.protocol,
                request_id=request.request_id,
                conversation_params=entry.kv_transfer_params if entry is not None and plan.reuse_conversation else None,
                route=request.route,
            )
        except KVParamsError as exc:
            log.error("request %s: plan %s cannot be carried out: %s", request.request_id, plan.to_dict(), exc)
            raise ApiError(
                503, f"the routing plan cannot be carried out on this pool: {exc}", "unroutable_plan"
            ) from None
        if legs.final is not None:
            return Delivery(legs.final.worker_id, orjson.dumps(legs.final.body), legs)
        return Delivery(plan.decode, b"", legs)

    def _needs_params(self, request: ParsedRequest, plan: RoutePlan) -> bool:
        if not request.generation:
            return False
        local = not plan.disaggregated and not plan.kv_source
        if self.protocol == "none":
            return not local
        if self.protocol == "p2p":
            return not local or any(
                v is not None for v in (plan.kv_load_tiers, plan.max_offload_tokens, plan.max_load_tokens)
            )
        return True

    # ------------------------------------------------------------------ forward

    async def execute(self, decision: Decision) -> Response:
        """Carry the plan out and answer. Raises UpstreamError only while nothing has reached the client."""
        request = decision.request
        delivery = self.rewrite(decision)
        worker_id, body = delivery.worker_id, delivery.body
        legs = delivery.legs
        prefill_leg: PrefillLegAnswer | None = None
        if legs is not None and legs.prefill is not None:
            final, prefill_leg = await self._after_prefill(decision, legs, legs.prefill)
            worker_id, body = final.worker_id, orjson.dumps(final.body)
        request.tried.add(worker_id)
        opened = await self.forwarder.open(
            worker_id,
            request.method,
            request.path,
            self._headers_for(decision, worker_id),
            body,
            request.started,
            stream=request.stream,
            early_head=self._early_head(decision),
        )
        settle: Callable[[], None] | None = None
        if opened.awaits_first_bytes:  # the routed prefix counts until the engine has computed it
            settle = functools.partial(self.facts.settled, decision.facts)
        else:
            self.facts.settled(decision.facts)
        if opened.upstream.status in REFUSAL_STATUSES and opened.rest is None:
            # Refused before any work (vLLM's admission control answers 503 "retry on another instance").
            self.registry.release(worker_id)
            self.registry.reject(worker_id, opened.upstream.status, self.refusal_cooldown_s)
            raise Rejected(worker_id, opened.upstream.status, opened.upstream.headers, opened.first)
        if (
            request.conversation_id
            and self.conversations is not None
            and opened.rest is None
            and opened.upstream.status == 200
        ):
            await self._remember(decision, worker_id, opened.first)
        return self.forwarder.respond(
            opened,
            request.request_id,
            lambda result: self.report(decision, result, prefill_leg),
            self._debug_headers(decision),
            settle,
        )

    def _early_head(self, decision: Decision) -> bool:
        """Whether a stream's head goes to the client before its first token: when the plan expects that token
        within ``early_head_ttft_s``. The head held back buys a retry elsewhere if the worker fails before its
        first token; over a window of a few milliseconds that retry is almost never used, while the client
        reading the head together with the first token adds its head parsing (0.3-0.5 ms for a Python client)
        to every time to first token. A long prefill keeps the retry."""
        predicted = decision.plan.predicted_ttft_s
        return decision.request.stream and predicted is not None and predicted < self.early_head_ttft_s

    async def _after_prefill(self, decision: Decision, legs: Legs, prefill: Leg) -> tuple[Leg, PrefillLegAnswer | None]:
        """Run the prefill leg; the decode leg follows from its answer, or local recomputation when it failed.
        Also how the prefiller answered: when, and its own cached tokens (None after a fallback)."""
        request = decision.request
        try:
            answer = await self._prefill(decision, prefill)
            answered = time.perf_counter() - request.started
            final = legs.decode_leg(answer)
            if decision.facts.conversation is not None and decision.plan.reuse_conversation:
                self.kv_metrics.conversations.labels("reused").inc()
            usage = answer.get("usage") if isinstance(answer, dict) else None
            _, cached, _ = usage_counts(request.route, usage if isinstance(usage, dict) else None)
            return final, PrefillLegAnswer(answered, cached)
        except (UpstreamError, KVParamsError, PrefillFailed) as exc:
            self.kv_metrics.fallbacks.labels("prefill_leg").inc()
            limited.warning(
                f"prefill:{prefill.worker_id}",
                "request %s: prefill leg on %s failed (%s); recomputing on %s",
                decision.request.request_id,
                prefill.worker_id,
                exc,
                decision.plan.decode,
            )
            return legs.fallback_leg(), None

    def _headers_for(self, decision: Decision, worker_id: str) -> list[tuple[str, str]]:
        """The request's headers, plus the data-parallel rank that holds the prefix on this worker."""
        rank = decision.facts.ranks.get(worker_id)
        if rank is None:
            return decision.request.headers
        return [*decision.request.headers, (DP_RANK_HEADER, str(rank))]

    async def _prefill(self, decision: Decision, leg: Leg) -> Any:
        """Run a prefill-only leg to completion; its JSON answer feeds the decode leg."""
        request = decision.request
        opened = await self.forwarder.open(
            leg.worker_id,
            "POST",
            request.path,
            self._headers_for(decision, leg.worker_id),
            orjson.dumps(leg.body),
            request.started,
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
            self.registry.release(leg.worker_id)

    async def _remember(self, decision: Decision, worker_id: str, raw: bytes) -> None:
        """Keep the decoder's returned kv_transfer_params for the conversation's next turn."""
        if b'"kv_transfer_params"' not in raw:
            return
        store, cid = self.conversations, decision.request.conversation_id
        assert store is not None and cid is not None
        try:
            answer = orjson.loads(raw)
            prompt, _, completion = usage_counts(decision.request.route, answer.get("usage"))
            entry = entry_from_turn(worker_id, answer, decision.facts.keys or [], prompt or 0, completion or 0)
            if entry is not None:
                await store.put(cid, entry)
                self.kv_metrics.conversations.labels("stored").inc()
        except Exception as exc:  # never fail an answer that is already in hand
            limited.warning("conversation", "request %s: conversation not stored: %r", decision.request.request_id, exc)

    # ------------------------------------------------------------------ report

    def report(self, decision: Decision, result: Result, prefill_leg: PrefillLegAnswer | None = None) -> None:
        """Called once per answered request, when its last byte went out."""
        self.outcomes.record(decision.request, decision.facts, decision.plan, result, self.policy, prefill_leg)

    def _debug_headers(self, decision: Decision) -> list[tuple[bytes, bytes]] | None:
        if not (self.allow_debug and decision.request.wants_debug):
            return None
        summary = {k: v for k, v in decision.plan.to_dict().items() if k != "candidates"}
        return [(b"x-kvroute-plan", orjson.dumps(summary))]


def upstream_api_error(exc: UpstreamError) -> ApiError:
    if exc.kind == "timeout":
        return ApiError(504, f"upstream worker timed out: {exc}", "upstream_timeout")
    return ApiError(502, f"upstream worker failed: {exc}", "upstream_error")

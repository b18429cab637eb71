"""The per-request flow: facts -> policy -> executor -> outcome.

:class:`Pipeline` is the seam the KV-aware parts plug into without touching this module:

* :meth:`Pipeline.gather_facts` builds the :class:`RouteRequest`; a subclass adds tokenization and the
  index lookup when ``policy.needs_index``.
* :meth:`Pipeline.executor_for` picks how a :class:`RoutePlan` is carried out; the aggregated executor
  here forwards to ``plan.prefill``, a P/D executor can rewrite ``kv_transfer_params`` and run two legs.
* :meth:`Pipeline.report` turns the finished answer into a :class:`RouteOutcome` for ``policy.observe``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvroute.config import RouterConfig
from kvroute.policies.base import NoWorkerError, Policy, RouteOutcome, RoutePlan, RouteRequest
from kvroute.router.errors import ApiError, no_healthy_worker
from kvroute.router.forwarding import Forwarder, Result
from kvroute.router.metrics import RouterMetrics
from kvroute.router.registry import WorkerRegistry
from kvroute.router.transport import UpstreamError
from starlette.requests import Request
from starlette.responses import Response

log = logging.getLogger("kvroute.pipeline")


@dataclass(slots=True)
class RequestContext:
    """One client request, parsed once; shared by every step of the flow."""

    request_id: str
    method: str
    #: Path (and query) to call on the worker.
    path: str
    #: Metrics label: the route template, never the raw path.
    route: str
    #: Client headers already filtered for the worker (hop-by-hop removed, X-Request-Id set).
    headers: list[tuple[str, str]]
    body: bytes
    #: The parsed JSON body (None for bodies that are not a JSON object). Executors that change it must
    #: re-encode it into ``body``.
    json: dict[str, Any] | None
    model: str | None
    stream: bool
    started: float = field(default_factory=time.perf_counter)
    http: Request | None = None
    #: Workers already tried (a retry goes elsewhere).
    tried: set[str] = field(default_factory=set)
    facts: RouteRequest | None = None
    #: Free-form slots for later steps (tokens, conversation id, ...).
    extra: dict[str, Any] = field(default_factory=dict)


class Executor(Protocol):
    """Carries a plan out. Must raise UpstreamError only while nothing has reached the client."""

    async def execute(self, pipeline: Pipeline, ctx: RequestContext, plan: RoutePlan) -> Response: ...


class AggregatedExecutor:
    """One worker does prefill and decode: forward the request to ``plan.prefill`` as it is."""

    async def execute(self, pipeline: Pipeline, ctx: RequestContext, plan: RoutePlan) -> Response:
        worker = plan.prefill
        ctx.tried.add(worker)
        forwarder = pipeline.forwarder
        opened = await forwarder.open(worker, ctx.method, ctx.path, ctx.headers, ctx.body, ctx.started)
        return forwarder.respond(
            opened, ctx.request_id, lambda r: pipeline.report(ctx, plan, r), pipeline.debug_headers(ctx, plan)
        )


class Pipeline:
    """Routes one parsed request and answers it. Subclass to enrich facts or add executors."""

    def __init__(
        self,
        registry: WorkerRegistry,
        policy: Policy,
        forwarder: Forwarder,
        metrics: RouterMetrics,
        *,
        debug_headers: bool = False,
        executor: Executor | None = None,
        config: RouterConfig | None = None,
    ) -> None:
        #: The router's config (model facts, pool settings) for subclasses; None in bare unit tests.
        self.config = config
        self.registry = registry
        self.policy = policy
        self.forwarder = forwarder
        self.metrics = metrics
        self.allow_debug = debug_headers
        self.executor: Executor = executor or AggregatedExecutor()
        self._decision = metrics.decision.labels(policy.name or type(policy).__name__)

    # ------------------------------------------------------------------ hooks

    async def gather_facts(self, ctx: RequestContext, policy: Policy) -> RouteRequest:
        """The facts the policy decides on. The base version needs no I/O (no tokens, no index)."""
        data = ctx.json or {}
        max_tokens = data.get("max_completion_tokens", data.get("max_tokens"))
        latency_class = "interactive"
        if ctx.http is not None:
            latency_class = ctx.http.headers.get("x-kvroute-latency-class", latency_class)
        return RouteRequest(
            request_id=ctx.request_id,
            model=ctx.model or "",
            max_tokens=max_tokens if isinstance(max_tokens, int) else None,
            latency_class=latency_class,
        )

    def executor_for(self, ctx: RequestContext, plan: RoutePlan) -> Executor:
        return self.executor

    def report(self, ctx: RequestContext, plan: RoutePlan, result: Result) -> None:
        """Called once per answered request, when its last byte went out."""
        usage = result.usage or {}
        prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        model = ctx.model or ""
        if isinstance(prompt_tokens, int):
            self.metrics.child(self.metrics.prompt_tokens, model).inc(prompt_tokens)
        if isinstance(cached, int):
            self.metrics.child(self.metrics.cached_tokens, model).inc(cached)
        if result.ttfb_s is not None and ctx.stream:
            self.metrics.child(self.metrics.ttft, model).observe(result.ttfb_s)
        outcome = RouteOutcome(
            request_id=ctx.request_id,
            model=model,
            plan=plan,
            prompt_tokens=prompt_tokens if isinstance(prompt_tokens, int) else 0,
            cached_tokens=cached if isinstance(cached, int) else None,
            # Only a stream's first chunk is a time to first token; a whole JSON answer includes decoding.
            ttft_s=result.ttfb_s if ctx.stream else None,
            ok=result.ok,
        )
        try:
            self.policy.observe(outcome)
        except Exception:
            log.exception("policy %s failed to observe an outcome", self.policy.name)

    def debug_headers(self, ctx: RequestContext, plan: RoutePlan) -> list[tuple[bytes, bytes]] | None:
        if not self.allow_debug or ctx.http is None or ctx.http.headers.get("x-kvroute-debug") != "1":
            return None
        import orjson

        summary = {k: v for k, v in plan.to_dict().items() if k != "candidates"}
        return [(b"x-kvroute-plan", orjson.dumps(summary))]

    # ------------------------------------------------------------------ flow

    async def decide(self, ctx: RequestContext, exclude: Collection[str] = ()) -> RoutePlan:
        """Gather facts (once per request) and ask the policy, among healthy workers serving the model."""
        began = time.perf_counter()
        views = self.registry.views(ctx.model)
        if exclude:
            views = [v for v in views if v.id not in exclude]
        if not views:
            raise no_healthy_worker(ctx.model)
        if ctx.facts is None:
            ctx.facts = await self.gather_facts(ctx, self.policy)
        try:
            plan = self.policy.choose(ctx.facts, views)
        except NoWorkerError as exc:
            raise ApiError(503, str(exc), "no_healthy_worker") from None
        self._decision.observe(time.perf_counter() - began)
        if log.isEnabledFor(logging.DEBUG):  # the decision log: `kvroute serve --log-level debug`
            log.debug(
                "request %s -> prefill %s decode %s source %s: %s",
                ctx.request_id,
                plan.prefill,
                plan.decode,
                plan.kv_source,
                plan.reason,
            )
        return plan

    async def handle(self, ctx: RequestContext) -> Response:
        """Route, forward, retry once on another worker when the first one failed before answering."""
        plan = await self.decide(ctx)
        try:
            return await self.executor_for(ctx, plan).execute(self, ctx, plan)
        except UpstreamError as first:
            if first.kind == "timeout":
                raise _upstream_api_error(first) from None
            log.warning("request %s: %s; retrying on another worker", ctx.request_id, first)
            try:
                plan = await self.decide(ctx, exclude=ctx.tried)
            except ApiError:
                raise _upstream_api_error(first) from None
            self.metrics.retries.inc()
            try:
                return await self.executor_for(ctx, plan).execute(self, ctx, plan)
            except UpstreamError as second:
                raise _upstream_api_error(second) from None


def _upstream_api_error(exc: UpstreamError) -> ApiError:
    if exc.kind == "timeout":
        return ApiError(504, f"upstream worker timed out: {exc}", "upstream_timeout")
    return ApiError(502, f"upstream worker failed: {exc}", "upstream_error")


class ClientGone(Exception):
    """The client disconnected while we waited for the worker; the worker's request was cancelled."""


async def until_disconnect(request: Request, coro: Any) -> Any:
    """Await ``coro`` but cancel it when the client hangs up (after the body was read, receive() only
    returns on disconnect). One watcher task; the work itself runs in the current task."""
    current = asyncio.current_task()
    assert current is not None
    gone = False
    receive = request.receive

    async def watch() -> None:
        nonlocal gone
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone = True
                current.cancel()
                return

    watcher = asyncio.create_task(watch())
    try:
        return await coro
    except asyncio.CancelledError:
        if gone:
            current.uncancel()
            raise ClientGone() from None
        raise
    finally:
        watcher.cancel()

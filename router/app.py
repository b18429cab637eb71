"""The ASGI app: Starlette for the OpenAI surface (the two generation routes dispatched ahead of its
middleware), a FastAPI sub-app for admin and OpenAPI.

``create_app`` wires the parts (transport, registry, forwarder, policy, pipeline) and returns the app;
its lifespan starts the registry's probes and closes the pooled client. Everything is reachable from
``app.state.kvroute`` (:class:`RouterState`) so later parts (index, conversations) can hook in.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import orjson
from kvroute.config import RouterConfig
from kvroute.policies import Policy, create_policy
from kvroute.router.admin import build_admin_app
from kvroute.router.errors import ApiError, api_error_response, error_response, model_not_found
from kvroute.router.forwarding import Forwarder, upstream_headers
from kvroute.router.metrics import CONTENT_TYPE, RouterMetrics
from kvroute.router.parsing import check_generation, parse_json_object, read_body, request_id_of, sniff_passthrough
from kvroute.router.pipeline import ClientGone, Pipeline, RequestContext, until_disconnect
from kvroute.router.registry import WorkerRegistry
from kvroute.router.transport import Transport, make_transport
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvroute.app")

Hook = Callable[["RouterState"], Any]


@dataclass(slots=True)
class RouterState:
    """The running router's parts, shared by the routes and the admin API."""

    config: RouterConfig
    registry: WorkerRegistry
    policy: Policy
    pipeline: Pipeline
    forwarder: Forwarder
    transport: Transport
    metrics: RouterMetrics
    started_at: float = field(default_factory=time.time)
    #: Async callables run at start-up / shutdown (e.g. the indexer's subscribers), in order.
    on_startup: list[Hook] = field(default_factory=list)
    on_shutdown: list[Hook] = field(default_factory=list)
    #: Parts added by the full server (the indexer, the subscriber), for admin and tests.
    extras: dict[str, Any] = field(default_factory=dict)

    def expected_models(self) -> list[str]:
        names = [m.name for m in self.config.models]
        for worker in self.config.workers:
            names.extend(worker.models)
        return list(dict.fromkeys(names))


def settle_heap(gen0_threshold: int) -> None:
    """Move what start-up allocated out of the garbage collector's reach and collect young objects less
    often. Otherwise every full collection walks the app, its modules and the index on the request path:
    with 32 concurrent clients that was +25 ms of added p99 latency, +4 ms after (docs/benchmarks.md).
    The request path allocates no reference cycles worth collecting early."""
    if gen0_threshold <= 0:
        return
    gc.collect()
    gc.freeze()
    _, gen1, gen2 = gc.get_threshold()
    gc.set_threshold(gen0_threshold, max(gen1, 50), max(gen2, 100))


def create_app(
    config: RouterConfig,
    *,
    policy: Policy | None = None,
    transport: Transport | None = None,
    pipeline_cls: type[Pipeline] = Pipeline,
    admin_routers: list[Any] | None = None,
) -> Starlette:
    """Build the router app.

    ``pipeline_cls`` and ``admin_routers`` (FastAPI APIRouters) are the plug-in points for later parts.
    """
    metrics = RouterMetrics()
    c = config
    transport = transport or make_transport(c.http_client, c.connect_timeout_s, c.read_timeout_s)
    registry = WorkerRegistry(
        c.workers,
        transport,
        metrics,
        health_interval_s=c.health_interval_s,
        metrics_interval_s=c.metrics_interval_s,
        unhealthy_after=c.unhealthy_after,
        healthy_after=c.healthy_after,
        probe_timeout_s=min(c.connect_timeout_s + 1.0, c.health_interval_s + 1.0),
    )
    policy = policy or create_policy(config.policy, **config.policy_options)
    forwarder = Forwarder(transport, registry, metrics)
    pipeline = pipeline_cls(registry, policy, forwarder, metrics, debug_headers=config.debug_headers, config=config)
    state = RouterState(config, registry, policy, pipeline, forwarder, transport, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        await registry.start()
        for hook in state.on_startup:
            await hook(state)
        settle_heap(config.gc_gen0_threshold)
        try:
            yield
        finally:
            for hook in reversed(state.on_shutdown):
                try:
                    await hook(state)
                except Exception:
                    log.exception("shutdown hook failed")
            await registry.stop()
            await transport.aclose()

    admin = build_admin_app(state, extra_routers=admin_routers)
    hot = {
        "/v1/chat/completions": _generation(state, "/v1/chat/completions", "chat"),
        "/v1/completions": _generation(state, "/v1/completions", "completion"),
    }
    routes = [
        Route("/v1/chat/completions", hot["/v1/chat/completions"], methods=["POST"]),
        Route("/v1/completions", hot["/v1/completions"], methods=["POST"]),
        Route("/v1/models", _models(state), methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready(state), methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
        Mount("/admin", app=admin),
        Route("/{path:path}", _passthrough(state), methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    ]
    app = RouterApp(routes=routes, lifespan=lifespan)
    app.hot_paths = hot
    app.state.kvroute = state
    return app


class RouterApp(Starlette):
    """Starlette, with the two generation routes dispatched before its middleware and router.

    Their endpoints already turn every failure into a JSON error, so Starlette's error middleware and
    route matching only add per-request cost there (measured in docs/benchmarks.md).
    """

    hot_paths: dict[str, Callable[[Request], Any]]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.hot_paths.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                response = await endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


# ---------------------------------------------------------------------------------------------- routes


def _generation(state: RouterState, route: str, kind: str) -> Callable[[Request], Any]:
    limit = state.config.max_body_bytes

    async def endpoint(request: Request) -> Response:
        t0 = time.perf_counter()
        request_id = request_id_of(request)
        model_label = "unknown"
        try:
            body = await read_body(request, limit)
            data = parse_json_object(body)
            model, stream = check_generation(data, kind)
            if not state.registry.knows_model(model):
                raise model_not_found(model)
            model_label = model
            headers = upstream_headers(request.headers.raw, request_id)
            ctx = RequestContext(request_id, "POST", route, route, headers, body, data, model, stream, http=request)
            response = await until_disconnect(request, state.pipeline.handle(ctx))
        except ApiError as exc:
            response = api_error_response(exc, {"x-request-id": request_id})
        except ClientGone:
            log.info("request %s: client disconnected before the answer; upstream cancelled", request_id)
            response = error_response(499, "client closed the request", "client_closed")
        except Exception:
            log.exception("request %s failed", request_id)
            response = error_response(
                500, "internal router error", "internal_error", "server_error", {"x-request-id": request_id}
            )
        _count(state, route, response.status_code, model_label, t0)
        return response

    return endpoint


#: vLLM's engine-control endpoints: a client of the pool must not reset caches or put engines to sleep.
CONTROL_PATHS = frozenset(
    {
        "/reset_prefix_cache",
        "/reset_mm_cache",
        "/sleep",
        "/wake_up",
        "/is_sleeping",
        "/collective_rpc",
        "/start_profile",
        "/stop_profile",
        "/scale_elastic_ep",
        "/is_scaling_elastic_ep",
        "/pause",
        "/resume",
        "/is_paused",
        "/update_weights",
        "/init_weight_transfer",
        "/server_info",
    }
)


def _passthrough(state: RouterState) -> Callable[[Request], Any]:
    """Any other path (``/tokenize``, ``/v1/responses``...) goes to a healthy worker serving the model."""
    limit = state.config.max_body_bytes

    async def endpoint(request: Request) -> Response:
        t0 = time.perf_counter()
        request_id = request_id_of(request)
        route = "other"
        try:
            if request.url.path.rstrip("/") in CONTROL_PATHS:
                raise ApiError(
                    404,
                    f"{request.url.path} is an engine-control endpoint and is not proxied; call the worker directly",
                    "not_proxied",
                    "not_found_error",
                )
            body = await read_body(request, limit)
            data, model, stream = sniff_passthrough(body)
            if model and not state.registry.knows_model(model):
                raise model_not_found(model)
            path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
            ctx = RequestContext(
                request_id,
                request.method,
                path,
                route,
                upstream_headers(request.headers.raw, request_id),
                body,
                data,
                model or None,
                stream,
                http=request,
            )
            response = await until_disconnect(request, state.pipeline.handle(ctx))
        except ApiError as exc:
            response = api_error_response(exc, {"x-request-id": request_id})
        except ClientGone:
            response = error_response(499, "client closed the request", "client_closed")
        except Exception:
            log.exception("request %s failed", request_id)
            response = error_response(500, "internal router error", "internal_error", "server_error")
        _count(state, route, response.status_code, "-", t0)
        return response

    return endpoint


def _count(state: RouterState, route: str, status: int, model: str, t0: float) -> None:
    state.metrics.observe_request(route, status, model, time.perf_counter() - t0)


def _models(state: RouterState) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        cards: dict[str, dict[str, Any]] = {}
        for worker in state.registry.all():
            for model in worker.models:
                card = worker.model_cards.get(model) or {
                    "id": model,
                    "object": "model",
                    "owned_by": "kvroute",
                    "created": int(state.started_at),
                }
                cards.setdefault(model, card)
        return Response(orjson.dumps({"object": "list", "data": list(cards.values())}), media_type="application/json")

    return endpoint


async def _health(request: Request) -> Response:
    return Response(b'{"status":"ok"}', media_type="application/json")


def _ready(state: RouterState) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        ok, missing = state.registry.ready(state.expected_models())
        body = {
            "ready": ok,
            "models_without_healthy_worker": missing,
            "healthy_workers": sum(1 for w in state.registry.all() if w.healthy),
        }
        return Response(orjson.dumps(body), status_code=200 if ok else 503, media_type="application/json")

    return endpoint


def _metrics(state: RouterState) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return endpoint

"""The HTTP surface: Starlette for the OpenAI routes (the two generation routes dispatched ahead of its
middleware), a FastAPI sub-app for admin and OpenAPI.

:func:`create_app` takes the parts the composition root built (:class:`~kvroute.router.state.RouterState`)
and only speaks HTTP: read the body, :func:`~kvroute.router.requests.parse_request`, hand it to the
request flow, turn failures into OpenAI-style JSON errors. Its lifespan starts the state's services in
order and stops them in reverse.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any

import orjson
from fastapi import APIRouter
from kvroute.router.admin import build_admin_app
from kvroute.router.admin_auth import bearer_matches
from kvroute.router.errors import ApiError, api_error_response, error_response
from kvroute.router.heap import keep_freed_memory, settle_heap
from kvroute.router.http_body import ClientGone, read_body, until_disconnect
from kvroute.router.metrics import CONTENT_TYPE
from kvroute.router.paths import canonical_path
from kvroute.router.requests import (
    GENERATION_ROUTES,
    ParsedRequest,
    parse_request,
    request_id_from,
)
from kvroute.router.state import RouterState
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Mount, Route
from starlette.types import Receive, Scope, Send

log = logging.getLogger("kvroute.app")

Endpoint = Callable[[Request], Awaitable[Response]]


def create_app(state: RouterState, admin_routers: Sequence[APIRouter] = ()) -> Starlette:
    """The router app over ``state``; ``admin_routers`` (index admin, explain) join the /admin sub-app."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        started: list[Any] = []
        try:
            for service in state.services:
                await service.start()
                started.append(service)
            settle_heap(state.config.gc_gen0_threshold)
            keep_freed_memory(state.config.heap_trim_threshold_mb)
            yield
        finally:
            for service in reversed(started):
                try:
                    await service.stop()
                except Exception:
                    log.exception("stopping %s failed", type(service).__name__)

    admin = build_admin_app(state, extra_routers=list(admin_routers))
    hot = {path: _generation(state) for path in sorted(GENERATION_ROUTES)}
    routes = [
        *(Route(path, endpoint, methods=["POST"]) for path, endpoint in hot.items()),
        Route("/v1/models", _models(state), methods=["GET"]),
        Route("/health", _health, methods=["GET"]),
        Route("/ready", _ready(state), methods=["GET"]),
        Route("/metrics", _metrics(state), methods=["GET"]),
        Mount("/admin", app=admin),
        Route("/{path:path}", _passthrough(state), methods=["GET", "POST", "PUT", "DELETE", "PATCH", "OPTIONS"]),
    ]
    app = RouterApp(routes=routes, lifespan=lifespan, exception_handlers={Exception: _internal_error})
    app.hot_paths = hot
    app.state.kvroute = state
    return app


class RouterApp(Starlette):
    """Starlette, with the two generation routes dispatched before its middleware and router.

    Their endpoints already turn every failure into a JSON error, so Starlette's error middleware and
    route matching only add per-request cost there (measured in docs/benchmarks.md).
    """

    hot_paths: dict[str, Endpoint]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            # One spelling of the path for routing, checking and forwarding (kvroute.router.paths).
            path = scope["path"]
            canonical = canonical_path(path)
            if canonical != path:
                scope["path"] = canonical
                scope["raw_path"] = canonical.encode("latin-1", "replace")
        if scope["type"] == "http" and scope["method"] == "POST":
            endpoint = self.hot_paths.get(scope["path"])
            if endpoint is not None:
                scope["app"] = self
                response = await endpoint(Request(scope, receive, send))
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


# ---------------------------------------------------------------------------------------------- routes


def _generation(state: RouterState) -> Endpoint:
    """``/v1/completions``, ``/v1/chat/completions``, ``/v1/messages``, ``/v1/responses``: the path says which."""
    return _endpoint(state, generation=True)


def _passthrough(state: RouterState) -> Endpoint:
    """Any other path (``/tokenize``, ``/v1/embeddings``...) goes to a healthy worker serving the model."""
    return _endpoint(state, generation=False)


def _endpoint(state: RouterState, *, generation: bool) -> Endpoint:
    limit = state.config.max_body_bytes
    body_timeout = state.config.body_timeout_s
    mode = state.config.pool.client_kv_params
    flow = state.flow

    async def endpoint(request: Request) -> Response:
        t0 = time.perf_counter()
        raw = request.scope["headers"]
        request_id = request_id_from(raw)
        route, model_label = (request.scope["path"], "unknown") if generation else ("other", "-")
        try:
            body = await read_body(request, limit, body_timeout)
            parsed: ParsedRequest = parse_request(
                request.method,
                request.scope["path"],
                raw,
                body,
                client_kv_params=mode,
                request_id=request_id,
                forward_headers=state.forwarded_headers,
                query=request.scope.get("query_string", b"").decode("latin-1"),
            )
            if generation:
                model_label = parsed.model or "unknown"
            response = await until_disconnect(request.receive, flow.handle(parsed), request.scope)
        except ApiError as exc:
            if generation and exc.code == "model_not_found":
                model_label = "unknown"
            response = api_error_response(exc, {"x-request-id": request_id})
        except ClientGone:
            log.info("request %s: client disconnected before the answer; upstream cancelled", request_id)
            response = error_response(499, "client closed the request", "client_closed")
        except Exception:
            log.exception("request %s failed", request_id)
            response = error_response(
                500, "internal router error", "internal_error", "server_error", {"x-request-id": request_id}
            )
        state.metrics.observe_request(route, response.status_code, model_label, time.perf_counter() - t0)
        return response

    return endpoint


async def _internal_error(request: Request, exc: Exception) -> Response:
    """The last resort: whatever escaped a route is still an OpenAI-style JSON error, never plain text."""
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal router error", "internal_error", "server_error")


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
        body = state.readiness()
        return Response(orjson.dumps(body), status_code=200 if body["ready"] else 503, media_type="application/json")

    return endpoint


def _metrics(state: RouterState) -> Callable[[Request], Any]:
    async def endpoint(request: Request) -> Response:
        token = state.config.metrics_token
        if token and not bearer_matches(request, token):
            return error_response(401, "/metrics needs 'Authorization: Bearer <metrics token>'", "unauthorized")
        return Response(state.metrics.render(), media_type=CONTENT_TYPE)

    return endpoint

"""Admin REST (FastAPI, so operators get an OpenAPI page at ``/admin/docs``): the worker list, adding and
removing workers at run time. Secure by default (:mod:`kvroute.router.admin_auth`): a bearer token when
``admin_token`` is configured, else read-only routes for loopback clients only. Workers added at run time
must match ``admin_worker_allowlist`` and are never link-local (cloud metadata) addresses unless listed.

The index inspection and route explain parts are FastAPI ``APIRouter``s the composition root passes to
:func:`build_admin_app`; they depend on :func:`require_admin` and read the state with :func:`state_of`.
"""

from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from kvroute.config import WorkerConfig
from kvroute.router.admin_auth import check_admin, worker_refusal
from kvroute.router.errors import ApiError, api_error_response, error_response
from kvroute.router.state import RouterState
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response


def state_of(request: Request) -> RouterState:
    return cast(RouterState, request.app.state.kvroute)


async def require_admin(request: Request) -> None:
    """Bearer token when configured; without one, read-only from loopback only (:mod:`.admin_auth`)."""
    check_admin(request, state_of(request).config.admin_token)


async def require_admin_read(request: Request) -> None:
    """:func:`require_admin` for a POST that changes nothing (a dry run)."""
    check_admin(request, state_of(request).config.admin_token, read_only=True)


def require_one_process(state: RouterState) -> None:
    """Run-time worker changes would reach one of several serving processes (each keeps its own registry):
    refused with ``processes`` > 1, where the config file and SIGHUP reach them all."""
    if state.config.processes > 1:
        raise ApiError(
            409,
            f"this router runs {state.config.processes} serving processes, each with its own worker list: "
            "change workers in the config file and reload (SIGHUP to the parent reaches every process)",
            "multi_process",
            "conflict",
        )


class RemoveWorker(BaseModel):
    id: str | None = None
    url: str | None = None


router = APIRouter(dependencies=[Depends(require_admin)])


@router.get("/workers", summary="List workers with health, models and load")
async def list_workers(request: Request) -> dict[str, Any]:
    return {"workers": [w.to_dict() for w in state_of(request).registry.all()]}


@router.post("/workers", status_code=201, summary="Add a worker (probed at once)")
async def add_worker(request: Request) -> dict[str, Any]:
    raw = await request.body()
    try:
        cfg = WorkerConfig.model_validate_json(raw)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ApiError(400, f"invalid worker: {problems}", "invalid_worker") from None
    state = state_of(request)
    require_one_process(state)
    refusal = worker_refusal(cfg.url, state.config.admin_worker_allowlist)
    if refusal is not None:
        raise ApiError(403, f"worker refused: {refusal}", "worker_not_allowed", "permission_error")
    registry = state.registry
    if registry.get(cfg.worker_id) is not None:
        raise ApiError(409, f"worker {cfg.worker_id!r} already exists", "worker_exists", "conflict")
    added = await registry.add(cfg)
    return added.to_dict()


@router.delete("/workers/{worker_id}", summary="Remove a worker by id")
async def remove_worker(worker_id: str, request: Request) -> dict[str, Any]:
    return _remove(request, worker_id)


@router.delete("/workers", summary='Remove a worker given {"id"} or {"url"} in the body')
async def remove_worker_by_body(request: Request) -> dict[str, Any]:
    try:
        spec = RemoveWorker.model_validate_json(await request.body() or b"{}")
    except ValidationError:
        raise ApiError(400, 'body must be {"id": ...} or {"url": ...}', "invalid_worker") from None
    worker_id = spec.id
    if worker_id is None and spec.url:
        url = spec.url.rstrip("/")
        worker_id = next((w.id for w in state_of(request).registry.all() if w.url == url), None)
        if worker_id is None:
            raise ApiError(404, f"no worker with url {spec.url!r}", "worker_not_found", "not_found_error")
    if worker_id is None:
        raise ApiError(400, 'body must be {"id": ...} or {"url": ...}', "invalid_worker")
    return _remove(request, worker_id)


def _remove(request: Request, worker_id: str) -> dict[str, Any]:
    require_one_process(state_of(request))
    try:
        state = state_of(request).registry.remove(worker_id)
    except KeyError:
        raise ApiError(404, f"no worker {worker_id!r}", "worker_not_found", "not_found_error") from None
    return {"removed": state.id, "url": state.url}


def build_admin_app(state: RouterState, extra_routers: list[APIRouter] | None = None) -> FastAPI:
    """The admin sub-app, mounted at /admin by create_app."""
    app = FastAPI(title="kvroute admin", version="0.1.0", docs_url="/docs", openapi_url="/openapi.json")
    app.state.kvroute = state
    app.include_router(router)
    for extra in extra_routers or []:
        app.include_router(extra)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> Response:
        return api_error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> Response:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        return error_response(400, problems, "invalid_request")

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), None)

    return app

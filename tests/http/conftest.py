"""Fixtures for the router tests: fake workers and a router, all real HTTP servers on 127.0.0.1."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx
import pytest
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.policies import Policy

from tests.http.upstream import FakeWorker, serve, serve_worker


@contextlib.asynccontextmanager
async def run_router(
    workers: Sequence[str | dict[str, Any]], impl: Policy | None = None, http: Any = "httptools", **settings: Any
) -> AsyncIterator[tuple[str, Any]]:
    """A router app served by uvicorn; yields (base URL, app). ``impl``: a policy instance to use;
    ``http``: uvicorn's protocol (``kvroute serve``'s own: :func:`kvroute.apps.http_protocol.guarded_protocol`)."""
    specs = [w if isinstance(w, dict) else {"url": w} for w in workers]
    settings.setdefault("policy", "round_robin")  # the proxy mechanics tests want a predictable spread
    settings.setdefault("health_interval_s", 0.1)
    settings.setdefault("metrics_interval_s", 0.1)
    config = RouterConfig.model_validate({"workers": specs, **settings})
    app = build_app(config, policy=impl)
    async with serve(app, lifespan="on", http=http) as url:
        yield url, app


@pytest.fixture(params=["native", "aiohttp", "httpx"])
def http_client(request: pytest.FixtureRequest) -> str:
    """Transport-sensitive tests run with every upstream client."""
    return request.param


@pytest.fixture
async def two_workers() -> AsyncIterator[tuple[FakeWorker, FakeWorker]]:
    async with serve_worker(FakeWorker("w1")) as w1, serve_worker(FakeWorker("w2")) as w2:
        yield w1, w2


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10.0, trust_env=False) as c:
        yield c

"""Fixtures for end-to-end KV routing: a simulated fleet and the full router (build_app), real sockets."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet

from tests.http.upstream import serve
from tests.polling import eventually as eventually

FAST = 0.01


def words(n: int, prefix: str = "w") -> str:
    """A prompt of exactly ``n`` tokens for the simulated workers' built-in tokenizer."""
    return " ".join(f"{prefix}{i}" for i in range(n))


@contextlib.asynccontextmanager
async def routed_fleet(
    n: int = 2,
    *,
    roles: list[str] | None = None,
    policy: str = "kvaware",
    preset: str = "tiny",
    fleet_options: dict[str, Any] | None = None,
    **router: Any,
) -> AsyncIterator[tuple[SimFleet, str, Any]]:
    """A simulated fleet and the full router in front of it; yields (fleet, router URL, app)."""
    fleet = SimFleet(n, preset, time_scale=FAST, roles=roles, **(fleet_options or {}))
    async with fleet:
        config = fleet.serve_config(policy=policy, health_interval_s=0.2, metrics_interval_s=0.2, **router)
        app = build_app(RouterConfig.model_validate(config))
        async with serve(app, lifespan="on") as url:
            yield fleet, url, app


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c

"""Fixtures for the simulator tests: fleets started in the test's own loop (real sockets, real HTTP)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

import httpx
import pytest
from kvroute.sim.fleet import SimFleet

#: Small and fast: evictions happen, waits are short.
FAST = 0.01


@pytest.fixture
async def make_fleet() -> AsyncIterator[Callable[..., Any]]:
    fleets: list[SimFleet] = []

    async def factory(n: int = 2, preset: str = "tiny", **kwargs: Any) -> SimFleet:
        kwargs.setdefault("time_scale", FAST)
        fleet = SimFleet(n, preset, **kwargs)
        await fleet.start()
        fleets.append(fleet)
        return fleet

    yield factory
    for fleet in fleets:
        await fleet.stop()


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as c:
        yield c


def words(n: int, prefix: str = "w") -> str:
    """A prompt of exactly ``n`` built-in tokens."""
    return " ".join(f"{prefix}{i}" for i in range(n))

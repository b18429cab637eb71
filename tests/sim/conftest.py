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


#: The fields of vLLM's ``KVEventsConfig`` as released vLLM (0.32, 0.33) serializes it per rank.
KV_EVENTS_CONFIG_FIELDS = {
    "enable_kv_cache_events",
    "publisher",
    "endpoint",
    "replay_endpoint",
    "buffer_steps",
    "hwm",
    "max_queue_size",
    "topic",
}


def event_sources(body: dict[str, Any]) -> list[dict[str, Any]]:
    """``GET /kv_event_sources``'s answer (rank -> publisher config) as a list sorted by rank, each entry with
    its ``data_parallel_rank``; checks the shape on the way."""
    out = []
    for key, config in body.items():
        assert key.isdigit() and set(config) == KV_EVENTS_CONFIG_FIELDS, (key, config)
        assert config["enable_kv_cache_events"] is True and config["publisher"] == "zmq"
        out.append({**config, "data_parallel_rank": int(key)})
    return sorted(out, key=lambda s: s["data_parallel_rank"])

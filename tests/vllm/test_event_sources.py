"""vLLM's own ``GET /kv_event_sources`` (vLLM >= 0.32) tells the router where each server publishes."""

from __future__ import annotations

import pytest
from kvroute.router.discovery.event_sources import lookup_event_sources
from kvroute.router.transport import make_transport

from .servers import VllmServer

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600, func_only=True)]


@pytest.mark.parametrize("which", ["a", "b"])
async def test_real_vllm_reports_its_event_and_replay_endpoints(which: str, vllm_pool: list[VllmServer]) -> None:
    server = next(s for s in vllm_pool if s.name == which)
    transport = make_transport("auto", 5.0, 30.0)
    try:
        lookup = await lookup_event_sources(transport, server.url)
    finally:
        await transport.aclose()
    assert lookup.outcome == "found", lookup.reason
    (source,) = lookup.sources
    assert source.rank == 0
    assert source.endpoint == server.events and source.replay == server.replay and source.topic == server.topic

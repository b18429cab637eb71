"""A burst sharing a new prefix lands on one worker before any of its KV events exist (routed prefixes)."""

from __future__ import annotations

import asyncio
import collections

import httpx
import orjson
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.sim.fleet import SimFleet

from tests.end_to_end.conftest import words
from tests.end_to_end.test_end_to_end import metric
from tests.http.upstream import serve


async def burst(ttl_s: float) -> tuple[collections.Counter[str], int, float]:
    """Six concurrent requests sharing a 480-token prefix nobody has seen: (where each went, tokens the
    engines served from cache, routed-prefix hits)."""
    # Slow enough (x5) that the burst is decided while the first prefill still runs.
    async with SimFleet(3, "tiny", time_scale=5.0) as fleet:
        config = fleet.serve_config(
            policy="kvaware",
            health_interval_s=0.2,
            metrics_interval_s=0.2,
            debug_headers=True,
            routed_prefix_ttl_s=ttl_s,
        )
        async with (
            serve(build_app(RouterConfig.model_validate(config)), lifespan="on") as url,
            httpx.AsyncClient(timeout=30) as client,
        ):
            prefix = words(480, "burst")

            async def one(i: int) -> httpx.Response:
                body = {"model": fleet.model, "prompt": f"{prefix} q{i}", "max_tokens": 2}
                return await client.post(f"{url}/v1/completions", json=body, headers={"x-kvroute-debug": "1"})

            answers = await asyncio.gather(*(one(i) for i in range(6)))
            assert all(r.status_code == 200 for r in answers)
            where = collections.Counter(orjson.loads(r.headers["x-kvroute-plan"])["prefill"] for r in answers)
            cached = sum(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] for r in answers)
            hits = metric((await client.get(f"{url}/metrics")).text, "kvroute_routed_prefix_hits_total")
    return where, cached, hits


async def test_a_burst_with_a_new_prefix_is_colocated_and_reuses_it() -> None:
    """The followers queue behind the request computing the prefix until that queue outweighs computing it
    again on an idle worker by more than the model's own error: at most two workers compute it, every
    follower is served it from cache, and a worker stays free."""
    where, cached, hits = await burst(ttl_s=30)
    assert len(where) <= 2 and max(where.values()) >= 3, where
    assert hits >= 4
    assert cached >= 4 * 464  # the followers were served the prefix from cache


async def test_without_routed_prefixes_the_burst_spreads() -> None:
    where, _, hits = await burst(ttl_s=0)
    assert len(where) >= 2, where  # load balancing alone: several workers compute the same prefix
    assert hits == 0

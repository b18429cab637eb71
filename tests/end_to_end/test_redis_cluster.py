"""The router in front of a simulated fleet with its index on a real local Redis Cluster: routing by the
shared index from two replicas, and a master failover under a steady stream with no failed request."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import orjson
import pytest
from kvroute.apps.build import build_app
from kvroute.config import RouterConfig
from kvroute.indexer.service import KVIndexer

from tests.end_to_end.conftest import eventually, routed_fleet, words
from tests.end_to_end.test_end_to_end import completion, metric
from tests.http.upstream import serve
from tests.redis_cluster import LocalCluster


def cluster_index(url: str, **extra: Any) -> dict[str, Any]:
    return {"backend": "redis", "redis_url": url, "redis_cluster": True, **extra}


#: The router is told prefill is slow, so that a cached prefix clearly outweighs the little queue a
#: steady stream leaves on a worker (at the fleet's time scale both would be a fraction of a millisecond).
SLOW_PREFILL = {"models": {"sim-tiny": {"prefill_tokens_per_s": 2000.0}}}


async def lookup_blocks(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> dict[str, int]:
    """What the router's index (the cluster) answers for a prompt: blocks per worker."""
    r = await client.post(f"{url}/admin/index/lookup", json={"model": model, "prompt": prompt})
    if r.status_code != 200:
        return {}
    return {m["worker"]: m["blocks"] for m in r.json()["matches"]}


async def routed_to(client: httpx.AsyncClient, url: str, model: str, prompt: str) -> str:
    r = await client.post(f"{url}/v1/completions", headers={"x-kvroute-debug": "1"}, json=completion(model, prompt))
    assert r.status_code == 200, r.text
    return str(orjson.loads(r.headers["x-kvroute-plan"])["prefill"])


async def test_replicas_route_by_a_cluster_index(cluster_url: str, client: httpx.AsyncClient) -> None:
    """One router's embedded indexer writes the cluster; it and a second, reading-only replica route a
    prompt to the worker holding it."""
    async with routed_fleet(2, debug_headers=True, index=cluster_index(cluster_url)) as (fleet, url, _):
        holder = fleet[1]
        prompt = words(160, "cluster")
        await client.post(f"{holder.url}/v1/completions", json=completion(fleet.model, prompt))

        async def indexed() -> bool:
            return (await lookup_blocks(client, url, fleet.model, prompt)).get(holder.worker_id, 0) >= 10

        await eventually(indexed, what="the holder's blocks in the cluster")
        assert await routed_to(client, url, fleet.model, prompt) == holder.worker_id
        config = fleet.serve_config(
            policy="kvaware",
            debug_headers=True,
            health_interval_s=0.2,
            index=cluster_index(cluster_url, subscribe=False),
        )
        async with serve(build_app(RouterConfig.model_validate(config)), lifespan="on") as replica:
            assert await routed_to(client, replica, fleet.model, prompt) == holder.worker_id


@pytest.fixture
def failover_cluster() -> Iterator[LocalCluster]:
    """3 masters with a replica each; a master missing for 1 s is failed over."""
    cluster = LocalCluster(masters=3, replicas=1, node_timeout_ms=1000)
    cluster.start()
    yield cluster
    cluster.stop()


@contextlib.asynccontextmanager
async def steady_stream(client: httpx.AsyncClient, url: str, model: str, statuses: list[int]) -> AsyncIterator[None]:
    """Two clients sending requests back to back until the block ends; every outcome lands in ``statuses``
    (-1: no answer at all). The prompts share their one full block, so they evict nothing from the small
    simulated caches."""
    stop = asyncio.Event()
    shared = words(16, "stream")

    async def one_client(name: str) -> None:
        i = 0
        while not stop.is_set():
            try:
                r = await client.post(f"{url}/v1/completions", json=completion(model, f"{shared} {name}{i}"))
                statuses.append(r.status_code)
            except httpx.HTTPError:
                statuses.append(-1)
            i += 1

    tasks = [asyncio.create_task(one_client(name)) for name in ("a", "b")]
    try:
        yield
    finally:
        stop.set()
        await asyncio.gather(*tasks)


async def test_master_failover_fails_no_request(
    failover_cluster: LocalCluster, client: httpx.AsyncClient, caplog: pytest.LogCaptureFixture
) -> None:
    """kill -9 of the master holding the model's slot under a steady stream: no request fails (load-only
    routing meanwhile), a replica is promoted, the indexer rewrites its local views into it, and lookups
    hit again, on prefixes stored during the outage and after it."""
    cluster = failover_cluster
    options = {"debug_headers": True, "policy_options": SLOW_PREFILL, "index": cluster_index(cluster.url)}
    async with routed_fleet(2, **options) as (fleet, url, app):
        indexer: KVIndexer = app.state.kvroute.indexer
        model = fleet.model
        before, during, after = (words(160, tag) for tag in ("before", "during", "after"))
        await client.post(f"{fleet[0].url}/v1/completions", json=completion(model, before))
        await eventually(lambda: _holds(client, url, model, before, fleet[0].worker_id), what="the first prefix")
        assert await routed_to(client, url, model, before) == fleet[0].worker_id
        slot = cluster.keyslot(f"kvr:{{{model}}}:owners")
        victim = cluster.owner_of_slot(slot)
        unavailable = {"reason": "index_unavailable"}
        fallbacks = metric((await client.get(f"{url}/metrics")).text, "kvroute_kv_fallbacks_total", **unavailable)

        statuses: list[int] = []
        async with steady_stream(client, url, model, statuses):
            await eventually(lambda: len(statuses) >= 10, what="the stream to run")
            cluster.kill(victim)
            # Events while the model's master is gone: the write fails, the local view keeps them.
            await client.post(f"{fleet[1].url}/v1/completions", json=completion(model, during))
            await eventually(lambda: not indexer.backend_ok, what="the index marked down")
            await eventually(
                lambda: cluster.owner_of_slot(slot).alive() and cluster.healthy(), timeout=30, what="a replica promoted"
            )
            await eventually(lambda: indexer.backend_ok, timeout=20, what="the index rewritten")
            served_during = len(statuses)
            # Written only by the recovery's rewrite of the local views (the write at the time failed).
            assert (await lookup_blocks(client, url, model, during)).get(fleet[1].worker_id, 0) >= 10
            await eventually(lambda: len(statuses) >= served_during + 10, what="the stream after the failover")

        promoted = cluster.owner_of_slot(slot)
        assert promoted is not victim and promoted.alive()
        assert statuses and all(s == 200 for s in statuses), sorted(set(statuses))
        text = (await client.get(f"{url}/metrics")).text
        assert metric(text, "kvroute_kv_fallbacks_total", **unavailable) > fallbacks
        registry = app.state.kvroute.metrics.registry  # this router's own (other tests' indexers share /metrics)
        assert registry.get_sample_value("kvroute_index_backend_up", {"backend": "redis"}) == 1
        errors = [
            registry.get_sample_value("kvroute_index_backend_errors_total", {"backend": "redis", "op": op}) or 0
            for op in ("apply", "lookup")
        ]
        assert all(n >= 1 for n in errors), errors  # the writes and the lookups both met the outage
        # The index works on the promoted master: a fresh prefix is written there and routed to.
        assert await routed_to(client, url, model, during) == fleet[1].worker_id
        await client.post(f"{fleet[0].url}/v1/completions", json=completion(model, after))
        await eventually(lambda: _holds(client, url, model, after, fleet[0].worker_id), what="the fresh prefix")
        assert await routed_to(client, url, model, after) == fleet[0].worker_id
        with promoted.client() as c:
            assert int(c.execute_command("CLUSTER COUNTKEYSINSLOT", slot)) >= 30
        messages = [r.getMessage() for r in caplog.records if r.name == "kvroute.indexer"]
        assert any(m.startswith("index backend redis unavailable") for m in messages)
        assert any(m.startswith("index backend redis is back: 2 workers rewritten") for m in messages)


async def _holds(client: httpx.AsyncClient, url: str, model: str, prompt: str, worker: str) -> bool:
    return (await lookup_blocks(client, url, model, prompt)).get(worker, 0) >= 10
